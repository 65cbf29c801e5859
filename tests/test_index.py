"""The prefix index's semantics, checked identically on MemoryIndex and RedisIndex (real redis-server)."""

from __future__ import annotations

import asyncio
import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence

import pytest

from indexer.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from indexer.index import DEFAULT_CAPACITY_BLOCKS, EVICT_DRAIN, Hits, InvalidKey, MemoryIndex, Worker, medium_rank
from indexer.redis_index import RedisIndex

A = Worker("a")
B = Worker("b")
A1 = Worker("a", 1)
M = "qwen3"


class Harness:
    """An index plus an event loop of its own, so ``lookup`` reads like a plain call."""

    def __init__(self, index: MemoryIndex | RedisIndex) -> None:
        self.index = index
        self.loop = asyncio.new_event_loop()

    def lookup(self, keys: Sequence[int], model: str = M) -> Hits:
        return self.loop.run_until_complete(self.index.lookup(model, keys))

    def close(self) -> None:
        if isinstance(self.index, RedisIndex):
            self.loop.run_until_complete(self.index.aclose())
            self.index.close()
        self.loop.close()


@pytest.fixture(params=["memory", "redis"])
def h(request: pytest.FixtureRequest) -> Iterator[Harness]:
    if request.param == "memory":
        index: MemoryIndex | RedisIndex = MemoryIndex()
    else:
        url = request.getfixturevalue("redis_url")
        index = RedisIndex(url, namespace=f"test-{uuid.uuid4().hex}")
    harness = Harness(index)
    yield harness
    harness.close()


def stored(keys: list, medium: str | None = "GPU", group_idx: int | None = None) -> BlockStored:
    return BlockStored(
        block_hashes=keys, parent_block_hash=None, token_ids=[], block_size=16, lora_id=None,
        medium=medium, group_idx=group_idx,
    )


def removed(keys: list, medium: str | None = "GPU", group_idx: int | None = None) -> BlockRemoved:
    return BlockRemoved(block_hashes=keys, medium=medium, group_idx=group_idx)


def batch(*events: object) -> EventBatch:
    return EventBatch(ts=time.time(), events=list(events), data_parallel_rank=0)


# -- the leading-prefix rule --------------------------------------------------------------


def test_match_counts_only_leading_blocks(h: Harness) -> None:
    h.index.store(M, A, [1, 2, 4, 5])
    assert h.lookup([1, 2, 3, 4, 5]) == {A: {"GPU": 2}}


def test_full_chain_held_matches_every_block(h: Harness) -> None:
    keys = list(range(100, 164))
    h.index.store(M, A, keys)
    assert h.lookup(keys) == {A: {"GPU": 64}}


def test_first_block_missing_means_no_match(h: Harness) -> None:
    h.index.store(M, A, [2, 3, 4])
    assert h.lookup([1, 2, 3, 4]) == {}


def test_empty_request_and_unknown_model_match_nothing(h: Harness) -> None:
    h.index.store(M, A, [1, 2])
    assert h.lookup([]) == {}
    assert h.lookup([1, 2], model="other") == {}


def test_a_model_whose_events_stored_nothing_yet_matches_nothing(h: Harness) -> None:
    """A batch of removes creates the model's entry before any store: a request looked up then
    (the first of a run, racing the first events) matches nothing instead of failing."""
    h.index.apply(M, A, batch(removed([1, 2])))
    assert h.lookup([1, 2, 3]) == {}


