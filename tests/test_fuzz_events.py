"""Event fuzz (issue 17 §3): mutated real KV-event payloads into a running subscriber over real ZMQ.

One :class:`FleetSubscriber` follows two engines (:class:`kvpub.EnginePublisher`, PUB and
replay sockets on loopback) of one model:

- ``fuzzed`` publishes mutations of every payload in the golden captures
  (``tests/fixtures/golden/kv_events_*.jsonl`` and the block-manager traces): byte
  flips, cuts, splices and inserted bytes, and mutations of the decoded structure
  (wrong-typed fields, hashes out of range or of odd lengths, strange media, huge hash
  lists, extra keys of any shape, negative block sizes), plus frames of the wrong shape;
- ``clean`` publishes, at the same time, the 0.33 block-manager trace, whose final
  cache is known.

The subscriber runs as the router runs it (hash verification on). It must never stop,
must count every payload it skips (``kvrouter_kv_events_malformed_total``), and the
clean worker's index entries must end exactly equal to its engine's cache, although the
fuzzed engine stores, removes and clears the same block keys.

The Redis variant (``kvrouter indexer``'s index, real ``redis-server``) runs without
verification so the fuzzed worker's entries can be checked too: they must equal those
of a :class:`MemoryIndex` fed the same payloads directly.

``make test`` publishes 10,000 fuzzed payloads (2,000 into Redis);
``KVROUTER_FUZZ_FULL=1`` publishes 100,000 (20,000 into Redis).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from indexer.events import (
    REMOVED_FIELDS,
    STORED_FIELDS,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventDecodeError,
    UnknownEvent,
    decode_batch,
    encode_batch,
    to_keys,
)
from indexer.hashing import BlockHasher
from indexer.index import Index, MemoryIndex, Worker
from indexer.redis_index import RedisIndex
from indexer.subscriber import FleetSubscriber, StreamSpec, bound_batch
from indexer.verify import SETTLE_AFTER, HashVerifier
from kvpub import EnginePublisher
import support
from support import GOLDEN, fuzz_cases, golden_batches, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

MODEL = "m"
FUZZED = Worker("fuzzed", 0)
CLEAN = Worker("clean", 0)
TOPIC = b"kv-events"


def golden_payloads() -> list[bytes]:
    out = []
    for path in sorted(GOLDEN.glob("kv_events_vllm-*.jsonl")):
        out += [bytes.fromhex(d["payload_hex"]) for d in map(json.loads, path.read_text().splitlines()) if d["kind"] == "pub"]
    for path in sorted(GOLDEN.glob("blockmanager_trace_vllm-*.jsonl")):
        lines = path.read_text().splitlines()
        out += [bytes.fromhex(d["payload_hex"]) for d in map(json.loads, lines[:120]) if d["kind"] == "events"]
    return out


SEEDS = golden_payloads()
CLEAN_BATCHES = golden_batches()


# -- mutations -----------------------------------------------------------------------------


def mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    return support.mutate_bytes(rng, data, SEEDS)


def odd_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(12 if depth < 2 else 9)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.choice([0, 1, -1, 16, -16, 2**63 - 1, 2**63, 2**64 - 1, -(2**63), rng.randrange(2**64)])
    if kind == 3:
        return rng.choice([0.5, -1.0, 1e308, float("inf"), float("nan")])
    if kind == 4:
        return rng.choice(["", "GPU", "CPU", "DISK", "gpu", "\n", "h:GPU\n0", "*", "\u6f22" * 40, "x" * 5000])
    if kind == 5:
        return rng.randbytes(rng.choice([0, 1, 7, 8, 9, 16, 31, 32, 33, 64]))
    if kind == 6:
        return [rng.randrange(2**64) for _ in range(rng.choice([0, 1, 3, 5000]))]
    if kind == 7:
        return [rng.randrange(-5, 152_000) for _ in range(rng.choice([0, 1, 15, 16, 17, 64]))]
    if kind == 8:
        return rng.choice(["BlockStored", "BlockRemoved", "AllBlocksCleared", "BlockMoved"])
    if kind in (9, 10):
        return [odd_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(["type", "block_hashes", "medium", "extra_keys", "x"]): odd_value(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def mutate_structure(rng: random.Random, doc: Any) -> Any:
    """Replace, drop or duplicate something at a random place in the decoded batch."""
    if not isinstance(doc, (list, dict)) or not doc or rng.random() < 0.15:
        return odd_value(rng)
    keys = list(range(len(doc))) if isinstance(doc, list) else list(doc)
    key = rng.choice(keys)
    roll = rng.random()
    if roll < 0.6:
        doc[key] = mutate_structure(rng, doc[key])
    elif roll < 0.75:
        del doc[key]
    elif roll < 0.85 and isinstance(doc, list):
        doc.insert(rng.randrange(len(doc) + 1), doc[key])
    else:
        doc[key] = odd_value(rng)
    return doc


def field_value(rng: random.Random, name: str) -> Any:
    """A value of the field's type that no engine would send (or, sometimes, of another type)."""
    if rng.random() < 0.15:
        return odd_value(rng)
    if name in ("block_hashes",):
        return rng.choice([
            [rng.randrange(2**64) for _ in range(rng.choice([0, 1, 5000]))],
            [2**64 - 1, 0, 2**63], [rng.randbytes(rng.choice([0, 1, 8, 31, 32, 33, 100])) for _ in range(3)],
            [rng.randrange(2**64), rng.randbytes(32)],
        ])
    if name == "parent_block_hash":
        return rng.choice([None, 0, 2**64 - 1, rng.randrange(2**64), rng.randbytes(rng.choice([0, 5, 32]))])
    if name in ("token_ids", "lookahead_token_ids"):
        return [rng.choice([-1, 0, 2**31, 2**63 - 1, rng.randrange(152_000)]) for _ in range(rng.choice([0, 1, 15, 16, 17, 48, 5000]))]
    if name in ("block_size", "group_idx", "lora_id", "kv_cache_spec_sliding_window"):
        return rng.choice([None, 0, -1, 1, 3, 16, 2**31, 2**63 - 1, -(2**63)])
    if name in ("medium", "lora_name", "kv_cache_spec_kind"):
        return rng.choice([None, "", "GPU", "CPU", "gpu", "DISK", "\n", "h:GPU\n0", "x" * 3000, "\u6f22\u5b57", "\x00"])
    return odd_value(rng)


