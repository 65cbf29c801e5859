"""Hash self-verification against vLLM's own hashes, and re-hash mode when the config is wrong."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest

from indexer.events import BlockRemoved, BlockStored, EventBatch, decode_batch
from indexer.hashing import BlockHasher, to_int64
from indexer.index import KeyCaps, MemoryIndex, Worker
from indexer.verify import HashVerifier
from support import GOLDEN

TRACES = sorted(GOLDEN.glob("blockmanager_trace_*.jsonl"))
LORA_PATHS = {"sql-adapter": "/adapters/sql"}
MODEL = "m"
WORKER = Worker("engine-0", 0)


def load(path: Path) -> tuple[dict, list[dict]]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return lines[0], lines[1:]


def hasher_for(meta: dict, **override) -> BlockHasher:
    cfg = {"algo": meta["hash_algo"], "block_size": meta["block_size"], "seed": meta["pythonhashseed"],
           "vllm_version": meta["vllm_version"], **override}
    return BlockHasher(cfg["algo"], cfg["block_size"], cfg["seed"], cfg["vllm_version"])


def run_trace(lines: list[dict], verifier: HashVerifier, index: MemoryIndex, router: BlockHasher) -> dict:
    """Feed every batch through ``verifier`` into ``index``; check each probe hashed by ``router``."""
    totals = {"match": 0, "mismatch": 0, "unverifiable": 0, "switches": 0, "probes": 0}
    for line in lines:
        if line["kind"] == "events":
            outcome = verifier.check(WORKER, decode_batch(bytes.fromhex(line["payload_hex"])))
            index.apply(MODEL, WORKER, outcome.batch)
            totals["match"] += outcome.match
            totals["mismatch"] += outcome.mismatch
            totals["unverifiable"] += outcome.unverifiable
            totals["switches"] += outcome.mode_changed
            continue
        keys = router.hash_blocks_int64(line["token_ids"], lora=line["lora"], cache_salt=line["cache_salt"])
        n = sum(asyncio.run(index.lookup(MODEL, keys)).get(WORKER, {}).values())
        assert n == line["num_full_blocks_cached"], (totals["probes"], line["probe_kind"])
        totals["probes"] += 1
    return totals


@pytest.mark.parametrize("path", TRACES, ids=lambda p: p.stem.removeprefix("blockmanager_trace_"))
def test_golden_traces_verify_without_a_single_mismatch(path: Path) -> None:
    meta, lines = load(path)
    hasher = hasher_for(meta)
    verifier = HashVerifier(hasher, LORA_PATHS)
    totals = run_trace(lines, verifier, MemoryIndex(), hasher)
    assert totals["mismatch"] == 0 and totals["switches"] == 0
    assert not verifier.rehash_mode(WORKER)
    if tuple(map(int, meta["vllm_version"].split(".")[:2])) >= (0, 22):
        # Events carry every block's extra keys: every block verifies.
        assert totals["unverifiable"] == 0 and totals["match"] > 2000
    else:
        # vLLM < 0.22 sends no extra keys: salted chains are unverifiable, never mismatches.
        assert totals["unverifiable"] > 0 and totals["match"] > 1400


def test_lora_blocks_without_a_configured_path_are_unverifiable_not_mismatches() -> None:
    meta, lines = load(GOLDEN / "blockmanager_trace_vllm-0.33.0.jsonl")
    verifier = HashVerifier(hasher_for(meta), lora_paths=None)
    totals = run_trace(lines, verifier, MemoryIndex(), hasher_for(meta))
    assert totals["mismatch"] == 0 and totals["unverifiable"] > 100 and totals["match"] > 1500


@pytest.mark.parametrize(
    ("trace", "override", "cause"),
    [
        ("vllm-0.33.0", {"seed": "1"}, "hash_seed='0'"),
        ("vllm-0.33.0_sha256_cbor_unset", {"seed": "0"}, "hash_seed=null (PYTHONHASHSEED unset)"),
        ("vllm-0.28.0", {"algo": "sha256_cbor"}, "hash_algo='sha256'"),
        ("vllm-0.22.0_sha256_cbor_42", {"algo": "xxhash", "seed": "0"}, "hash_algo='sha256_cbor', hash_seed='42'"),
    ],
)
def test_wrong_config_switches_to_rehash_mode_and_lookups_stay_exact(
    trace: str, override: dict, cause: str, caplog: pytest.LogCaptureFixture
) -> None:
    meta, lines = load(GOLDEN / f"blockmanager_trace_{trace}.jsonl")
    router = hasher_for(meta, **override)
    verifier = HashVerifier(router, LORA_PATHS)
    with caplog.at_level(logging.WARNING, logger="indexer.verify"):
        # Every probe (taken after the switch) is looked up with the *router's* hashes and
        # must still find exactly what vLLM found: stores and ~2,000 removals were re-keyed.
        totals = run_trace(lines, verifier, MemoryIndex(), router)
    assert verifier.rehash_mode(WORKER) and totals["switches"] == 1
    assert totals["match"] == 0 and totals["mismatch"] > 2000 and totals["probes"] == meta["n_probes"]
    diagnosis = verifier.diagnosis(WORKER)
    assert diagnosis is not None and diagnosis.startswith(f"the engines hash like {cause} ")
    assert any("re-hash mode" in r.getMessage() and cause in r.getMessage() for r in caplog.records)


def engine_events(engine: BlockHasher, tokens: list[int], parent: bytes | None = None, *, as_bytes: bool = False):
    digests = engine.hash_blocks(tokens, parent=parent)
    hashes = digests if as_bytes else [to_int64(d) for d in digests]
    parent_hash = None if parent is None else (parent if as_bytes else to_int64(parent))
    return digests, BlockStored(hashes, parent_hash, tokens, engine.block_size, None, "GPU")


def test_block_removed_in_rehash_mode_removes_the_router_key() -> None:
    engine = BlockHasher("sha256", 16, "7", "0.33.0")
    router = BlockHasher("sha256", 16, "0", "0.33.0")
    verifier = HashVerifier(router, min_mismatches=2)
    index = MemoryIndex()
    tokens = list(range(64))
    digests, stored = engine_events(engine, tokens)
    outcome = verifier.check(WORKER, EventBatch(1.0, [stored], 0))
    index.apply(MODEL, WORKER, outcome.batch)
    assert outcome.mode_changed and verifier.rehash_mode(WORKER)
    router_keys = router.hash_blocks_int64(tokens)
    assert asyncio.run(index.lookup(MODEL, router_keys)) == {WORKER: {"GPU": 4}}
    assert asyncio.run(index.lookup(MODEL, [to_int64(d) for d in digests])) == {}
    removed = BlockRemoved([to_int64(d) for d in digests[2:]], "GPU")
    index.apply(MODEL, WORKER, verifier.check(WORKER, EventBatch(2.0, [removed], 0)).batch)
    assert asyncio.run(index.lookup(MODEL, router_keys)) == {WORKER: {"GPU": 2}}
    assert index.block_counts(MODEL) == {WORKER: 2}


def test_rehash_mode_ends_when_the_engines_are_fixed() -> None:
    wrong = BlockHasher("sha256", 16, "7", "0.33.0")
    router = BlockHasher("sha256", 16, "0", "0.33.0")
    verifier = HashVerifier(router, min_mismatches=4)
    index = MemoryIndex()
    _, stored = engine_events(wrong, list(range(80)))
    index.apply(MODEL, WORKER, verifier.check(WORKER, EventBatch(1.0, [stored], 0)).batch)
    assert verifier.rehash_mode(WORKER)
    fixed_tokens = list(range(1000, 1080))
    _, stored = engine_events(router, fixed_tokens)
    outcome = verifier.check(WORKER, EventBatch(3.0, [stored], 0))
    index.apply(MODEL, WORKER, outcome.batch)
    assert outcome.mode_changed and not verifier.rehash_mode(WORKER)
    assert asyncio.run(index.lookup(MODEL, router.hash_blocks_int64(fixed_tokens))) == {WORKER: {"GPU": 5}}
    # Blocks from the misconfigured period are indexed under the engine's keys again.
    assert asyncio.run(index.lookup(MODEL, wrong.hash_blocks_int64(list(range(80))))) == {WORKER: {"GPU": 5}}


def test_full_digest_events_verify_and_continue_from_the_parent_digest() -> None:
    hasher = BlockHasher("xxhash", 16, "42", "0.28.0")
    verifier = HashVerifier(hasher)
    tokens = list(range(96))
    digests = hasher.hash_blocks(tokens)
    # A chain that starts at an unseen parent: with full digests it can still be checked.
    _, tail = engine_events(hasher, tokens[32:], parent=digests[1], as_bytes=True)
    outcome = verifier.check(WORKER, EventBatch(1.0, [tail], 0))
    assert (outcome.match, outcome.mismatch, outcome.unverifiable) == (4, 0, 0)
    _, tail_int = engine_events(BlockHasher("xxhash", 16, "42", "0.28.0"), tokens[32:], parent=digests[1])
    outcome = HashVerifier(hasher).check(WORKER, EventBatch(1.0, [tail_int], 0))
    assert (outcome.match, outcome.mismatch, outcome.unverifiable) == (0, 0, 4)


def test_block_size_mismatch_is_diagnosed() -> None:
    engine = BlockHasher("sha256", 32, "0", "0.33.0")
    verifier = HashVerifier(BlockHasher("sha256", 16, "0", "0.33.0"), min_mismatches=2)
    _, stored = engine_events(engine, list(range(128)))
    outcome = verifier.check(WORKER, EventBatch(1.0, [stored], 0))
    assert outcome.mode_changed and outcome.mismatch == 4
    assert "block size" in (verifier.diagnosis(WORKER) or "")


def test_a_settled_worker_spot_checks_first_blocks_and_skips_continuations() -> None:
    hasher = BlockHasher("sha256", 16, "0", "0.33.0")
    verifier = HashVerifier(hasher, settle_after=8, spot_blocks=2)
    digests, root = engine_events(hasher, list(range(160)))
    outcome = verifier.check(WORKER, EventBatch(1.0, [root], 0))
    assert (outcome.match, outcome.skipped) == (10, 0)
    # Settled: a continuation of a cached prefix is not re-derived ...
    _, tail = engine_events(hasher, list(range(160, 224)), parent=digests[-1])
    outcome = verifier.check(WORKER, EventBatch(2.0, [tail], 0))
    assert (outcome.match, outcome.mismatch, outcome.unverifiable, outcome.skipped) == (0, 0, 0, 4)
    # ... and a new prefix has only its first blocks checked.
    _, other = engine_events(hasher, list(range(1000, 1080)))
    outcome = verifier.check(WORKER, EventBatch(3.0, [other], 0))
    assert (outcome.match, outcome.skipped) == (2, 3)
    assert outcome.batch.events == [other]


def test_a_settled_worker_restarted_with_another_seed_is_caught_by_spot_checks() -> None:
    router = BlockHasher("sha256", 16, "0", "0.33.0")
    verifier = HashVerifier(router, settle_after=8, spot_blocks=2, window=4, min_mismatches=4)
    _, root = engine_events(router, list(range(160)))
    verifier.check(WORKER, EventBatch(1.0, [root], 0))
    wrong = BlockHasher("sha256", 16, "7", "0.33.0")
    _, first = engine_events(wrong, list(range(2000, 2064)))
    outcome = verifier.check(WORKER, EventBatch(2.0, [first], 0))
    # The first spot check fails; the worker is no longer settled, so the rest is checked.
    assert (outcome.mismatch, outcome.skipped) == (2, 2) and not verifier.rehash_mode(WORKER)
    _, second = engine_events(wrong, list(range(3000, 3064)))
    outcome = verifier.check(WORKER, EventBatch(3.0, [second], 0))
    assert outcome.mismatch == 4 and outcome.skipped == 0
    assert outcome.mode_changed and verifier.rehash_mode(WORKER)
    assert "hash_seed='7'" in (verifier.diagnosis(WORKER) or "")


def test_the_blocks_kept_per_worker_follow_its_key_caps() -> None:
    """The verifier mirrors the engine's blocks for chaining; past the index's cap for the
    worker it keeps no more than the index does, oldest out first."""
    caps = KeyCaps()
    caps.set_capacity(WORKER, {"GPU": 50, "CPU": 25})
    verifier = HashVerifier(BlockHasher("sha256", 16, "0", "0.33.0"), caps=caps)
    for i in range(10):
        keys = list(range(1000 * i, 1000 * i + 40))
        verifier.check(WORKER, EventBatch(1.0, [BlockStored(keys, None, [], 16, None, "GPU")], 0))
    assert len(verifier._workers[WORKER].held) == 100 and 9039 in verifier._workers[WORKER].held
    verifier.check(WORKER, EventBatch(1.0, [BlockStored([1, 2], None, [], 16, None, "CPU")], 0))
    assert len(verifier._workers[WORKER].held) == 102, "a second tier adds its cap"
    caps.set_capacity(WORKER, {"GPU": 10, "CPU": 10})
    verifier.check(WORKER, EventBatch(1.0, [BlockStored([3], None, [], 16, None, "CPU")], 0))
    assert len(verifier._workers[WORKER].held) == 40, "a smaller capacity, learned later, shrinks what is kept"