@pytest.mark.parametrize("n", [1, 15, 16, 17, 48, 49, 496, 497, 4080, 4081, 8192])
def test_long_chains_match_exactly_across_chunk_boundaries(h: Harness, n: int) -> None:
    keys = [random.getrandbits(64) for _ in range(n)]
    h.index.store(M, A, keys)
    h.index.store(M, B, keys[: n // 2])
    expect: Hits = {A: {"GPU": n}}
    if n // 2:
        expect[B] = {"GPU": n // 2}
    assert h.lookup(keys + [7]) == expect


def test_two_workers_each_get_their_own_leading_count(h: Harness) -> None:
    h.index.store(M, A, [1, 2, 3])
    h.index.store(M, B, [1, 2, 3, 4, 5])
    h.index.store(M, A1, [9])
    assert h.lookup([1, 2, 3, 4, 5, 6]) == {A: {"GPU": 3}, B: {"GPU": 5}}


def test_dp_ranks_are_distinct_workers(h: Harness) -> None:
    h.index.store(M, A, [1])
    h.index.store(M, A1, [1, 2])
    assert h.lookup([1, 2]) == {A: {"GPU": 1}, A1: {"GPU": 2}}


def test_models_are_separate_key_spaces(h: Harness) -> None:
    h.index.store(M, A, [1, 2])
    h.index.store("llama", B, [1, 2, 3])
    assert h.lookup([1, 2, 3]) == {A: {"GPU": 2}}
    assert h.lookup([1, 2, 3], model="llama") == {B: {"GPU": 3}}
    h.index.clear("llama", B)
    assert h.lookup([1, 2, 3]) == {A: {"GPU": 2}}


# -- tiers -------------------------------------------------------------------------------


def test_block_in_gpu_and_cpu_counts_as_gpu(h: Harness) -> None:
    h.index.store(M, A, [1, 2, 3], "GPU")
    h.index.store(M, A, [1, 2, 3, 4], "CPU")
    assert h.lookup([1, 2, 3, 4, 5]) == {A: {"GPU": 3, "CPU": 1}}


def test_leading_run_may_alternate_between_tiers(h: Harness) -> None:
    h.index.store(M, A, [1, 3], "GPU")
    h.index.store(M, A, [2, 4], "CPU")
    h.index.store(M, A, [5], "STORAGE")
    h.index.store(M, A, [7], "GPU")
    assert h.lookup([1, 2, 3, 4, 5, 6, 7]) == {A: {"GPU": 2, "CPU": 2, "STORAGE": 1}}


def test_tiers_rank_gpu_then_cpu_then_names(h: Harness) -> None:
    h.index.store(M, A, [1], "STORAGE")
    h.index.store(M, A, [1], "DISK")
    h.index.store(M, A, [2], "CPU")
    h.index.store(M, A, [2], "DISK")
    assert h.lookup([1, 2]) == {A: {"CPU": 1, "DISK": 1}}
    assert sorted(["STORAGE", "CPU", "DISK", "GPU"], key=medium_rank) == ["GPU", "CPU", "DISK", "STORAGE"]


def test_medium_none_means_gpu(h: Harness) -> None:
    h.index.store(M, A, [1, 2], None)
    h.index.remove(M, A, [2], "GPU")
    assert h.lookup([1, 2]) == {A: {"GPU": 1}}


def test_tiers_are_per_worker(h: Harness) -> None:
    h.index.store(M, A, [1, 2], "CPU")
    h.index.store(M, B, [1], "GPU")
    h.index.store(M, B, [2, 3], "CPU")
    assert h.lookup([1, 2, 3]) == {A: {"CPU": 2}, B: {"GPU": 1, "CPU": 2}}


# -- removal and clear -------------------------------------------------------------------


def test_removing_a_middle_block_truncates_the_match(h: Harness) -> None:
    h.index.store(M, A, [1, 2, 3, 4])
    h.index.remove(M, A, [3])
    assert h.lookup([1, 2, 3, 4]) == {A: {"GPU": 2}}


def test_removing_from_one_tier_keeps_the_other(h: Harness) -> None:
    h.index.store(M, A, [1, 2], "GPU")
    h.index.store(M, A, [1, 2], "CPU")
    h.index.remove(M, A, [1, 2], "GPU")
    assert h.lookup([1, 2]) == {A: {"CPU": 2}}


def test_removing_blocks_never_held_is_ignored(h: Harness) -> None:
    h.index.remove(M, A, [1, 2])
    h.index.store(M, A, [1])
    h.index.remove(M, A, [5], "CPU")
    h.index.remove(M, B, [1])
    assert h.lookup([1]) == {A: {"GPU": 1}}
    assert h.index.block_counts(M) == {A: 1}


def test_clear_forgets_one_worker_in_every_tier(h: Harness) -> None:
    h.index.store(M, A, [1, 2], "GPU")
    h.index.store(M, A, [3], "CPU")
    h.index.store(M, B, [1, 2, 3])
    h.index.clear(M, A)
    assert h.lookup([1, 2, 3]) == {B: {"GPU": 3}}
    assert h.index.block_counts(M) == {B: 3}


def test_worker_indexes_again_after_clear(h: Harness) -> None:
    h.index.store(M, A, [1, 2, 3])
    h.index.clear(M, A)
    h.index.store(M, A, [1])
    assert h.lookup([1, 2, 3]) == {A: {"GPU": 1}}
    assert h.index.block_counts(M) == {A: 1}


def test_clear_of_unknown_worker_or_model_is_a_no_op(h: Harness) -> None:
    h.index.clear("nobody", A)
    h.index.store(M, A, [1])
    h.index.clear(M, B)
    assert h.lookup([1]) == {A: {"GPU": 1}}


def test_block_counts_count_distinct_block_medium_entries_not_copies(h: Harness) -> None:
    h.index.store(M, A, [1, 2, 2, 3])
    h.index.store(M, A, [1], "CPU")
    h.index.store(M, B, [1])
    h.index.store(M, B, [1])
    assert h.index.block_counts(M) == {A: 4, B: 1}
    h.index.remove(M, B, [1])
    assert h.index.block_counts(M) == {A: 4, B: 1}
    h.index.remove(M, B, [1])
    assert h.index.block_counts(M) == {A: 4}
    assert h.index.block_counts("other") == {}


def test_memory_accounting_follows_the_content(h: Harness) -> None:
    empty = h.index.memory_bytes()
    h.index.store(M, A, [random.getrandbits(64) for _ in range(5000)])
    full = h.index.memory_bytes()
    assert full - empty > 5000 * 8
    h.index.clear(M, A)
    assert h.index.memory_bytes() < full - 5000 * 8


# -- one key in several blocks (vLLM caches a recomputed block under a hash it already holds) --


def test_a_key_stored_twice_is_held_until_removed_twice(h: Harness) -> None:
    h.index.store(M, A, [1, 2, 3])
    h.index.store(M, A, [3])
    h.index.remove(M, A, [3])
    assert h.lookup([1, 2, 3]) == {A: {"GPU": 3}}
    h.index.remove(M, A, [3])
    assert h.lookup([1, 2, 3]) == {A: {"GPU": 2}}


def test_removes_beyond_the_copies_held_are_ignored(h: Harness) -> None:
    h.index.store(M, A, [1, 2])
    h.index.store(M, A, [2])
    h.index.remove(M, A, [2, 2, 2, 2])
    assert h.lookup([1, 2]) == {A: {"GPU": 1}}
    h.index.store(M, A, [2])
    assert h.lookup([1, 2]) == {A: {"GPU": 2}}
    h.index.remove(M, A, [2])
    assert h.lookup([1, 2]) == {A: {"GPU": 1}}


def test_a_key_repeated_within_one_call_counts_each_occurrence(h: Harness) -> None:
    h.index.store(M, A, [1, 2, 2, 2])
    h.index.remove(M, A, [2, 2])
    assert h.lookup([1, 2]) == {A: {"GPU": 2}}
    h.index.remove(M, A, [2])
    assert h.lookup([1, 2]) == {A: {"GPU": 1}}


def test_copies_are_counted_per_worker_and_medium(h: Harness) -> None:
    h.index.store(M, A, [1], "GPU")
    h.index.store(M, A, [1], "CPU")
    h.index.store(M, B, [1])
    h.index.store(M, B, [1])
    h.index.remove(M, A, [1], "GPU")
    assert h.lookup([1]) == {A: {"CPU": 1}, B: {"GPU": 1}}
    h.index.remove(M, A, [1], "CPU")
    assert h.lookup([1]) == {B: {"GPU": 1}}
    h.index.remove(M, B, [1])
    assert h.lookup([1]) == {B: {"GPU": 1}}


def test_clear_drops_every_copy(h: Harness) -> None:
    h.index.store(M, A, [1, 2])
    h.index.store(M, A, [1, 2, 2], "GPU")
    h.index.store(M, A, [1, 1], "CPU")
    h.index.clear(M, A)
    assert h.lookup([1, 2]) == {}
    h.index.store(M, A, [1, 2])
    h.index.remove(M, A, [1, 2])
    assert h.lookup([1, 2]) == {}
    assert h.index.block_counts(M) == {}


def test_events_of_a_repeated_exact_multiple_prompt_keep_the_second_copy(h: Harness) -> None:
    """The vLLM sequence: prompt [1, 2] cached, sent again (block 2 recomputed, stored again), one copy evicted."""
    h.index.apply(M, A, batch(stored([1, 2])))
    h.index.apply(M, A, batch(stored([2])))
    h.index.apply(M, A, batch(removed([2])))
    assert h.lookup([1, 2]) == {A: {"GPU": 2}}
    h.index.apply(M, A, batch(removed([1, 2])))
    assert h.lookup([1, 2]) == {}


# -- garbage keys ------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [-1, 2**64, 2**70, 1.5, "7", None, b"\x00" * 8])
def test_garbage_keys_are_rejected_and_nothing_changes(h: Harness, bad: object) -> None:
    with pytest.raises(InvalidKey):
        h.index.store(M, A, [1, 2, bad])  # type: ignore[list-item]
    with pytest.raises(InvalidKey):
        h.index.remove(M, A, [bad])  # type: ignore[list-item]
    assert h.lookup([1, 2]) == {}
    assert h.index.block_counts(M) == {}


def test_keys_at_both_ends_of_the_range_are_valid(h: Harness) -> None:
    h.index.store(M, A, [0, 2**64 - 1])
    assert h.lookup([0, 2**64 - 1]) == {A: {"GPU": 2}}


def test_lookup_of_garbage_keys_matches_nothing(h: Harness) -> None:
    h.index.store(M, A, [1])
    assert h.lookup([-1, 1]) == {}


# -- events ------------------------------------------------------------------------------


def test_apply_runs_a_batch_in_order(h: Harness) -> None:
    h.index.store(M, A, [50])
    h.index.apply(M, A, batch(
        stored([1, 2, 3]),
        removed([3]),
        AllBlocksCleared(),
        stored([1, 2, 3, 4], medium=None),
        stored([5], medium="CPU"),
        removed([4]),
    ))
    assert h.lookup([1, 2, 3, 4, 5]) == {A: {"GPU": 3}}
    assert h.lookup([50]) == {}
    assert h.index.block_counts(M) == {A: 4}


def test_bytes_hashes_index_under_their_int_key(h: Harness) -> None:
    digest = bytes(range(32))
    key = int.from_bytes(digest, "big") & (2**64 - 1)
    h.index.apply(M, A, batch(stored([digest, key + 1])))
    assert h.lookup([key, key + 1]) == {A: {"GPU": 2}}
    h.index.apply(M, A, batch(removed([digest])))
    assert h.lookup([key, key + 1]) == {}


def test_only_kv_cache_group_zero_is_indexed(h: Harness) -> None:
    h.index.apply(M, A, batch(stored([1, 2], group_idx=0), stored([3], group_idx=1), stored([9], group_idx=None)))
    assert h.lookup([1, 2, 3]) == {A: {"GPU": 2}}
    assert h.lookup([9]) == {A: {"GPU": 1}}
    h.index.apply(M, A, batch(removed([1], group_idx=1)))
    assert h.lookup([1, 2]) == {A: {"GPU": 2}}


def test_all_blocks_cleared_clears_only_that_worker(h: Harness) -> None:
    h.index.store(M, A, [1])
    h.index.store(M, A1, [1])
    h.index.apply(M, A1, batch(AllBlocksCleared()))
    assert h.lookup([1]) == {A: {"GPU": 1}}


# -- against a reference -----------------------------------------------------------------


class Reference:
    """The obvious model: a Counter of copies per (worker, medium); lookup walks it key by key."""

    def __init__(self) -> None:
        self.held: dict[tuple[Worker, str], Counter[int]] = {}

    def store(self, w: Worker, keys: list[int], medium: str) -> None:
        self.held.setdefault((w, medium), Counter()).update(keys)

    def remove(self, w: Worker, keys: list[int], medium: str) -> None:
        copies = self.held.get((w, medium), Counter())
        for k in keys:
            if copies[k] > 1:
                copies[k] -= 1
            else:
                copies.pop(k, None)

    def clear(self, w: Worker) -> None:
        for (worker, medium), s in self.held.items():
            if worker == w:
                s.clear()

    def lookup(self, keys: list[int]) -> Hits:
        hits: Hits = {}
        for w in {w for w, _ in self.held}:
            media = sorted((m for ww, m in self.held if ww == w), key=medium_rank)
            per: dict[str, int] = {}
            for k in keys:
                where = next((m for m in media if k in self.held[(w, m)]), None)
                if where is None:
                    break
                per[where] = per.get(where, 0) + 1
            if per:
                hits[w] = dict(sorted(per.items(), key=lambda mc: medium_rank(mc[0])))
        return hits


@pytest.mark.parametrize("seed", [7, 8, 9])
def test_random_operations_agree_with_the_reference(h: Harness, seed: int) -> None:
    """Stores overlap (so keys gain copies, also within one call), removes overshoot the copies
    held, and a third of the writes arrive as event batches of several stores and removes."""
    rng = random.Random(seed)
    ref = Reference()
    workers = [Worker(f"w{i}", i % 2) for i in range(5)]
    media = ["GPU", "GPU", "GPU", "CPU", "DISK"]
    chains = [[rng.getrandbits(64) for _ in range(rng.randint(1, 90))] for _ in range(6)]
    kept_by_a_copy = 0

    def some_keys() -> list[int]:
        chain = rng.choice(chains)
        a = rng.randrange(len(chain))
        keys = chain[a : a + rng.randint(1, 40)]
        if rng.random() < 0.2:
            keys = keys + rng.sample(keys, min(len(keys), 3))
        return keys

    for step in range(300):
        w = rng.choice(workers)
        r = rng.random()
        if r < 0.3:
            events, ops = [], []
            for _ in range(rng.randint(1, 4)):
                keys, medium, kind = some_keys(), rng.choice(media), rng.choice(["store", "remove"])
                events.append(stored(keys, medium) if kind == "store" else removed(keys, medium))
                ops.append((kind, keys, medium))
            h.index.apply(M, w, batch(*events))
            for kind, keys, medium in ops:
                getattr(ref, kind)(w, keys, medium)
        elif r < 0.95:
            keys, medium = some_keys(), rng.choice(media)
            if r < 0.65:
                h.index.store(M, w, keys, medium)
                ref.store(w, keys, medium)
            else:
                h.index.remove(M, w, keys, medium)
                ref.remove(w, keys, medium)
                kept_by_a_copy += sum(k in ref.held[(w, medium)] for k in keys) if (w, medium) in ref.held else 0
        else:
            h.index.clear(M, w)
            ref.clear(w)
        if step % 10 == 0:
            for chain in chains:
                assert h.lookup(chain) == ref.lookup(chain), f"step {step}"
    expected_counts = {}
    for (w, _), s in ref.held.items():
        if s:
            expected_counts[w] = expected_counts.get(w, 0) + len(s)
    assert h.index.block_counts(M) == expected_counts
    assert kept_by_a_copy > 5, "the sequence must remove keys that another copy keeps held"


# -- concurrency -------------------------------------------------------------------------


def test_apply_on_another_thread_while_looking_up_never_raises(h: Harness) -> None:
    rng = random.Random(3)
    chain = [rng.getrandbits(64) for _ in range(512)]
    errors: list[BaseException] = []
    stop = threading.Event()

    def writer() -> None:
        try:
            i = 0
            while not stop.is_set():
                w = Worker(f"w{i % 12}")
                cut = rng.randint(1, 512)
                medium = "CPU" if i % 5 == 0 else "GPU"
                h.index.apply(M, w, batch(stored(chain[:cut], medium), removed(chain[cut // 2 : cut], medium)))
                if i % 7 == 0:
                    h.index.apply(M, w, batch(AllBlocksCleared()))
                i += 1
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            errors.append(e)

    t = threading.Thread(target=writer)
    t.start()
    try:
        deadline = time.monotonic() + 1.5
        lookups = 0
        while time.monotonic() < deadline:
            for w, per in h.lookup(chain).items():
                assert 0 < sum(per.values()) <= 512, (w, per)
            lookups += 1
    finally:
        stop.set()
        t.join(timeout=30)
    assert not errors, errors
    assert lookups > 10
    for i in range(12):
        h.index.clear(M, Worker(f"w{i}"))
    assert h.lookup(chain) == {}
    assert h.index.block_counts(M) == {}


# -- the cap on keys per worker (KeyCaps) --------------------------------------------------


def test_a_worker_past_its_cap_loses_its_oldest_keys_first(h: Harness) -> None:
    """Capacity 5 blocks: at most 10 keys (KEY_CAP_SLACK = 2); the rest of the fleet is untouched."""
    h.index.caps.set_capacity(A, {"GPU": 5})
    h.index.store(M, B, list(range(1, 31)))
    assert h.index.apply(M, A, batch(stored(list(range(1, 11))))) == 0
    assert h.index.apply(M, A, batch(stored([11, 12, 13]))) == 3
    assert h.index.block_counts(M) == {A: 10, B: 30}
    assert h.lookup([1]) == {B: {"GPU": 1}}
    assert h.lookup(list(range(4, 14))) == {A: {"GPU": 10}, B: {"GPU": 10}}


def test_one_store_longer_than_the_cap_keeps_the_head_of_its_chain(h: Harness) -> None:
    """Hits are a prefix, so of a chain cut at the cap only its first keys can ever be hit."""
    h.index.caps.set_capacity(A, {"GPU": 5})
    h.index.store(M, A, [100])
    assert h.index.apply(M, A, batch(stored(list(range(1, 26))))) == 16
    assert h.index.block_counts(M) == {A: 10}
    assert h.lookup(list(range(1, 26))) == {A: {"GPU": 10}}
    assert h.lookup([100]) == {} and h.lookup([11]) == {}


def test_each_medium_has_its_own_cap_and_unknown_tiers_the_default(h: Harness) -> None:
    h.index.caps.set_capacity(A, {"GPU": 5, "CPU": 2})
    assert h.index.apply(M, A, batch(stored(list(range(1, 11)), "GPU"), stored(list(range(1, 8)), "CPU"))) == 3
    assert h.index.apply(M, A, batch(stored(list(range(1, 21)), "STORAGE"))) == 0
    assert h.index.block_counts(M) == {A: 10 + 4 + 20}
    assert h.index.caps.cap(A, "STORAGE") == h.index.caps.cap(B, "GPU") == 2 * DEFAULT_CAPACITY_BLOCKS


def test_eviction_skips_keys_already_removed(h: Harness) -> None:
    h.index.caps.set_capacity(A, {"GPU": 5})
    h.index.store(M, A, list(range(1, 11)))
    h.index.remove(M, A, [1, 2, 3, 4, 5])
    assert h.index.apply(M, A, batch(stored(list(range(11, 16))))) == 0
    assert h.index.apply(M, A, batch(stored([16]))) == 1
    assert h.lookup(list(range(7, 17))) == {A: {"GPU": 10}}
    assert h.lookup([6]) == {}


def test_an_evicted_key_goes_with_all_its_copies(h: Harness) -> None:
    h.index.caps.set_capacity(A, {"GPU": 1})
    h.index.store(M, A, [1, 1, 1])
    assert h.index.apply(M, A, batch(stored([2, 3]))) == 1
    assert h.lookup([1]) == {} and h.index.block_counts(M) == {A: 2}
    h.index.remove(M, A, [1])
    h.index.store(M, A, [1])
    h.index.remove(M, A, [1])
    assert h.lookup([1]) == {}, "the evicted key's copies are gone, not left to outlive a later store"


def test_a_cap_that_shrinks_under_a_full_worker_drains_over_later_stores(h: Harness) -> None:
    """The engine's capacity read after a flood: each store evicts what it added plus at most
    EVICT_DRAIN more, so no single call (on Redis, one script) walks the whole backlog."""
    held = 3 * EVICT_DRAIN
    h.index.store(M, A, list(range(1, held + 1)))
    h.index.caps.set_capacity(A, {"GPU": 5})
    assert h.index.apply(M, A, batch(stored([10**9]))) == 1 + EVICT_DRAIN
    assert h.index.block_counts(M) == {A: held + 1 - (1 + EVICT_DRAIN)}
    for i in range(1, 4):
        h.index.apply(M, A, batch(stored([10**9 + i])))
    assert h.index.block_counts(M) == {A: 10}
    assert h.lookup([10**9 + 3]) == h.lookup([held]) == {A: {"GPU": 1}}, "the newest keys are kept"
    assert h.lookup([held - 6]) == {}


def test_a_capped_worker_keeps_taking_new_keys_and_clears_whole(h: Harness) -> None:
    h.index.caps.set_capacity(A, {"GPU": 50})
    rng = random.Random(3)
    for _ in range(30):
        h.index.apply(M, A, batch(stored([rng.getrandbits(64) for _ in range(70)])))
    last = [rng.getrandbits(64) for _ in range(40)]
    h.index.apply(M, A, batch(stored(last)))
    assert h.index.block_counts(M) == {A: 100}
    assert h.lookup(last) == {A: {"GPU": 40}}, "the newest keys are kept"
    h.index.apply(M, A, batch(AllBlocksCleared()))
    assert h.index.block_counts(M) == {} and h.lookup(last) == {}


# -- MemoryIndex only --------------------------------------------------------------------


def test_memory_index_churn_keeps_worker_logs_bounded() -> None:
    """Blocks stored and evicted over and over must not grow the per-worker clear log forever."""
    index = MemoryIndex()
    rng = random.Random(1)
    for _ in range(60):
        keys = [rng.getrandbits(64) for _ in range(1000)]
        index.store(M, A, keys)
        index.remove(M, A, keys[:990])
    assert index.block_counts(M) == {A: 600}
    assert index.memory_bytes() < 200_000
    index.clear(M, A)
    assert index.block_counts(M) == {}
    assert asyncio.run(index.lookup(M, keys)) == {}


def test_memory_index_flood_past_the_cap_keeps_its_log_bounded() -> None:
    """A worker fed far more keys than its cap: the eviction cursor's log is trimmed as it goes."""
    index = MemoryIndex()
    index.caps.set_capacity(A, {"GPU": 500})
    rng = random.Random(2)
    for _ in range(200):
        index.store(M, A, [rng.getrandbits(64) for _ in range(1000)])
    assert index.block_counts(M) == {A: 1000}
    mi = index._models[M]
    assert len(mi.logs[(0, "GPU")]) - mi.heads.get((0, "GPU"), 0) == 1000
    assert len(mi.logs[(0, "GPU")]) < 2 * 1000 + 4096 + 1000
    assert index.memory_bytes() < 400_000