def mutate_event(rng: random.Random, ev: Any) -> Any:
    """Change a field of one event (a map since vLLM 0.24, a positional array before)."""
    if isinstance(ev, dict) and ev:
        fields = STORED_FIELDS if ev.get("type") == "BlockStored" else REMOVED_FIELDS
        name = rng.choice([*fields, "type", "unknown_field"])
        if name == "type":
            ev[name] = rng.choice(["BlockStored", "BlockRemoved", "AllBlocksCleared", "BlockMoved", "", 5])
        elif rng.random() < 0.15 and name in ev:
            del ev[name]
        else:
            ev[name] = field_value(rng, name)
    elif isinstance(ev, list) and len(ev) > 1:
        fields = STORED_FIELDS if ev[0] == "BlockStored" else REMOVED_FIELDS
        i = rng.randrange(1, len(ev))
        ev[i] = field_value(rng, fields[i - 1] if i - 1 < len(fields) else "extra")
    else:
        return odd_value(rng)
    return ev


_GENERIC = msgspec.msgpack.Decoder()


def fuzzed_payload(rng: random.Random) -> bytes:
    """A mutation of a real payload: of its bytes (40%), of one of its events' fields
    (45%), or of anything in its structure."""
    seed = rng.choice(SEEDS)
    roll = rng.random()
    if roll < 0.4:
        return mutate_bytes(rng, seed)
    doc = _GENERIC.decode(seed)
    for _ in range(rng.randint(1, 3)):
        events = doc[1] if isinstance(doc, list) and len(doc) > 1 and isinstance(doc[1], list) else None
        if roll < 0.85 and events:
            i = rng.randrange(len(events))
            events[i] = mutate_event(rng, events[i])
            if rng.random() < 0.1:
                events.append(events[rng.randrange(len(events))])
        else:
            doc = mutate_structure(rng, doc)
    return msgspec.msgpack.encode(doc)


