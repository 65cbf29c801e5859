"""The simulator's block pool follows vLLM's prefix-cache semantics (VLLM_FACTS §2)."""

from __future__ import annotations

import random

from indexer.hashing import BlockHasher
from loadtest.sim.block_manager import BlockManager, CacheRequest, RemovedRecord, StoredRecord

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
