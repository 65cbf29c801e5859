"""``kvrouter indexer`` as a real process: engine events in, a Redis index the routers can read."""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from indexer.events import BlockStored, EventBatch, encode_batch
from indexer.hashing import BlockHasher
from indexer.index import Worker
from indexer.redis_index import RedisIndex
from kvconfig import load_config
from router.core import warn_if_unfilled
from kvpub import EnginePublisher
from support import KVROUTER, QWEN3_DIR, Proc, free_port, wait_http, wait_port

MODEL = "qwen3-0.6b"


def write_config(path: Path, engine: EnginePublisher, redis_url: str, **extra: object) -> Path:
    config = {
        "models": [{
            "name": MODEL, "tokenizer": str(QWEN3_DIR), "block_size": 16, "hash_algo": "sha256",
            "hash_seed": "0", "vllm_version": "0.33.0",
            "backends": [{"name": "engine-0", "url": "http://127.0.0.1:9", "kv_events": engine.endpoint,
                          "kv_replay": engine.replay_endpoint}],
        }],
        "index": redis_url,
        **extra,
    }
    path.write_text(yaml.safe_dump(config))
    return path


def test_indexer_process_fills_redis_and_serves_health_and_metrics(tmp_path: Path, redis_url: str) -> None:
    engine = EnginePublisher(topic=b"")
    namespace = f"svc-{uuid.uuid4().hex[:8]}"
    config = write_config(tmp_path / "fleet.yaml", engine, redis_url)
    port = free_port()
    hasher = BlockHasher("sha256", 16, "0", "0.33.0")
    tokens = list(range(5000, 5000 + 16 * 6))
    hashes = hasher.hash_blocks_int64(tokens)
    index = RedisIndex(redis_url, namespace=namespace)
    args = [*KVROUTER, "indexer", "--config", str(config), "--port", str(port), "--namespace", namespace]
    try:
        with Proc(args, tmp_path / "indexer.log") as proc:
            wait_http(f"http://127.0.0.1:{port}/health", timeout=60, proc=proc.popen)
            engine.wait_subscribed()
            engine.publish(encode_batch(EventBatch(1.0, [BlockStored(hashes, None, tokens, 16, None, "GPU")], 0), "0.33.0"))

            async def matched() -> dict:
                return await index.lookup(MODEL, hashes)

            deadline = time.monotonic() + 20
            while asyncio.run(matched()) != {Worker("engine-0", 0): {"GPU": 6}}:
                assert time.monotonic() < deadline, proc.log()
                time.sleep(0.05)
            metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
            assert 'kvrouter_kv_events_total{backend="engine-0",dp_rank="0",type="BlockStored"} 1.0' in metrics
            assert 'kvrouter_kv_hash_verify_total{backend="engine-0",dp_rank="0",result="match"} 6.0' in metrics
            streams = httpx.get(f"http://127.0.0.1:{port}/debug/streams").json()
            assert streams[0]["backend"] == "engine-0" and streams[0]["blocks"] == 6
            assert streams[0]["connected"] is True and streams[0]["rehash_mode"] is False
            assert httpx.get(f"http://127.0.0.1:{port}/health").json()["status"] == "ok"
    finally:
        index.close()
        engine.close()


def refused_log(tmp_path: Path, index: str) -> str:
    """``kvrouter indexer`` on a config whose ``index`` is ``index``: it must exit 2; its log."""
    engine = EnginePublisher(replay=False)
    try:
        config = write_config(tmp_path / "fleet.yaml", engine, index)
        with Proc([*KVROUTER, "indexer", "--config", str(config)], tmp_path / "indexer.log") as proc:
            assert proc.popen.wait(60) == 2
            return proc.log()
    finally:
        engine.close()


def test_indexer_refuses_a_config_without_redis(tmp_path: Path) -> None:
    assert "--redis" in refused_log(tmp_path, "memory")


def test_indexer_says_when_redis_is_unreachable(tmp_path: Path) -> None:
    assert "cannot reach Redis" in refused_log(tmp_path, f"redis://127.0.0.1:{free_port()}/0")


def test_indexer_writes_the_namespace_the_config_names(tmp_path: Path, redis_url: str) -> None:
    engine = EnginePublisher(topic=b"")
    namespace = f"cfg-{uuid.uuid4().hex[:8]}"
    config = write_config(tmp_path / "fleet.yaml", engine, redis_url, index_namespace=namespace)
    port = free_port()
    hashes = BlockHasher("sha256", 16, "0", "0.33.0").hash_blocks_int64(list(range(16 * 2)))
    index = RedisIndex(redis_url, namespace=namespace)
    try:
        with Proc([*KVROUTER, "indexer", "--config", str(config), "--port", str(port)], tmp_path / "indexer.log") as proc:
            wait_http(f"http://127.0.0.1:{port}/health", timeout=60, proc=proc.popen)
            engine.wait_subscribed()
            engine.publish(encode_batch(EventBatch(1.0, [BlockStored(hashes, None, list(range(32)), 16, None, "GPU")], 0), "0.33.0"))
            deadline = time.monotonic() + 20
            while asyncio.run(index.lookup(MODEL, hashes)) != {Worker("engine-0", 0): {"GPU": 2}}:
                assert time.monotonic() < deadline, proc.log()
                time.sleep(0.05)
            assert f"namespace {namespace}" in proc.log()
    finally:
        index.close()
        engine.close()