def bad_frames(rng: random.Random) -> list[bytes]:
    """A message of the wrong shape (its topic is right, so the SUB socket delivers it)."""
    return rng.choice([
        [TOPIC],
        [TOPIC, (5).to_bytes(8, "big")],
        [TOPIC, b"abc", rng.choice(SEEDS)],
        [TOPIC, (0).to_bytes(4, "big"), rng.choice(SEEDS)],
        [TOPIC, (1).to_bytes(8, "big"), rng.choice(SEEDS), b"extra"],
    ])


# -- expectations ----------------------------------------------------------------------------


def decoded(payload: bytes) -> Any:
    try:
        return decode_batch(payload)
    except EventDecodeError:
        return None


def truth_of(payloads: list[bytes]) -> set[int]:
    """The clean engine's cache at the end: its stores and removals applied to a set."""
    cached: set[int] = set()
    for p in payloads:
        for ev in decode_batch(p).events:
            if isinstance(ev, BlockStored):
                cached |= set(to_keys(ev.block_hashes))
            elif isinstance(ev, BlockRemoved):
                cached -= set(to_keys(ev.block_hashes))
            else:
                cached.clear()
    return cached


def holdings(index: Index, worker: Worker, keys: set[int]) -> dict[int, str]:
    """For each of ``keys`` the worker holds, the best medium it holds it in (one lookup per key)."""
    async def run() -> dict[int, str]:
        out = {}
        for k in sorted(keys):
            media = (await index.lookup(MODEL, [k])).get(worker)
            if media:
                out[k] = next(iter(media))
        return out

    return asyncio.run(run())


@contextmanager
def engines() -> Iterator[tuple[EnginePublisher, EnginePublisher]]:
    fuzzed = EnginePublisher(topic=TOPIC, buffer_steps=200_000)
    clean = EnginePublisher(topic=TOPIC, buffer_steps=200_000)
    try:
        yield fuzzed, clean
    finally:
        fuzzed.close()
        clean.close()


