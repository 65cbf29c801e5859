"""Keys per engine are capped at its KV-cache capacity, which the router reads off the engine's ``/metrics``.

The cap itself (eviction, counting, the flood) is tested on the indexes (tests/test_index.py)
and the subscriber (tests/test_subscriber.py); here: where the capacity comes from.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from indexer.index import Worker
from kvconfig import parse_config
from router.core import Router
from router.fleet.scrape import parse_capacity
from support import QWEN3_DIR, RouterProc, wait_for

PAGE = """# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",num_cpu_blocks="None",num_gpu_blocks="2048"} 1.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="1",num_cpu_blocks="4096",num_gpu_blocks="1024"} 1.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
"""


def model(backend: dict[str, Any], block_size: int = 16) -> dict[str, Any]:
    return {"name": "qwen3", "tokenizer": str(QWEN3_DIR), "block_size": block_size, "hash_algo": "sha256",
            "hash_seed": "0", "vllm_version": "0.33.0", "backends": [backend]}


def test_capacity_is_read_per_engine_and_tier_in_tokens() -> None:
    assert parse_capacity(PAGE) == {"0": {"GPU": 2048 * 16}, "1": {"GPU": 1024 * 16, "CPU": 4096 * 16}}


def test_an_engine_that_has_not_sized_its_cache_yet_has_no_capacity() -> None:
    assert parse_capacity('vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1.0\n') == {}
    assert parse_capacity("vllm:num_requests_running 1.0\n") == {}
    assert parse_capacity('vllm:cache_config_info{num_gpu_blocks="100"} 1.0\n') == {}, "no block_size, no unit"


def test_a_scraped_capacity_caps_each_data_parallel_rank_in_the_models_blocks() -> None:
    """Engine ranks are the ``engine`` label; an engine with 32-token blocks holds two of the
    router's 16-token keys per block."""
    backend = {"name": "b", "url": "http://127.0.0.1:9", "kv_events": "tcp://127.0.0.1:9", "data_parallel_size": 2}
    router = Router(parse_config({"models": [model(backend)]}))
    router.loads.took_capacity("b", {"0": {"GPU": 2048 * 32}, "1": {"GPU": 1024 * 32, "CPU": 64}})
    caps = router.index.caps
    assert caps.capacity(Worker("b", 0)) == {"GPU": 4096}
    assert caps.capacity(Worker("b", 1)) == {"GPU": 2048, "CPU": 4}
    assert caps.cap(Worker("b", 1), "GPU") == 2 * 2048
    router.loads.took_capacity("b", {"": {"GPU": 160}})
    assert caps.capacity(Worker("b", 0)) == caps.capacity(Worker("b", 1)) == {"GPU": 10}, "no engine label: every rank"


@pytest.mark.slow
def test_the_router_caps_a_simulated_engine_at_the_capacity_its_metrics_report(sim_fleet: Any, tmp_path: Any) -> None:
    sim = sim_fleet("--num-blocks", "1000", "--hash-seed", "0")
    page = httpx.get(sim.http() + "/metrics", timeout=5).text
    assert parse_capacity(page) == {"0": {"GPU": 16_000}}, "the simulator reports vllm:cache_config_info like vLLM"
    backend = {"name": "sim-0", "url": sim.http(), "kv_events": sim.kv(), "kv_replay": sim.replay()}
    router = RouterProc("router", {"models": [model(backend)], "router": {"health_interval_s": 0.5}}, tmp_path,
                        tuning={"metrics_scrape_interval_s": 0.2})
    try:
        def capacity() -> Any:
            streams = httpx.get(router.url + "/debug/backends", timeout=5).json()["backends"][0]["event_streams"]
            return streams[0]["capacity"] if streams else None
        wait_for(lambda: capacity() == {"GPU": 1000}, "the scraped capacity on the worker's event stream", timeout=30)
    finally:
        router.stop()
