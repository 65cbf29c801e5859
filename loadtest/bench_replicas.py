"""The router a bench run starts: one ``kvrouter serve`` (N workers), or R replicas on Redis.

The decision-quality cell compares one process, N workers and R replicas on the
same workload: ``kvrouter bench --router-workers N`` passes ``router.workers: N`` to
every router a policy run starts, and ``--router-replicas R`` starts, per policy run, a
``redis-server`` (no persistence), ``kvrouter indexer`` feeding it the engines' KV
events, and R ``kvrouter serve`` on that index (:mod:`loadtest.chaos_env`'s children,
the same as ``kvrouter chaos --replicas``). The replicas share their fleet state through
the same Redis (``router.fleet_state`` defaults to the index URL), so what the run
measures is the shipped cross-host setup. ``--router-setting KEY=VALUE`` adds router
config keys.

The replay spreads **sessions** (conversations) round-robin over the replicas, in order
of their start, as ``kvrouter chaos --replicas`` does: a client's conversation rides one
keep-alive connection, which a load balancer in front of replicas pins to one replica,
so per-request spreading would model no real deployment. Single-turn workloads have
one request a session, so for them this is round-robin by request.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from loadtest.chaos_env import IndexerChild, RedisChild, RouterChild
from loadtest.fleet import EngineFleet, FleetError, scrape, scrape_labelled
from loadtest.replay import Replayer, key_values
from loadtest.workloads import Workload, WorkloadError


@dataclass(frozen=True, slots=True)
class RouterShape:
    """How many router processes a policy run starts, and extra ``router`` config keys."""

    workers: int = 1
    replicas: int = 1
    settings: dict[str, Any] = field(default_factory=dict)
    tuning: dict[str, Any] = field(default_factory=dict)
    """The lab's knobs (router/tuning.py) every router of the run gets (``--tuning``)."""
    redis_index: bool = False
    """One replica on the Redis index too: separates what the index path costs from what
    spreading decisions over replicas costs (more than one replica always uses Redis)."""
    local_index: bool = False
    """Several replicas, each following the engines' KV events into its own in-memory index
    (``index: memory``), Redis carrying only their load, decisions and order
    (``router.fleet_state``): no ``kvrouter indexer``, and a lookup never leaves the process."""

    @property
    def on_redis(self) -> bool:
        return self.redis_index or self.replicas > 1

    def meta(self) -> dict[str, Any]:
        """What results.json's meta and report.md's header record."""
        out: dict[str, Any] = {"router_workers": self.workers, "router_replicas": self.replicas}
        if self.local_index:
            out["router_index"] = "memory per replica (each follows the engines' events), load shared through Redis"
        elif self.on_redis:
            out["router_index"] = "redis (kvrouter indexer), load shared through Redis"
        if self.settings:
            out["router_settings"] = self.settings
        if self.tuning:
            out["router_tuning"] = self.tuning
        return out


def parse_settings(items: list[str]) -> dict[str, Any]:
    """``["expose_decision_headers=true"]`` -> router keys, each checked by the config's own model.

    Values are read as YAML scalars (``false``, ``0.5``, ``abc``), as the config file would
    read them; keys the bench sets itself (policy, workers, port, host, weights) have flags
    of their own.
    """
    from pydantic import ValidationError

    from kvconfig import RouterSettings

    raw = {k: yaml.safe_load(v) if v else v for k, v in key_values(items, "--router-setting").items()}
    owned = sorted(set(raw) & {"policy", "workers", "port", "host", "weights"})
    if owned:
        raise WorkloadError(f"--router-setting {owned[0]}: the bench sets it (see --policies, --router-workers, --kv-weight)")
    try:
        return RouterSettings(**raw).model_dump(include=set(raw), mode="json")
    except ValidationError as e:
        err = e.errors()[0]
        raise WorkloadError(f"--router-setting {'.'.join(map(str, err['loc']))}: {err['msg']}") from e


def parse_tuning(items: list[str]) -> dict[str, Any]:
    """``["kv_aware.cpu_tier=0.9", "defer_cold_prompts=false"]`` -> the lab's knobs
    (router/tuning.py), checked by :class:`router.tuning.Tuning`; a dotted key sets a field of
    a nested group. Values are YAML scalars, as in ``--router-setting``."""
    from pydantic import ValidationError

    from router.tuning import Tuning

    nested: dict[str, Any] = {}
    for key, value in key_values(items, "--router-tuning").items():
        group, _, field_name = key.rpartition(".")
        (nested.setdefault(group, {}) if group else nested)[field_name] = yaml.safe_load(value) if value else value
    try:
        Tuning(**nested)
    except ValidationError as e:
        err = e.errors()[0]
        raise WorkloadError(f"--router-tuning {'.'.join(map(str, err['loc']))}: {err['msg']}") from e
    return nested