def run_fuzz(index: Index, n: int, seed: int, *, verify: bool) -> tuple[FleetSubscriber, list[bytes], CollectorRegistry, int]:
    """Publish ``n`` fuzzed payloads and the clean trace into a subscriber on ``index``; return
    the (still running) subscriber, the fuzzed payloads in seq order, and the wrong-shape count."""
    rng = random.Random(seed)
    registry = CollectorRegistry()
    verifiers = {MODEL: HashVerifier(BlockHasher("sha256", 16, "0", "0.33.0"), {}, settle_after=SETTLE_AFTER)} if verify else {}
    with engines() as (fuzzed, clean):
        specs = [StreamSpec(MODEL, FUZZED, fuzzed.endpoint, fuzzed.replay_endpoint, topic=TOPIC.decode()),
                 StreamSpec(MODEL, CLEAN, clean.endpoint, clean.replay_endpoint, topic=TOPIC.decode())]
        sub = FleetSubscriber(index, specs, verifiers=verifiers, metrics_registry=registry, tail_probe_s=0.5)
        sub.start()
        try:
            fuzzed.wait_subscribed()
            clean.wait_subscribed()
            sent: list[bytes] = []
            shapes = 0
            every = max(1, n // len(CLEAN_BATCHES))
            clean_left = list(CLEAN_BATCHES)
            for i in range(n):
                payload = fuzzed_payload(rng)
                sent.append(payload)
                fuzzed.publish(payload)
                if i % 50 == 49:
                    fuzzed.send_raw(bad_frames(rng))
                    shapes += 1
                if i % every == 0 and clean_left:
                    clean.publish(clean_left.pop(0))
            for payload in clean_left:
                clean.publish(payload)
            wait_for(lambda: sub.stats()[FUZZED].last_seq == n - 1, "the last fuzzed batch", timeout=300)
            wait_for(lambda: sub.stats()[CLEAN].last_seq == len(CLEAN_BATCHES) - 1, "the last clean batch", timeout=60)
            # A tail probe's replay can bring the last batches before the SUB socket's backlog
            # (where the wrong-shape messages wait) is read: wait for every skip to be counted.
            skips = shapes + sum(decoded(p) is None for p in sent)
            wait_for(lambda: sub.stats()[FUZZED].malformed >= skips, "every skip counted", timeout=60)
        except BaseException:
            sub.stop()
            raise
    return sub, sent, registry, shapes


def check_common(sub: FleetSubscriber, index: Index, sent: list[bytes], registry: CollectorRegistry, shapes: int) -> None:
    """The thread runs, every skip is counted, the clean worker is exact."""
    assert sub.running
    stats = sub.stats()
    fuzzed, clean = stats[FUZZED], stats[CLEAN]
    batches = [decoded(p) for p in sent]
    undecodable = sum(b is None for b in batches)
    unknown = sum(isinstance(ev, UnknownEvent) for b in batches if b is not None for ev in b.events)
    assert 0.2 * len(sent) < undecodable < 0.9 * len(sent)  # the fuzz reaches past the decoder too
    assert fuzzed.malformed == undecodable + shapes, (fuzzed, undecodable, shapes)
    assert fuzzed.batches == len(sent) - undecodable
    assert fuzzed.lost == fuzzed.restarts == fuzzed.index_errors == 0, fuzzed
    labels = {"backend": FUZZED.backend, "dp_rank": "0"}
    assert registry.get_sample_value("kvrouter_kv_events_malformed_total", labels) == undecodable + shapes
    assert (registry.get_sample_value("kvrouter_kv_events_total", {**labels, "type": "UnknownEvent"}) or 0) == unknown
    truth = truth_of(CLEAN_BATCHES)
    assert len(truth) > 50
    stored = {k for p in CLEAN_BATCHES for ev in decode_batch(p).events if isinstance(ev, BlockStored) for k in to_keys(ev.block_hashes)}
    assert holdings(index, CLEAN, stored) == dict.fromkeys(truth, "GPU")
    assert index.block_counts(MODEL).get(CLEAN) == len(truth)
    assert clean.malformed == clean.lost == clean.restarts == clean.index_errors == clean.gaps == 0, clean
    assert clean.batches == len(CLEAN_BATCHES)
    print(f"\nevent fuzz: {len(sent)} payloads + {shapes} wrong-shape messages: {undecodable} undecodable, "
          f"{len(sent) - undecodable} applied ({unknown} unknown events); fuzzed worker {fuzzed}")


def test_mutated_payloads_never_stop_the_subscriber_nor_touch_another_workers_entries() -> None:
    index = MemoryIndex()
    sub, sent, registry, shapes = run_fuzz(index, fuzz_cases(10_000, 100_000), 4242, verify=True)
    try:
        check_common(sub, index, sent, registry, shapes)
    finally:
        sub.stop()


def test_mutated_payloads_into_redis_leave_what_a_memory_index_would(redis_url: str) -> None:
    index = RedisIndex(redis_url, namespace=f"fuzz-{uuid.uuid4().hex[:8]}")
    try:
        sub, sent, registry, shapes = run_fuzz(index, fuzz_cases(2_000, 20_000), 77, verify=False)
        try:
            check_common(sub, index, sent, registry, shapes)
            reference = MemoryIndex()
            seen: set[int] = set()
            media: set[str] = set()
            for batch in filter(None, map(decoded, sent)):
                reference.apply(MODEL, FUZZED, bound_batch(batch, media, reference.caps, FUZZED)[0])
                seen |= {k for ev in batch.events if isinstance(ev, (BlockStored, BlockRemoved)) for k in to_keys(ev.block_hashes)}
            sample = set(random.Random(5).sample(sorted(seen), min(len(seen), 3000)))
            assert holdings(index, FUZZED, sample) == holdings(reference, FUZZED, sample)
            assert index.block_counts(MODEL).get(FUZZED) == reference.block_counts(MODEL).get(FUZZED)
        finally:
            sub.stop()
    finally:
        index.close()


# -- what the fuzz found -----------------------------------------------------------------------


def stored(keys: list[int], tokens: list[int], **fields: Any) -> BlockStored:
    return BlockStored(keys, None, tokens, 16, None, "GPU", **fields)


def test_extra_keys_that_are_not_lists_make_blocks_unverifiable_not_a_crash() -> None:
    """An int where a block's extra keys should be crashed the verifier, which killed the
    whole ingest thread (every engine's stream stopped), not just that batch."""
    hasher = BlockHasher("sha256", 16, "0", "0.33.0")
    tokens = list(range(100, 132))
    keys = hasher.hash_blocks_int64(tokens)
    verifier = HashVerifier(hasher, {})
    for extra in ([7, None], [{"a": 1}, None], ["salt-as-a-bare-string", None]):
        outcome = verifier.check(FUZZED, EventBatch(1.0, [stored(keys, tokens, extra_keys=extra)], 0))
        assert outcome.unverifiable >= 1 and outcome.match <= 1, (extra, outcome)


def test_a_medium_spanning_lines_is_a_malformed_batch() -> None:
    """The Redis index keys media by line; such a medium made every write of the batch fail."""
    for medium in ("GPU\n", "a\nb", "\r"):
        batch = EventBatch(1.0, [BlockRemoved([1], medium)], 0)
        with pytest.raises(EventDecodeError):
            decode_batch(encode_batch(batch, "0.33.0"))
    assert decode_batch(encode_batch(EventBatch(1.0, [BlockRemoved([1], "CPU")], 0), "0.33.0")).events[0].medium == "CPU"


class RefusingIndex(MemoryIndex):
    """A memory index that refuses (``ValueError``) any batch storing key 666, and counts clears."""

    def __init__(self) -> None:
        super().__init__()
        self.clears = 0

    def apply(self, model: str, worker: Worker, batch: EventBatch) -> int:
        if any(isinstance(ev, BlockStored) and 666 in ev.block_hashes for ev in batch.events):
            raise ValueError("refused")
        return super().apply(model, worker, batch)

    def clear(self, model: str, worker: Worker) -> None:
        self.clears += 1
        super().clear(model, worker)


class ExplodingVerifier(HashVerifier):
    """Passes batches through, except that it raises on any batch storing key 13."""

    def check(self, worker: Worker, batch: EventBatch) -> Any:
        if any(isinstance(ev, BlockStored) and 13 in ev.block_hashes for ev in batch.events):
            raise RuntimeError("verifier bug")
        return super().check(worker, batch)


def test_a_batch_the_index_refuses_or_the_verifier_cannot_take_is_skipped_without_a_resync() -> None:
    """A batch the Redis index refused made the subscriber clear the worker and replay its
    history, which held the same batch: a re-sync every tick, forever. One the verifier
    raised on stopped the ingest thread. Both are now counted as malformed and skipped."""
    index = RefusingIndex()
    verifier = ExplodingVerifier(BlockHasher("sha256", 16, "0", "0.33.0"), {})
    with engines() as (engine, _):
        sub = FleetSubscriber(index, [StreamSpec(MODEL, FUZZED, engine.endpoint, engine.replay_endpoint, topic=TOPIC.decode())],
                              verifiers={MODEL: verifier}, tail_probe_s=0.2)
        sub.start()
        try:
            engine.wait_subscribed()
            for keys in ([1], [666], [13], [2]):
                engine.publish(encode_batch(EventBatch(1.0, [BlockStored(keys, None, [], 16, None, "GPU")], 0), "0.33.0"))
            wait_for(lambda: sub.stats()[FUZZED].last_seq == 3, "the batch after the refused ones")
            time.sleep(1.0)  # a few tail probes: a re-sync would show up as replays and clears
            stats = sub.stats()[FUZZED]
            assert sub.running and stats.malformed == 2 and stats.index_errors == 0 and index.clears == 0, stats
            assert holdings(index, FUZZED, {1, 2, 13, 666}) == {1: "GPU", 2: "GPU"}
        finally:
            sub.stop()
