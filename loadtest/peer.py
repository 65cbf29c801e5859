"""The Rust ``vllm-router`` (pip ``vllm-router``) as a peer in front of a simulated fleet.

``kvrouter bench --peer vllm-router[:POLICY]`` runs it as one more column and
``benchmarks/bench_router_overhead.py`` measures its overhead; both start it here, so
its command line lives in one place. :class:`VllmRouter` has :class:`~loadtest.fleet.Router`'s
shape (a context manager with ``.url``, always stopped). Its ``kv_aware`` policy is fed
by the engines' ZMQ KV event streams (vLLM's msgpack over PUB), with the replay
endpoints for what it missed; ``cache_aware`` and ``round_robin`` need no events.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from loadtest.fleet import Child, Engine, Fleet, FleetError, _RouterProcess, free_port_run

PEER = "vllm-router"
PEER_POLICIES = ("cache_aware", "kv_aware")
INSTALL_HINT = "pip install 'kvrouter[peers]'"


class PeerMissing(FleetError):
    """The peer's executable is not installed."""


def vllm_router_binary() -> str | None:
    """The installed executable: next to this interpreter first (a venv that is not on PATH)."""
    beside = Path(sys.executable).with_name(PEER)
    return str(beside) if beside.exists() else shutil.which(PEER)


def parse_peers(values: Sequence[str]) -> list[str]:
    """``--peer`` values (repeated and/or comma-separated) as run labels ``vllm-router:POLICY``.

    Raises ValueError for an unknown peer or policy and :class:`PeerMissing` when the
    executable is absent, so the bench fails before it starts anything.
    """
    labels: list[str] = []
    for item in (x.strip() for v in values for x in v.split(",")):
        if not item:
            continue
        name, _, policy = item.partition(":")
        policy = policy or PEER_POLICIES[0]
        if name != PEER or policy not in PEER_POLICIES:
            raise ValueError(f"--peer {item!r}: expected {PEER}[:POLICY] with POLICY one of {', '.join(PEER_POLICIES)}")
        if f"{PEER}:{policy}" not in labels:
            labels.append(f"{PEER}:{policy}")
    if labels and vllm_router_binary() is None:
        raise PeerMissing(f"--peer needs the {PEER} executable, which is not installed: {INSTALL_HINT}")
    return labels


def peer_policy(label: str) -> str | None:
    """The vllm-router policy of a run label ``vllm-router:POLICY``; None for a kvrouter policy."""
    name, _, policy = label.partition(":")
    return policy if name == PEER and policy else None


class VllmRouter(_RouterProcess):
    """``vllm-router`` with one policy over ``engines``, on free loopback ports.

    Ready when ``GET /readiness`` answers 200: it listens only after every worker passed
    its health check, and the probe sends no request to an engine, so the engines'
    request counters hold the workload's requests only.
    """

    def __init__(self, engines: Sequence[Engine], policy: str, workdir: Path, *, model: str,
                 block_size: int = 16, max_payload_bytes: int = 64 << 20) -> None:
        self.engines = list(engines)
        self.policy = policy
        self.workdir = workdir
        self.model = model
        self.block_size = block_size
        self.max_payload_bytes = max_payload_bytes

    @classmethod
    def for_fleet(cls, fleet: Fleet, policy: str, workdir: Path) -> VllmRouter:
        return cls(fleet.engines, policy, workdir, model=fleet.spec.model, block_size=fleet.spec.block_size)

    def _spawn(self) -> list[str]:
        exe = vllm_router_binary()
        if exe is None:
            raise PeerMissing(f"{PEER} is not installed: {INSTALL_HINT}")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port_run(2)
        args = [exe, "--host", "127.0.0.1", "--port", str(self.port), "--policy", self.policy,
                "--log-level", "warning", "--prometheus-port", str(self.port + 1),
                "--max-payload-size", str(self.max_payload_bytes), "--worker-urls", *[e.url for e in self.engines]]
        if self.policy == "kv_aware":
            for e in self.engines:
                if e.kv_events:
                    args += ["--kv-event-source", f"{e.url}={e.kv_events}"]
                if e.kv_replay:
                    args += ["--kv-event-replay-source", f"{e.url}={e.kv_replay}"]
            args += ["--kv-event-block-size", str(self.block_size), "--kv-event-model", self.model]
        self.child = Child(f"{PEER}-{self.policy}", args, self.workdir / f"{PEER}-{self.policy}.log")
        return [self.url + "/readiness"]
