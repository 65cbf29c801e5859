"""The simulator's block pool follows vLLM's prefix-cache semantics (VLLM_FACTS §2)."""

from __future__ import annotations

import random

import pytest

from indexer.hashing import BlockHasher
from loadtest.sim.block_manager import (
    BlockManager,
    BlockPool,
    CacheRequest,
    CpuOffloadTier,
    RemovedRecord,
    StoredRecord,
    reuses_uncached_first,
)
from loadtest.sim.engine import Engine, EngineConfig

B = 16
HASHER = BlockHasher("sha256", B, "0", "0.33.0")


def _req(rid: str, tokens: list[int]) -> CacheRequest:
    hashes = HASHER.hash_blocks(tokens)
    return CacheRequest(rid, list(tokens), hashes, [None] * len(hashes))


def _run(bm: BlockManager, req: CacheRequest) -> int:
    """Admit, prefill in one go and return the cached tokens of the hit."""
    hits, cached = bm.get_computed_blocks(req)
    need = bm.blocks_needed(len(req.all_token_ids), len(hits))
    assert bm.can_admit(hits, need)
    bm.admit(req, hits, need)
    bm.allocate_slots(req, cached, len(req.all_token_ids) - cached)
    return cached


def test_hit_is_a_prefix_and_never_the_whole_prompt() -> None:
    bm = BlockManager(64, B)
    tokens = list(range(1000, 1000 + 4 * B))
    assert _run(bm, _req("a", tokens)) == 0
    bm.free(_req("a", tokens))
    assert _run(bm, _req("b", tokens)) == 3 * B
    other = tokens[:B] + [7] * B + tokens[2 * B :]
    assert bm.get_computed_blocks(_req("c", other))[1] == B
    partial = tokens + [5, 6, 7]
    assert bm.get_computed_blocks(_req("d", partial))[1] == 4 * B


def test_freed_blocks_stay_cached_and_evict_tail_first_in_lru_order() -> None:
    bm = BlockManager(1 + 6, B)
    first = list(range(3 * B))
    second = list(range(5000, 5000 + 3 * B))
    for rid, toks in (("a", first), ("b", second)):
        r = _req(rid, toks)
        _run(bm, r)
        bm.free(r)
    bm.pool.take_events()
    assert bm.pool.num_free_blocks == 6
    third = list(range(9000, 9000 + 2 * B))
    _run(bm, _req("c", third))
    removed = [e.block_hash for e in bm.pool.take_events() if isinstance(e, RemovedRecord)]
    a_hashes = HASHER.hash_blocks(first)
    assert removed == [a_hashes[2], a_hashes[1]]
    assert bm.get_computed_blocks(_req("x", first + [1]))[1] == B


@pytest.mark.parametrize(("version", "new_rule"), [
    ("0.11.0", False), ("0.22.0", False), ("0.23.0", False), ("0.24.0", True), ("0.28.0", True), ("0.32.0", True), ("0.33.0", True),
])
def test_a_freed_partial_block_is_reused_before_a_cached_block_is_evicted_since_0_24(version: str, new_rule: bool) -> None:
    """vLLM >= 0.24 prepends freed unhashed blocks to the free queue; 0.11-0.23 append them.

    A full pool: ``a`` leaves 3 cached blocks, ``b`` one cached block and a partial one.
    ``c`` then needs 2 blocks: the new rule takes ``b``'s partial block first and evicts
    one block of ``a``, the old rule evicts two.
    """
    assert reuses_uncached_first(version) == new_rule
    bm = BlockManager(1 + 4, B, uncached_first=new_rule)
    first = list(range(3 * B))
    a_hashes = HASHER.hash_blocks(first)
    for rid, toks in (("a", first), ("b", list(range(5000, 5000 + B + 5)))):
        r = _req(rid, toks)
        _run(bm, r)
        bm.free(r)
    assert bm.pool.num_free_blocks == 4
    bm.pool.take_events()
    _run(bm, _req("c", list(range(9000, 9000 + 2 * B))))
    removed = [e.block_hash for e in bm.pool.take_events() if isinstance(e, RemovedRecord)]
    if new_rule:
        assert removed == [a_hashes[1]]
        assert bm.get_computed_blocks(_req("x", first + [1]))[1] == B
    else:
        assert removed == [a_hashes[1], a_hashes[0]]
        assert bm.get_computed_blocks(_req("x", first + [1]))[1] == 0


