"""The Grafana dashboard and the Prometheus alert rules of deploy/, against a real Prometheus.

A dashboard panel or an alert whose query names a metric the router does not export (a
typo, a renamed series, a label the metric lacks) shows nothing and never fires, silently.
So a real Prometheus scrapes a real router in front of a simulated fleet every second, with
the rules loaded; traffic makes every series appear (streams and plain requests, cache hits,
a queue burst, engine 500s, then the whole fleet going down), and each dashboard query and
each alert's signal must return a sample. Where an alert compares its signal to a number,
the signal is the expression with its comparisons to numbers removed (deploy/prometheus/
alerts.yaml is written so: ``<signal> <op> <number>``, joined with ``and``); the rules that
the scenario brings about must be pending or firing in Prometheus itself.

``make test`` installs ``prometheus`` and ``promtool`` (Debian's ``prometheus`` package).
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from support import QWEN3_DIR, REPO, Proc, RouterProc, free_port, wait_http

ALERTS = REPO / "deploy" / "prometheus" / "alerts.yaml"
DASHBOARD = REPO / "deploy" / "grafana" / "kvrouter.json"
MODEL = "qwen3"
RATE_INTERVAL = "1m"
"""What ``$__rate_interval`` becomes: Grafana makes it at least four scrape intervals; a
minute holds every request of the test."""

COMPARISON = re.compile(r"\s*(?:==|!=|>=|<=|>|<)\s*(?:bool\s+)?[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?(?![\w.])")
"""A comparison to a number literal (``> 0.05``, ``== 0``): what turns a signal into an alert."""
METRIC = re.compile(r"\bkvrouter_\w+")
SPREAD_S = 1.5
"""Longer than a scrape interval (1 s)."""

FIRES = {"KvrouterNoHealthyBackend", "KvrouterAllBackendsUnhealthy", "KvrouterBackendUnhealthy",
         "KvrouterKvEventStreamDisconnected", "KvrouterHighErrorRate", "KvrouterQueueRejecting"}
"""Alerts the scenario brings about: both engines dead, 500s from the engines, a full queue."""
QUIET = {"KvrouterDown"}
"""Alerts it must not: the router answers every scrape."""


def _tool(name: str) -> str:
    exe = shutil.which(name)
    if exe is None:
        pytest.fail(f"{name} is not installed: `make test` installs it with apt-get (Debian package prometheus)")
    return exe


def _rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


def signal(expr: str) -> str:
    """An alert's expression without its comparisons to numbers: what it measures."""
    return COMPARISON.sub("", expr)


def _dashboard_queries() -> dict[str, str]:
    """Every panel target's expression, the template variables filled in, named by panel title."""
    out: dict[str, str] = {}

    def walk(panels: list[dict[str, Any]]) -> None:
        for panel in panels:
            walk(panel.get("panels", []))
            for target in panel.get("targets", []):
                expr = target["expr"]
                for var, value in (("__rate_interval", RATE_INTERVAL), ("model", MODEL)):
                    expr = expr.replace("${" + var + "}", value).replace("$" + var, value)
                assert "$" not in expr, f"panel {panel['title']!r}: a template variable the test does not know: {expr}"
                out[f"panel {panel['title']!r} {target['refId']}"] = expr

    walk(json.loads(DASHBOARD.read_text())["panels"])
    return out


class Prometheus:
    """``prometheus`` on a free loopback port, scraping ``target`` every second under
    ``job="kvrouter"`` and evaluating the alert rules every second; storage in ``tmp``."""

    def __init__(self, tmp: Path, target: str) -> None:
        self.port = free_port()
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
                  "rule_files": [str(ALERTS)],
                  "scrape_configs": [{"job_name": "kvrouter", "static_configs": [{"targets": [target]}]}]}
        path = tmp / "prometheus.yml"
        path.write_text(yaml.safe_dump(config))
        args = [_tool("prometheus"), f"--config.file={path}", f"--storage.tsdb.path={tmp / 'prometheus-data'}",
                f"--web.listen-address=127.0.0.1:{self.port}"]
        self.proc = Proc(args, tmp / "prometheus.log")
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=5)
        try:
            wait_http(f"http://127.0.0.1:{self.port}/-/ready", timeout=20, proc=self.proc.popen)
        except Exception:
            self.stop()
            raise

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector ``expr`` evaluates to now; AssertionError with Prometheus' error if it does not."""
        body = self.client.get("/api/v1/query", params={"query": expr}).json()
        assert body["status"] == "success", f"{expr}: {body.get('error')}"
        assert body["data"]["resultType"] == "vector", f"{expr}: {body['data']['resultType']}, not a vector"
        return body["data"]["result"]

    def rule_states(self) -> dict[str, tuple[str, str]]:
        """Each alert's (health, state) as Prometheus' own evaluation has it."""
        groups = self.client.get("/api/v1/rules", params={"type": "alert"}).json()["data"]["groups"]
        return {r["name"]: (r["health"] + (f": {r['lastError']}" if r.get("lastError") else ""), r["state"])
                for g in groups for r in g["rules"]}

    def stop(self) -> None:
        self.client.close()
        self.proc.stop()


