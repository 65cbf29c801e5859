"""``kvrouter doctor`` against a live simulated engine: right config passes, each wrong
setting fails and is named."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from support import KVROUTER, QWEN3_DIR, Proc, free_port, wait_http

pytestmark = pytest.mark.slow

MODEL = "qwen3-0.6b"


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    http, events, replay = free_port(), free_port(), free_port()
    d = tmp_path_factory.mktemp("doctor")
    args = KVROUTER + [
        "sim", "--port", str(http), "--kv-events-port", str(events), "--replay-port", str(replay), "--model", MODEL,
        "--tokenizer", str(QWEN3_DIR), "--hash-seed", "0", "--speedup", "20",
    ]
    with Proc(args, d / "sim.log") as proc:
        wait_http(f"http://127.0.0.1:{http}/health", timeout=120, proc=proc.popen)
        yield {"http": http, "events": events, "replay": replay, "dir": d}


def doctor(engine: dict[str, Any], **model: Any) -> tuple[int, list[dict[str, Any]]]:
    backend = {
        "name": "sim-0",
        "url": f"http://127.0.0.1:{engine['http']}",
        "kv_events": f"tcp://127.0.0.1:{engine['events']}",
        "kv_replay": f"tcp://127.0.0.1:{engine['replay']}",
    }
    cfg = {"models": [{"name": MODEL, "tokenizer": str(QWEN3_DIR), "hash_seed": "0", "backends": [backend], **model}]}
    path = Path(engine["dir"]) / f"cfg-{len(list(Path(engine['dir']).glob('cfg-*')))}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = subprocess.run(KVROUTER + ["doctor", "--config", str(path), "--json", "--timeout", "3"], capture_output=True, text=True, timeout=120)
    return out.returncode, json.loads(out.stdout)


def check(report: list[dict[str, Any]], prefix: str) -> dict[str, Any]:
    return next(c for c in report[0]["checks"] if c["name"].startswith(prefix))


def test_doctor_passes_a_correct_config(engine: dict[str, Any]) -> None:
    rc, report = doctor(engine)
    assert rc == 0, report
    assert check(report, "kv events")["ok"] is True
    assert check(report, "hashes")["ok"] is True
    assert check(report, "tokenizer")["ok"] is True
    assert check(report, "replay")["ok"] is True


def test_doctor_names_a_wrong_seed(engine: dict[str, Any]) -> None:
    rc, report = doctor(engine, hash_seed="7")
    assert rc == 1
    hashes = check(report, "hashes")
    assert hashes["ok"] is False and "hash_seed='0'" in hashes["detail"]


def test_doctor_names_a_wrong_block_size(engine: dict[str, Any]) -> None:
    rc, report = doctor(engine, block_size=32)
    assert rc == 1
    assert "block size" in check(report, "hashes")["detail"]


def test_doctor_reports_a_model_the_engine_does_not_serve(engine: dict[str, Any]) -> None:
    rc, report = doctor(engine, name="other-model")
    assert rc == 1
    assert check(report, "models served")["ok"] is False