@pytest.mark.parametrize("uncached_first", [True, False])
def test_freed_unhashed_blocks_keep_their_order_at_the_head_of_the_free_queue(uncached_first: bool) -> None:
    pool = BlockPool(1 + 6, uncached_first)
    blocks = pool.get_new_blocks(4)
    blocks[1].block_hash = b"cached"
    pool.free_blocks([blocks[3], blocks[1], blocks[2], blocks[0]])
    order = [b.block_id for b in pool.free.values()]
    if uncached_first:
        assert order == [blocks[3].block_id, blocks[2].block_id, blocks[0].block_id, 5, 6, blocks[1].block_id]
    else:
        assert order == [5, 6] + [b.block_id for b in (blocks[3], blocks[1], blocks[2], blocks[0])]
    assert [b.block_id for b in pool.get_new_blocks(1)] == [order[0]]


def test_engine_config_sets_the_freeing_rule() -> None:
    assert Engine(EngineConfig(num_blocks=8), HASHER).bm.pool.uncached_first
    assert not Engine(EngineConfig(num_blocks=8, uncached_first=False), HASHER).bm.pool.uncached_first
    assert not reuses_uncached_first("v0.23.1") and reuses_uncached_first("0.24.0rc1")
    assert reuses_uncached_first("nightly")


def test_touching_a_free_cached_block_takes_it_off_the_free_queue() -> None:
    bm = BlockManager(1 + 4, B)
    toks = list(range(2 * B + 1))
    r = _req("a", toks)
    _run(bm, r)
    bm.free(r)
    assert bm.pool.num_free_blocks == 4
    r2 = _req("b", toks)
    hits, _ = bm.get_computed_blocks(r2)
    assert len(hits) == 2 and bm.can_admit(hits, 1) and not bm.can_admit(hits, 3)
    bm.admit(r2, hits, 1)
    assert bm.pool.num_free_blocks == 2 and all(b.ref_cnt == 1 for b in hits)


def test_generated_blocks_are_cached_chained_on_the_prompt() -> None:
    bm = BlockManager(32, B)
    prompt = list(range(B + 4))
    req = _req("a", prompt)
    _run(bm, req)
    bm.pool.take_events()
    gen = random.Random(1).choices(range(100, 200), k=B)
    for i, t in enumerate(gen):
        num_computed = len(req.all_token_ids) - 1 if i else len(prompt)
        req.all_token_ids.append(t)
        full = HASHER.hash_blocks(req.all_token_ids)
        if len(full) > len(req.block_hashes):
            req.block_hashes.append(full[-1])
            req.block_extra_keys.append(None)
        bm.allocate_slots(req, num_computed, 1)
    stored = [e for e in bm.pool.take_events() if isinstance(e, StoredRecord)]
    expected = HASHER.hash_blocks(prompt + gen)
    assert len(stored) == 1
    assert stored[0].block_hashes == [expected[1]] and stored[0].parent == expected[0]
    assert stored[0].token_ids == (prompt + gen)[B : 2 * B]


def test_exact_multiple_prompt_repeated_is_recomputed_into_a_duplicate_block() -> None:
    bm = BlockManager(32, B)
    toks = list(range(2 * B))
    _run(bm, _req("a", toks))
    assert _run(bm, _req("b", toks)) == B
    assert bm.pool.num_duplicates() == 1
    assert len(bm.pool.cached_hashes()) == 2


def test_reset_refused_while_blocks_are_held_then_clears_all() -> None:
    bm = BlockManager(16, B)
    r = _req("a", list(range(3 * B)))
    _run(bm, r)
    assert not bm.reset_prefix_cache()
    bm.free(r)
    assert bm.reset_prefix_cache()
    assert bm.pool.cached_hashes() == [] and bm.pool.usage() == 0.0


def _run_tiered(bm: BlockManager, req: CacheRequest) -> tuple[int, int]:
    """Admit like the engine with a CPU tier, prefill in one go; (GPU-hit, CPU-loaded) blocks."""
    hits, _ = bm.get_computed_blocks(req)
    loaded = bm.get_offloaded_blocks(req, len(hits))
    need = bm.blocks_needed(len(req.all_token_ids), len(hits))
    assert bm.can_admit(hits, need)
    bm.admit(req, hits, need)
    computed = (len(hits) + loaded) * B
    bm.allocate_slots(req, computed, len(req.all_token_ids) - computed)
    return len(hits), loaded