def _unanswered(prom: Prometheus, queries: dict[str, str], timeout: float) -> dict[str, str]:
    """Poll each query until it returns a sample that is a number (not NaN); the ones that
    never did within ``timeout``, with their last answer. A series appears once scraped and a
    rate once scraped twice, so the first polls may come back empty."""
    waiting = dict(queries)
    last: dict[str, str] = {}
    deadline = time.monotonic() + timeout
    while waiting and time.monotonic() < deadline:
        for name, expr in list(waiting.items()):
            result = prom.query(expr)
            if any(not math.isnan(float(s["value"][1])) for s in result):
                del waiting[name]
            last[name] = f"{expr}\n    -> {result[:3]}"
        time.sleep(0.5)
    return {name: last[name] for name in waiting}


def _config(sim: Any) -> dict[str, Any]:
    """Two engines of one model; the admission queue on and tight (a backend is busy while
    any request is before its first token; two may wait), so a burst fills it; no circuit
    breaker within the test (the engines' 500s reach the client, the backends stay in)."""
    backends = [{"name": f"engine-{i}", "url": sim.http(i), "kv_events": sim.kv(i), "kv_replay": sim.replay(i)}
                for i in range(sim.instances)]
    return {"models": [{"name": MODEL, "tokenizer": str(QWEN3_DIR), "block_size": 16, "hash_seed": "0",
                        "backends": backends}],
            "router": {"policy": "kv_aware", "health_interval_s": 0.5, "queue_busy_tokens": 1,
                       "queue_max_waiting": 2, "queue_timeout_s": 5}}


def _chat(i: int, stream: bool, words: int = 40) -> dict[str, Any]:
    """A chat on one of three shared system prompts (later ones hit the engines' cache)."""
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 8, "stream": stream,
                            "messages": [{"role": "system", "content": f"You are assistant number {i % 3}. " * words},
                                         {"role": "user", "content": f"Question {i}: what is {i} squared?"}]}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def _traffic(router: str, sim: Any) -> None:
    """Steady chats, bursts that fill the queue, then engine 500s (both engines, then healed).

    Each kind of answer is spread over more than one scrape: a counter's series appears at
    its first value, so a rate sees only what it counts after its first scrape."""
    async with httpx.AsyncClient(base_url=router, timeout=30) as c:
        async def send(i: int, stream: bool, words: int = 40) -> httpx.Response:
            rid = f"prom-test-{i}"
            r = await c.post("/v1/chat/completions", json=_chat(i, stream, words), headers={"x-request-id": rid})
            assert r.headers["x-request-id"] == rid
            return r

        for i in range(24):
            r = await send(i, stream=i % 2 == 0)
            assert r.status_code == 200, r.text
        for burst in range(2):
            answers = await asyncio.gather(*(send(100 + 20 * burst + i, stream=i % 2 == 0, words=300) for i in range(16)))
            codes = {r.json()["error"]["code"] if r.status_code == 429 else str(r.status_code) for r in answers}
            assert "queue_full" in codes and codes <= {"200", "queue_full", "queue_timeout"}, codes
            await asyncio.sleep(SPREAD_S)
        for i in range(sim.instances):
            assert (await c.post(sim.http(i) + "/debug/fault", json={"error_rate": 1.0})).status_code == 200
        for i in range(8):
            assert (await send(200 + i, stream=i % 2 == 0)).status_code == 500
            await asyncio.sleep(SPREAD_S / 4)
        for i in range(sim.instances):
            assert (await c.post(sim.http(i) + "/debug/fault", json={"error_rate": 0.0})).status_code == 200
        for i in range(4):
            assert (await send(300 + i, stream=i % 2 == 0)).status_code == 200