class Replicas:
    """Redis, ``kvrouter indexer`` and R ``kvrouter serve`` on one index (or R ``kvrouter
    serve`` on their own in-memory indexes: :attr:`RouterShape.local_index`); all stopped on exit."""

    def __init__(self, fleet: EngineFleet, policy: str, workdir: Path, shape: RouterShape,
                 weights: dict[str, Any] | None = None) -> None:
        self.fleet = fleet
        self.policy = policy
        self.workdir = workdir
        self.shape = shape
        self.weights = weights
        self.routers: list[RouterChild] = []
        self.decisions: list[int] = []
        self._stack = ExitStack()

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self.routers]

    @property
    def url(self) -> str:
        """The first replica: the one the decision-time probe asks."""
        return self.routers[0].url

    def __enter__(self) -> Replicas:
        try:
            self._start()
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def _start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        redis = RedisChild(self.workdir).start()
        self._stack.callback(redis.stop)
        router: dict[str, Any] = {**self.shape.settings, "host": "127.0.0.1", "policy": self.policy,
                                  "workers": self.shape.workers}
        if self.weights:
            router["weights"] = self.weights
        config = {"models": [self.fleet.model_config()], "router": router, "index": redis.url}
        if self.shape.local_index:
            router["fleet_state"] = redis.url
            config["index"] = "memory"
        else:
            path = self.workdir / "indexer.yaml"  # the indexer routes nothing: a policy it knows
            path.write_text(yaml.safe_dump({**config, "router": {**router, "policy": "kv_aware"}}))
            indexer = IndexerChild(path, self.workdir)
            self._stack.callback(indexer.stop)
            _wait_for_streams(f"http://127.0.0.1:{indexer.port}", len(self.fleet.engines), 10.0)
        for i in range(self.shape.replicas):
            r = RouterChild(f"router-{self.policy}-{i}", config, self.workdir, self.shape.tuning)
            self._stack.callback(r.stop)
            self.routers.append(r.start())

    def metrics(self) -> dict[str, float]:
        """Every replica's ``/metrics`` summed (counters and histograms add; an unreadable page adds nothing)."""
        total: dict[str, float] = {}
        for u in self.urls:
            try:
                page = scrape(u + "/metrics")
            except (httpx.HTTPError, ValueError):
                continue
            for k, v in page.items():
                total[k] = total.get(k, 0.0) + v
        return total

    def reasons(self) -> dict[str, float]:
        """Routing decisions by reason, over every replica; each replica's total lands in
        :attr:`decisions` (results.json's ``replica_decisions``: the spread really happened)."""
        self.decisions = []
        return self._labelled("kvrouter_routing_decisions_total", "reason", self.decisions)

    def sequenced(self) -> dict[str, float]:
        """Decisions committed to the replicas' shared order by outcome (first, again, moved,
        failed: router/fleet/stream.py), over every replica."""
        return self._labelled("kvrouter_sequenced_decisions_total", "outcome")

    def sequence_ms(self) -> dict[str, float]:
        """Mean milliseconds a decision spent in the shared order, by stage (wait for this
        process's earlier commits, commit), over every replica."""
        sums = self._labelled("kvrouter_sequence_seconds_sum", "stage")
        counts = self._labelled("kvrouter_sequence_seconds_count", "stage")
        return {k: round(1e3 * v / counts[k], 3) for k, v in sums.items() if counts.get(k)}

    def _labelled(self, sample: str, label: str, per_replica: list[int] | None = None) -> dict[str, float]:
        total: dict[str, float] = {}
        for u in self.urls:
            try:
                page = scrape_labelled(u + "/metrics", sample, label)
            except (httpx.HTTPError, ValueError):
                page = {}
            if per_replica is not None:
                per_replica.append(int(sum(page.values())))
            for k, v in page.items():
                total[k] = total.get(k, 0.0) + v
        return total


def _wait_for_streams(indexer_url: str, streams: int, timeout_s: float) -> None:
    """Until the indexer follows every engine's event stream (best effort, as
    :meth:`loadtest.fleet.Router._wait_for_event_streams`): before that kv_aware's first
    decisions find an empty index, which measures start-up, not the policy."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            rows = httpx.get(indexer_url + "/debug/streams", timeout=2.0).json()
            if len(rows) >= streams and all(r.get("connected") for r in rows):
                return
        except (httpx.HTTPError, ValueError, AttributeError):
            pass
        time.sleep(0.05)


class SpreadReplayer(Replayer):
    """A :class:`Replayer` whose sessions go round-robin (by start order) over several routers."""

    def __init__(self, targets: list[str], model: str, **kwargs: Any) -> None:
        if not targets:
            raise FleetError("no router to replay against")
        super().__init__(targets[0], model, **kwargs)
        self.targets = [t.rstrip("/") for t in targets]
        self._by_session: dict[str, str] = {}

    async def run(self, workload: Workload) -> Any:
        self._by_session = {s.session_id: self.targets[i % len(self.targets)] for i, s in enumerate(workload.sessions)}
        return await super().run(workload)

    def target_for(self, session_id: str) -> str:
        return self._by_session.get(session_id, self.target)
