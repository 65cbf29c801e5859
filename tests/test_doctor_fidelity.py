"""``kvrouter doctor --router URL``: each backend's live fidelity, read from a running router in
front of a simulated engine. Agreeing predictions pass, a mispredicted backend is low and fails
the doctor once enough requests were compared, and a router that cannot be read is one line."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from support import KVROUTER, QWEN3_DIR, Proc, RouterProc, free_port, free_ports, wait_http

pytestmark = pytest.mark.slow

MODEL = "qwen3"
ADMIN = "doctor-admin-key"
REQUESTS = 60
"""More than the 50 the router compares before it judges a backend (router.http.observe.AGREEMENT_MIN)."""


class Engine:
    """A ``kvrouter sim`` engine on free ports."""

    def __init__(self, tmp: Path, *extra: str) -> None:
        self.http, self.events, self.replay = (p := free_ports(3)), p + 1, p + 2
        args = KVROUTER + ["sim", "--port", str(self.http), "--kv-events-port", str(self.events),
                           "--replay-port", str(self.replay), "--model", MODEL, "--tokenizer", str(QWEN3_DIR),
                           "--hash-seed", "0", "--speedup", "20", *extra]
        self.proc = Proc(args, tmp / f"sim-{self.http}.log")
        wait_http(f"http://127.0.0.1:{self.http}/health", timeout=120, proc=self.proc.popen)

    def config(self, events: bool = True, admin_key: str | None = ADMIN) -> dict[str, Any]:
        backend: dict[str, Any] = {"name": "engine-0", "url": f"http://127.0.0.1:{self.http}"}
        if events:
            backend |= {"kv_events": f"tcp://127.0.0.1:{self.events}", "kv_replay": f"tcp://127.0.0.1:{self.replay}"}
        router: dict[str, Any] = {"policy": "kv_aware", "health_interval_s": 0.5}
        if admin_key is not None:
            router["admin_api_key"] = admin_key
        return {"models": [{"name": MODEL, "tokenizer": str(QWEN3_DIR), "block_size": 16, "hash_seed": "0",
                            "backends": [backend]}], "router": router}


def send(router: RouterProc, n: int) -> None:
    """``n`` completions sharing a long prefix, over one connection (so to one worker of the router)."""
    prefix = "All work and no play makes Jack a dull boy. " * 30
    with httpx.Client(base_url=router.url, timeout=30) as c:
        for i in range(n):
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": f"{prefix}Request {i}.", "max_tokens": 1})
            assert r.status_code == 200, r.text


def doctor(config: dict[str, Any], tmp: Path, router: str, *, json_out: bool = True,
           env: dict[str, str] | None = None) -> tuple[int, Any, str]:
    """Exit status, output (parsed when JSON) and stderr of ``kvrouter doctor --router ROUTER``."""
    path = tmp / f"doctor-{len(list(tmp.glob('doctor-*')))}.yaml"
    path.write_text(yaml.safe_dump(config))
    args = KVROUTER + ["doctor", "--config", str(path), "--timeout", "3", "--router", router] + ["--json"] * json_out
    env = {k: v for k, v in os.environ.items() if k != "KVROUTER_ADMIN_API_KEY"} | (env or {})
    out = subprocess.run(args, capture_output=True, text=True, timeout=120, env=env)
    return out.returncode, json.loads(out.stdout) if json_out else out.stdout, out.stderr


def fidelity(reports: list[dict[str, Any]], backend: str = "engine-0") -> dict[str, Any]:
    report = next(r for r in reports if r.get("backend") == backend)
    return next(c for c in report["checks"] if c["name"] == "fidelity")


def router_check(reports: list[dict[str, Any]]) -> dict[str, Any]:
    return next(r for r in reports if "router" in r)["checks"][0]


def other_checks(reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [c for r in reports if "backend" in r for c in r["checks"] if c["name"] != "fidelity"]


@pytest.fixture(scope="module")
def agreeing(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, RouterProc, Path]]:
    """A router with two workers in front of a healthy engine, after ``REQUESTS`` requests to one worker."""
    tmp = tmp_path_factory.mktemp("fidelity-ok")
    engine = Engine(tmp)
    try:
        router = RouterProc("router", engine.config(), tmp, extra_args=["--workers", "2"])
        try:
            send(router, REQUESTS)
            yield engine, router, tmp
        finally:
            router.stop()
    finally:
        engine.proc.stop()


def test_a_backend_whose_predictions_agree_is_ok(agreeing: tuple[Engine, RouterProc, Path]) -> None:
    engine, router, tmp = agreeing
    rc, reports, err = doctor(engine.config(), tmp, router.url)
    assert rc == 0, (reports, err)
    assert router_check(reports)["ok"] is True
    assert "2 of 2 workers" in router_check(reports)["detail"], router_check(reports)
    check = fidelity(reports)
    assert check["ok"] is True and f"over {REQUESTS} requests" in check["detail"], check


@pytest.mark.parametrize(("env", "key", "said"), [
    ({"KVROUTER_ADMIN_API_KEY": "not-the-key"}, ADMIN, "refused the admin key (401)"),
    ({}, None, "wants its admin key (401)"),
], ids=["wrong-key", "no-key"])
def test_a_router_that_refuses_the_admin_key_is_one_line(agreeing: tuple[Engine, RouterProc, Path],
                                                        env: dict[str, str], key: str | None, said: str) -> None:
    engine, router, tmp = agreeing
    rc, out, err = doctor(engine.config(admin_key=key), tmp, router.url, json_out=False, env=env)
    assert rc == 1
    lines = [line for line in out.splitlines() if router.url in line]
    assert len(lines) == 1 and said in lines[0] and "KVROUTER_ADMIN_API_KEY" in lines[0], out
    assert "Traceback" not in out + err and "problems on: router" in out


def test_an_unreachable_router_is_one_line(agreeing: tuple[Engine, RouterProc, Path]) -> None:
    engine, _, tmp = agreeing
    url = f"http://127.0.0.1:{free_port()}"
    rc, out, err = doctor(engine.config(), tmp, url, json_out=False)
    assert rc == 1
    lines = [line for line in out.splitlines() if url in line]
    assert len(lines) == 1 and "is unreachable" in lines[0], out
    assert "Traceback" not in out + err and "problems on: router" in out


def test_a_mispredicted_backend_is_low_once_enough_requests_are_compared(tmp_path: Path) -> None:
    """The engine drops every KV event and the router keeps no speculative memory: it predicts
    nothing cached while the engine reports its hits. The doctor's own config leaves out the
    event endpoints, so its engine checks pass and its exit status is the fidelity's alone."""
    engine = Engine(tmp_path, "--fault-drop-events", "1.0")
    try:
        router = RouterProc("router", engine.config(), tmp_path, tuning={"kv_aware": {"speculative_ttl_s": 0}},
                            extra_args=["--workers", "2"])
        try:
            rc, reports, err = doctor(engine.config(events=False), tmp_path, router.url)
            assert rc == 0, (reports, err)
            assert fidelity(reports)["ok"] is None and "not enough requests yet" in fidelity(reports)["detail"]
            send(router, REQUESTS)
            rc, reports, err = doctor(engine.config(events=False), tmp_path, router.url)
        finally:
            router.stop()
    finally:
        engine.proc.stop()
    assert rc == 1, (reports, err)
    check = fidelity(reports)
    assert check["ok"] is False and "below 80%" in check["detail"] and "event stream" in check["detail"], check
    assert all(c["ok"] is not False for c in other_checks(reports)), other_checks(reports)