def _fleet_down(router: str, sim: Any, timeout: float = 15.0) -> None:
    """Both engines die for good; requests until the router answers 503 no_healthy_backend,
    and on for more than a scrape interval."""
    for i in range(sim.instances):
        assert httpx.post(sim.http(i) + "/debug/fault", json={"down_s": -1}, timeout=5).status_code == 200
    deadline = time.monotonic() + timeout
    refused_since: float | None = None
    while refused_since is None or time.monotonic() - refused_since < 2 * SPREAD_S:
        r = httpx.post(router + "/v1/chat/completions", json=_chat(0, False), timeout=10)
        if r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_backend":
            refused_since = refused_since or time.monotonic()
        assert time.monotonic() < deadline, f"no 503 no_healthy_backend after the fleet died: {r.status_code} {r.text}"
        time.sleep(0.2)


def test_the_alert_rules_pass_promtool_and_say_what_to_do() -> None:
    """``promtool check rules``, and every rule: a severity, a summary and a description, and
    a comparison to a number the live test can take off to read the signal."""
    out = subprocess.run([_tool("promtool"), "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stdout + out.stderr
    rules = _rules()
    assert len(rules) == len({r["alert"] for r in rules}) >= 10
    for rule in rules:
        assert rule["labels"]["severity"] in ("critical", "warning", "info"), rule["alert"]
        assert rule["annotations"]["summary"].strip() and rule["annotations"]["description"].strip(), rule["alert"]
        assert signal(rule["expr"]) != rule["expr"], f"{rule['alert']}: no comparison to a number in {rule['expr']!r}"


def test_the_dashboard_reads_its_data_source_from_a_variable() -> None:
    """Importable anywhere: every query goes to ``${datasource}``, a Prometheus variable, and
    panels have their own ids and fit the 24-column grid."""
    dash = json.loads(DASHBOARD.read_text())
    assert dash["schemaVersion"] >= 39
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["model"]["datasource"]["uid"] == "${datasource}"
    panels = [p for top in dash["panels"] for p in (top, *top.get("panels", []))]
    assert len({p["id"] for p in panels}) == len(panels)
    for p in panels:
        assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24, p["title"]
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
            assert all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"]), p["title"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_every_dashboard_query_and_alert_signal_returns_data(sim_fleet: Any, tmp_path: Path) -> None:
    _tool("prometheus")
    sim = sim_fleet("--hash-seed", "0", instances=2)
    router = RouterProc("router", _config(sim), tmp_path, tuning={"breaker_failures": 100})
    prom: Prometheus | None = None
    try:
        prom = Prometheus(tmp_path, f"127.0.0.1:{router.port}")
        # Prometheus hands its first targets to the scrapers a few seconds after it is ready:
        # traffic before the first scrape would count in no rate.
        assert not _unanswered(prom, {"up": 'up{job="kvrouter"} == 1'}, timeout=20), "the router was never scraped"
        asyncio.run(_traffic(router.url, sim))

        # The dashboard, on the live fleet: every panel query, and the $model variable's.
        dash = json.loads(DASHBOARD.read_text())
        queries = _dashboard_queries()
        variable = next(v for v in dash["templating"]["list"] if v["name"] == "model")
        found = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", variable["definition"])
        assert found, variable["definition"]
        metric, label = found.groups()
        queries[f"variable model: {variable['definition']}"] = f'count by ({label}) ({metric}{{{label}="{MODEL}"}})'
        missing = _unanswered(prom, queries, timeout=20)
        exported = {s["metric"]["__name__"] for s in prom.query('count by (__name__) ({__name__=~"kvrouter_.+"})')}
        referenced = {m for e in [*queries.values(), *(r["expr"] for r in _rules())] for m in METRIC.findall(e)}
        assert not referenced - exported, f"not exported by the router: {sorted(referenced - exported)}"
        assert not missing, "dashboard queries without data:\n" + "\n".join(f"  {k}: {v}" for k, v in missing.items())

        # The alerts, once the fleet is down: each signal has data, and Prometheus fires what it should.
        _fleet_down(router.url, sim)
        rules = _rules()
        missing = _unanswered(prom, {r["alert"]: signal(r["expr"]) for r in rules}, timeout=20)
        assert not missing, "alert signals without data:\n" + "\n".join(f"  {k}: {v}" for k, v in missing.items())
        deadline = time.monotonic() + 15
        while True:
            states = prom.rule_states()
            wrong = {name: st for name, st in states.items()
                     if st[0] != "ok" or (name in FIRES | QUIET and (name in FIRES) != (st[1] in ("pending", "firing")))}
            if not wrong and set(states) == {r["alert"] for r in rules} or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert set(states) == {r["alert"] for r in rules}, sorted(states)
        assert not wrong, f"alerts not in the state the scenario makes (health, state): {wrong}"
    except Exception:
        if prom is not None:
            print(prom.proc.log())
        print(router.log()[-6000:])
        raise
    finally:
        if prom is not None:
            prom.stop()
        router.stop()
