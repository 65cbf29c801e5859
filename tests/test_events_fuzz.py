"""Fuzzing decode_batch: whatever arrives on the wire, the only error is EventDecodeError.

Over 100k payloads in all: mutations of every real capture (bit flips, byte
overwrites, truncations, splices, inserted bytes), random msgpack documents, and
random batches shaped like events with wrong-typed fields, built with a seeded RNG so
a failure reproduces; plus hypothesis-built structures. Whatever decodes must also
render, key and re-encode without raising, since the indexer and CLI do that next.
"""

from __future__ import annotations

import json
import random

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from indexer.events import (
    STORED_FIELDS,
    REMOVED_FIELDS,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventDecodeError,
    UnknownEvent,
    decode_batch,
    encode_batch,
    to_expected_json,
    to_keys,
)
from support import GOLDEN, mutate_bytes

SEEDS = [
    bytes.fromhex(json.loads(line)["payload_hex"])
    for path in sorted(GOLDEN.glob("kv_events_vllm-*.jsonl"))
    for line in path.read_text().splitlines()
    if json.loads(line)["kind"] == "pub"
]
_PROBE = msgspec.msgpack.Encoder()


def _check(payload: bytes) -> bool:
    """Decode; True when it decoded. Anything but EventDecodeError propagates and fails the test."""
    try:
        batch = decode_batch(payload)
    except EventDecodeError:
        return False
    assert isinstance(batch, EventBatch)
    json.dumps(to_expected_json(batch))
    known = True
    for ev in batch.events:
        if isinstance(ev, (BlockStored, BlockRemoved)):
            to_keys(ev.block_hashes)
        known = known and not isinstance(ev, UnknownEvent)
    if known:
        again = decode_batch(encode_batch(batch, "0.33.0"))
        assert _PROBE.encode(again) == _PROBE.encode(batch)
    return True


def _mutate(rng: random.Random, data: bytes) -> bytes:
    return mutate_bytes(rng, data, SEEDS)


def _value(rng: random.Random, depth: int = 0) -> object:
    kind = rng.randrange(10 if depth < 3 else 7)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.choice([0, 1, -1, 127, 128, 2**32, 2**63 - 1, 2**64 - 1, -(2**63), rng.randrange(-(2**63), 2**64)])
    if kind == 3:
        return rng.choice([0.0, -1.5, 1e300, float("inf"), float("nan"), rng.random()])
    if kind == 4:
        return rng.choice(["", "GPU", "BlockStored", "BlockRemoved", "AllBlocksCleared", "type", "\u00e9\u6f22"])
    if kind == 5:
        return rng.randbytes(rng.choice([0, 1, 8, 16, 32]))
    if kind == 6:
        return rng.randrange(256)
    if kind in (7, 8):
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    keys = ["type", "block_hashes", "medium", "x", "1"]
    return {rng.choice(keys): _value(rng, depth + 1) for _ in range(rng.randint(0, 4))}


def _field_value(rng: random.Random, name: str) -> object:
    """Mostly plausible values for a field, sometimes the wrong type."""
    if rng.random() < 0.15:
        return _value(rng, 2)
    if name == "block_hashes":
        return [rng.choice([rng.randrange(2**64), rng.randbytes(32)]) for _ in range(rng.randint(0, 3))]
    if name == "token_ids":
        return [rng.randrange(152_000) for _ in range(rng.randint(0, 32))]
    if name in ("block_size", "group_idx", "lora_id", "kv_cache_spec_sliding_window"):
        return rng.choice([None, 0, 16, 7])
    if name == "parent_block_hash":
        return rng.choice([None, rng.randrange(2**64), rng.randbytes(32)])
    return rng.choice([None, "GPU", "CPU", [["a", 1]], "x"])


def _event(rng: random.Random) -> object:
    tag = rng.choice(["BlockStored", "BlockRemoved", "AllBlocksCleared", "BlockMoved", 5, None])
    fields = STORED_FIELDS if tag == "BlockStored" else REMOVED_FIELDS if tag == "BlockRemoved" else ()
    n = rng.randint(0, len(fields) + 2)
    names = list(fields[:n])
    if rng.random() < 0.5:
        ev: dict = {"type": tag}
        for name in names:
            if rng.random() < 0.9:
                ev[name] = _field_value(rng, name)
        if rng.random() < 0.2:
            ev["from_the_future"] = _value(rng, 1)
        return ev
    return [tag, *(_field_value(rng, name) for name in names)]


def _batch(rng: random.Random) -> bytes:
    events = [_event(rng) for _ in range(rng.randint(0, 4))]
    head = [rng.choice([1717171717.5, 0, "ts", None]), events, rng.choice([0, 1, None, "r"])]
    tail = [_value(rng, 2)] if rng.random() < 0.1 else []
    return msgspec.msgpack.encode(head[: rng.choice([1, 2, 3, 3, 3])] + tail)


def test_100k_random_and_mutated_payloads_raise_only_event_decode_error():
    rng = random.Random(20240531)
    decoded = failed = 0
    for i in range(100_000):
        r = i % 10
        if r < 5:
            payload = _mutate(rng, rng.choice(SEEDS))
        elif r < 8:
            payload = _batch(rng)
        elif r < 9:
            payload = msgspec.msgpack.encode(_value(rng))
        else:
            payload = rng.randbytes(rng.randint(0, 64))
        if _check(payload):
            decoded += 1
        else:
            failed += 1
    assert decoded > 5_000 and failed > 5_000, (decoded, failed)


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=12)
    | st.binary(max_size=33) | st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "GPU"]),
    lambda children: st.lists(children, max_size=6) | st.dictionaries(st.text(max_size=14), children, max_size=6),
    max_leaves=20,
)


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    ts=msgpack_values,
    events=st.lists(msgpack_values, max_size=5),
    rank=msgpack_values,
    tail=st.lists(msgpack_values, max_size=2),
)
def test_hypothesis_batches_of_arbitrary_structures_raise_only_event_decode_error(ts, events, rank, tail):
    _check(msgspec.msgpack.encode([ts, events, rank, *tail]))


@settings(max_examples=500, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.binary(max_size=200))
def test_hypothesis_raw_bytes_raise_only_event_decode_error(data):
    _check(data)