def test_a_router_warns_at_start_when_its_namespace_holds_none_of_its_models(
    tmp_path: Path, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    engine = EnginePublisher(replay=False)
    namespace = f"empty-{uuid.uuid4().hex[:8]}"
    config = load_config(write_config(tmp_path / "fleet.yaml", engine, redis_url, index_namespace=namespace))
    index = RedisIndex(redis_url, namespace=namespace)
    try:
        with caplog.at_level(logging.WARNING, logger="router.core"):
            asyncio.run(warn_if_unfilled(index, config))
        assert f"namespace {namespace!r} holds no blocks of {MODEL}" in caplog.text
        caplog.clear()
        index.store(MODEL, Worker("engine-0", 0), [1, 2])
        with caplog.at_level(logging.WARNING, logger="router.core"):
            asyncio.run(warn_if_unfilled(index, config))
        assert caplog.text == ""
    finally:
        index.close()
        engine.close()


# -- /debug/* behind the admin key, no Redis password in sight (issue 17, hardening) ----------

ADMIN_KEY = "sk-indexer-admin-" + uuid.uuid4().hex
CLIENT_KEY = "sk-indexer-client-" + uuid.uuid4().hex
REDIS_PASSWORD = "pw-" + uuid.uuid4().hex


@pytest.fixture
def locked_redis(tmp_path: Path) -> Iterator[str]:
    """A real redis-server that wants a password; its URL carries it."""
    exe = shutil.which("redis-server")
    assert exe is not None, "redis-server is not installed: `make test` installs it with apt-get"
    port = free_port()
    args = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", str(tmp_path), "--requirepass", REDIS_PASSWORD]
    with Proc(args, tmp_path / "redis.log"):
        wait_port(port, timeout=20)
        yield f"redis://:{REDIS_PASSWORD}@127.0.0.1:{port}/0"


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def test_indexer_debug_takes_the_admin_key_and_never_shows_the_redis_password(tmp_path: Path, locked_redis: str) -> None:
    engine = EnginePublisher(topic=b"")
    config = write_config(tmp_path / "fleet.yaml", engine, locked_redis, router={"api_key": CLIENT_KEY})
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    try:
        with Proc([*KVROUTER, "indexer", "--config", str(config), "--port", str(port)], tmp_path / "indexer.log",
                  env={"KVROUTER_ADMIN_API_KEY": ADMIN_KEY}) as proc:
            wait_http(url + "/health", timeout=60, proc=proc.popen)
            answers = []
            for headers in ({}, bearer(CLIENT_KEY), bearer(ADMIN_KEY + "x"), {"authorization": ADMIN_KEY}):
                r = httpx.get(url + "/debug/streams", headers=headers)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
                answers.append(r.text)
            r = httpx.get(url + "/debug/streams", headers=bearer(ADMIN_KEY))
            assert r.status_code == 200 and r.json()[0]["backend"] == "engine-0"
            answers.append(r.text)
            for path in ("/health", "/metrics"):
                r = httpx.get(url + path)
                assert r.status_code == 200, r.text
                answers.append(r.text)
            log = proc.log()
            assert "into redis://:***@127.0.0.1" in log
            everything = log + "".join(answers)
            assert REDIS_PASSWORD not in everything and ADMIN_KEY not in everything and CLIENT_KEY not in everything
    finally:
        engine.close()


def test_indexer_debug_is_closed_with_only_a_client_key(tmp_path: Path, redis_url: str) -> None:
    engine = EnginePublisher(topic=b"")
    config = write_config(tmp_path / "fleet.yaml", engine, redis_url, router={"api_key": CLIENT_KEY})
    port = free_port()
    try:
        with Proc([*KVROUTER, "indexer", "--config", str(config), "--port", str(port)], tmp_path / "indexer.log",
                  env={"KVROUTER_ADMIN_API_KEY": ""}) as proc:
            wait_http(f"http://127.0.0.1:{port}/health", timeout=60, proc=proc.popen)
            for headers in ({}, bearer(CLIENT_KEY)):
                r = httpx.get(f"http://127.0.0.1:{port}/debug/streams", headers=headers)
                assert r.status_code == 403 and r.json()["error"]["code"] == "admin_disabled", r.text
    finally:
        engine.close()


def test_a_wrong_redis_password_is_reported_without_the_password(tmp_path: Path, locked_redis: str) -> None:
    log = refused_log(tmp_path, locked_redis.replace(REDIS_PASSWORD, "not-" + REDIS_PASSWORD))
    assert "cannot reach Redis at redis://:***@127.0.0.1" in log and REDIS_PASSWORD not in log


def test_a_config_error_does_not_print_the_index_password(tmp_path: Path) -> None:
    log = refused_log(tmp_path, f"redis//:{REDIS_PASSWORD}@127.0.0.1:6379/0")
    assert "index must be" in log and REDIS_PASSWORD not in log
