"""The prefix hash cache gives exactly vLLM's block hashes (compared to BlockHasher)."""

from __future__ import annotations

import random

import pytest

from indexer.hashing import BlockHasher
from router.prompt.hash_cache import HashCache

LORA = {"name": "sql-adapter", "path": "/adapters/sql", "int_id": 7}


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor", "xxhash"])
def test_cached_hashes_equal_the_hasher_on_growing_conversations(algo: str) -> None:
    hasher = BlockHasher(algo, 16, "0", "0.33.0")
    cache = HashCache(hasher)
    rng = random.Random(5)
    history = [rng.randrange(151_000) for _ in range(1000)]
    for turn in range(6):
        history += [rng.randrange(151_000) for _ in range(rng.randrange(1, 70))]
        for kwargs in ({}, {"lora": LORA}, {"cache_salt": "tenant-1"}, {"lora": LORA, "cache_salt": "t"}):
            assert cache.hash_int64(list(history), **kwargs) == hasher.hash_blocks_int64(history, **kwargs), (turn, kwargs)
    assert cache.hits > 0


def test_salt_and_adapter_never_share_cached_prefixes() -> None:
    hasher = BlockHasher("sha256", 16, "0", "0.33.0")
    cache = HashCache(hasher)
    ids = list(range(64))
    plain = cache.hash_int64(ids)
    assert cache.hash_int64(ids, cache_salt="a") == hasher.hash_blocks_int64(ids, cache_salt="a") != plain
    assert cache.hash_int64(ids, lora=LORA) == hasher.hash_blocks_int64(ids, lora=LORA) != plain
    other_path = {**LORA, "path": "/adapters/other"}
    assert cache.hash_int64(ids, lora=other_path) == hasher.hash_blocks_int64(ids, lora=other_path)


def test_cache_is_bounded_and_short_prompts_hash_to_nothing() -> None:
    hasher = BlockHasher("sha256", 16, "0", "0.33.0")
    cache = HashCache(hasher, max_blocks=32)
    for start in range(0, 4000, 400):
        ids = list(range(start, start + 320))
        assert cache.hash_int64(ids) == hasher.hash_blocks_int64(ids)
    assert len(cache) <= 32
    assert cache.hash_int64([1, 2, 3]) == []


def test_a_full_cache_stays_within_its_bound_and_its_memory_budget() -> None:
    """The 1-hour soak's RSS growth was this cache filling toward 500,000 blocks at ~61
    bytes each (a list of Python ints per chunk). Fed 3x its bound in unique prompts it
    must hold at most its bound, report it on the gauge, and cost under 24 bytes a block."""
    import tracemalloc

    from prometheus_client import REGISTRY

    hasher = BlockHasher("sha256", 16, "0", "0.33.0")
    rng = random.Random(11)
    tail = [rng.randrange(151_000) for _ in range(16 * 256 - 1)]
    bound = 16_384
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        cache = HashCache(hasher, max_blocks=bound, model="bound-test")
        for i in range(3 * bound // 256):
            ids = [i, *tail]
            keys = cache.hash_int64(ids)
            assert len(keys) == 256 and len(cache) <= bound
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(cache) == bound
    assert REGISTRY.get_sample_value("kvrouter_hash_cache_blocks", {"model": "bound-test"}) == bound
    assert held / bound < 24, f"{held / bound:.1f} bytes per cached block"
    last = [3 * bound // 256 - 1, *tail]
    assert cache.hash_int64(last) == hasher.hash_blocks_int64(last)