def test_cpu_tier_continues_the_gpu_hit_and_loaded_blocks_are_cached_on_gpu_again() -> None:
    bm = BlockManager(1 + 5, B, cpu_offload_blocks=16)
    first = list(range(4 * B))
    a = _req("a", first)
    _run_tiered(bm, a)
    bm.free(a)
    stored = [e for e in bm.take_events() if isinstance(e, StoredRecord)]
    assert [(e.medium, e.block_hashes) for e in stored] == [("GPU", a.block_hashes), ("CPU", a.block_hashes)]
    assert stored[1].token_ids == first and stored[1].parent is None
    other = _req("b", list(range(7000, 7000 + 3 * B)))
    _run_tiered(bm, other)
    bm.free(other)
    assert bm.get_computed_blocks(_req("x", first + [1]))[1] == 2 * B, "a's tail was evicted from the GPU, its head kept"
    bm.take_events()
    again = _req("c", first + [1])
    assert _run_tiered(bm, again) == (2, 2)
    events = bm.take_events()
    gpu_stored = [e for e in events if isinstance(e, StoredRecord) and e.medium == "GPU"]
    assert gpu_stored[0].block_hashes == a.block_hashes[2:] and gpu_stored[0].parent == a.block_hashes[1]
    assert not [e for e in events if e.medium == "CPU"], "blocks the CPU tier holds are not stored again"
    assert set(bm.pool.cached_hashes()) >= set(a.block_hashes)


def test_cpu_tier_evicts_lru_and_offloads_only_blocks_newly_cached_on_gpu() -> None:
    bm = BlockManager(64, B, cpu_offload_blocks=5)
    first = list(range(3 * B))
    a = _req("a", first)
    _run_tiered(bm, a)
    bm.free(a)
    b = _req("b", list(range(9000, 9000 + 3 * B)))
    _run_tiered(bm, b)
    bm.free(b)
    cpu_events = [e for e in bm.take_events() if e.medium == "CPU"]
    assert [e.block_hash for e in cpu_events if isinstance(e, RemovedRecord)] == a.block_hashes[:1]
    assert bm.cpu is not None and bm.cpu.cached_hashes() == a.block_hashes[1:] + b.block_hashes
    longer = _req("c", first + list(range(100, 100 + 2 * B)))
    assert bm.get_offloaded_blocks(longer, 3) == 0, "the GPU holds a's blocks; the CPU tier is not asked past them"
    _run_tiered(bm, longer)
    stored = [e for e in bm.take_events() if isinstance(e, StoredRecord) and e.medium == "CPU"]
    assert [(e.block_hashes, e.parent) for e in stored] == [(longer.block_hashes[3:], longer.block_hashes[2])]
    assert stored[0].token_ids == longer.all_token_ids[3 * B : 5 * B]
    assert len(bm.cpu.cached_hashes()) == 5


def test_cpu_store_skips_held_blocks_and_publishes_each_new_run_chained_on_its_parent() -> None:
    tier = CpuOffloadTier(10)
    req = _req("a", list(range(5 * B)))
    tier.store(req, 2, 3, B)
    tier.take_events()
    tier.store(req, 0, 5, B)
    runs = [(e.block_hashes, e.parent, e.token_ids, e.medium) for e in tier.take_events()]
    assert runs == [
        (req.block_hashes[0:2], None, req.all_token_ids[: 2 * B], "CPU"),
        (req.block_hashes[3:5], req.block_hashes[2], req.all_token_ids[3 * B :], "CPU"),
    ]
    assert sorted(tier.cached_hashes()) == sorted(req.block_hashes)


def test_cpu_touch_makes_a_chain_head_outlive_its_tail() -> None:
    tier = CpuOffloadTier(4)
    req = _req("a", list(range(4 * B)))
    tier.store(req, 0, 4, B)
    tier.touch(req.block_hashes[:2])
    tier.take_events()
    tier.store(_req("b", list(range(800, 800 + 2 * B))), 0, 2, B)
    assert [e.block_hash for e in tier.take_events() if isinstance(e, RemovedRecord)] == req.block_hashes[2:4]
    assert tier.lookup(req.block_hashes) == 2


def test_offloaded_hit_never_covers_the_last_prompt_token() -> None:
    bm = BlockManager(1 + 3, B, cpu_offload_blocks=8)
    toks = list(range(3 * B))
    r = _req("a", toks)
    _run_tiered(bm, r)
    bm.free(r)
    filler = _req("f", list(range(500, 500 + 3 * B)))
    _run_tiered(bm, filler)
    bm.free(filler)
    assert bm.get_computed_blocks(_req("x", toks))[1] == 0
    assert bm.get_offloaded_blocks(_req("y", toks), 0) == 2


def test_reset_clears_the_cpu_tier_with_the_pool() -> None:
    bm = BlockManager(16, B, cpu_offload_blocks=8)
    r = _req("a", list(range(3 * B)))
    _run_tiered(bm, r)
    bm.free(r)
    assert bm.reset_prefix_cache()
    assert bm.cpu is not None and bm.cpu.cached_hashes() == []
    assert [type(e).__name__ for e in bm.take_events()][-1] == "ClearedRecord"
