"""vLLM KV-cache events: decode any version's payload, encode exactly like a given version.

A vLLM engine publishes one msgpack payload per scheduler step on a ZMQ PUB socket: an
array ``[ts, events, data_parallel_rank]`` whose events are msgspec *tagged* structs.
The encoding of an event changed over time (``docs/vllm-facts.md`` §3):

* vLLM <= 0.23 sends each event as a positional array ``[tag, field, field, ...]`` with
  every field of that version present (nil when unset); newer fields are simply absent
  from older arrays.
* vLLM >= 0.24 sends a map ``{"type": tag, field: value, ...}`` in which optional
  fields still at their default are omitted.

:func:`decode_batch` reads both into one set of typed structs (:class:`BlockStored`,
:class:`BlockRemoved`, :class:`AllBlocksCleared`) that carry every field of the newest
known version, missing ones filled with ``None``. Keys and trailing array elements
from newer versions are ignored, and an event type this module does not know becomes
an :class:`UnknownEvent` rather than failing the whole batch. Anything malformed
raises :class:`EventDecodeError`, and nothing else, so a subscriber can count and skip.

Block hashes are kept *as sent* (``int`` by default, full digest ``bytes`` when the
engine runs with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``) so they can be printed and
re-encoded unchanged; :func:`to_key` / :func:`to_keys` turn them into the unsigned
64-bit key the index uses, which is the same for both forms.

:func:`encode_batch` is the inverse for the simulator: for a ``vllm_version`` it emits
the bytes that version's ``ZmqEventPublisher`` would send. Fields were added at 0.14,
0.17, 0.20, 0.22, 0.26, 0.29, 0.30 and 0.33 (:data:`LAYOUT_VERSIONS`); a version uses
the field set of the newest of those at or before it, so a field is neither dropped
from a version that sends it nor invented for one that does not. The encoding switches
from arrays to maps at 0.24 and the replay reply gains a topic frame at 0.26.

The framing helpers at the end build and parse the ZMQ multipart messages (PUB and the
replay DEALER/ROUTER exchange); they are pure functions so both the subscriber and the
simulator share one definition of the wire.
"""

from __future__ import annotations

import logging
import operator
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Annotated, Any, TypeAlias, Union

import msgspec

__all__ = [
    "MASK64",
    "REMOVED_FIELDS",
    "REPLAY_END_SEQ",
    "STORED_FIELDS",
    "AllBlocksCleared",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "Event",
    "EventBatch",
    "EventDecodeError",
    "LAYOUT_VERSIONS",
    "UnknownEvent",
    "WireSchema",
    "build_pub_frames",
    "build_replay_end",
    "build_replay_reply",
    "build_replay_request",
    "decode_batch",
    "encode_batch",
    "parse_pub_frames",
    "parse_replay_reply",
    "parse_replay_request",
    "schema_for",
    "to_expected_json",
    "to_key",
    "to_keys",
]

log = logging.getLogger(__name__)

MASK64 = (1 << 64) - 1
REPLAY_END_SEQ = b"\xff" * 8
"""The seq frame of the replay end marker: -1 as 8 big-endian bytes."""

BlockHash: TypeAlias = Union[int, bytes]
Medium: TypeAlias = Annotated[str, msgspec.Meta(pattern=r"\A[^\r\n]*\Z")]
"""A tier name (``GPU``, ``CPU``, a connector's): one line, as the indexes key by it
(the Redis index separates names with newlines, so a batch naming such a tier is malformed)."""


class EventDecodeError(ValueError):
    """A payload or multipart message that is not a valid vLLM KV-event message."""


# -- typed events ------------------------------------------------------------------------


class BlockStored(msgspec.Struct, tag="BlockStored", tag_field="type", gc=False):
    """Blocks that became cached, in chain order; ``parent_block_hash`` precedes the first.

    Fields are vLLM's, in its declaration order (newest version). ``lora_name`` onwards
    did not exist in every version and are ``None`` when the engine did not send them.
    ``extra_keys`` is one entry per block (``None`` for a block without keys), in the
    untagged event form; ``medium`` ``None`` means GPU on older engines.
    """

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: Medium | None
    lora_name: str | None = None
    extra_keys: Any = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: Any = None
    ownership: Any = None
    session_id: Any = None
    lookahead_token_ids: Any = None


class BlockRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type", gc=False):
    """Blocks evicted from ``medium`` (``None``: GPU on older engines)."""

    block_hashes: list[BlockHash]
    medium: Medium | None
    group_idx: int | None = None
    locality: Any = None
    ownership: Any = None


class AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type", gc=False):
    """The engine dropped its whole prefix cache (reset, sleep, pool restart)."""


class UnknownEvent(msgspec.Struct, gc=False):
    """An event whose tag this module does not know (a newer vLLM); kept so it can be counted."""

    type: str


Event: TypeAlias = Union[BlockStored, BlockRemoved, AllBlocksCleared, UnknownEvent]


class EventBatch(msgspec.Struct, array_like=True, gc=False):
    """One published payload: the events of one scheduler step, in order.

    Invariant: ``data_parallel_rank`` is the rank the engine stamped (``None`` when the
    payload omitted it); the subscriber, not the payload, decides which worker it is.
    """

    ts: float
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]
    data_parallel_rank: int | None = None


STORED_FIELDS: tuple[str, ...] = BlockStored.__struct_fields__
REMOVED_FIELDS: tuple[str, ...] = BlockRemoved.__struct_fields__


# -- hash keys ---------------------------------------------------------------------------


def to_key(block_hash: BlockHash) -> int:
    """The unsigned 64-bit index key of a hash as sent.

    vLLM's int form is ``int.from_bytes(digest, "big") & MASK64``, the low 64 bits of the
    big-endian digest, so a bytes hash maps to its last 8 bytes read big-endian and
    both forms of one block meet on the same key. Ints are masked, which also maps a
    signed 64-bit int onto its unsigned twin.
    """
    if type(block_hash) is int:
        return block_hash & MASK64
    return int.from_bytes(block_hash[-8:], "big")


def to_keys(block_hashes: list[BlockHash]) -> list[int]:
    """Index keys for a list of hashes, as :func:`to_key` maps each one.

    The common case (ints already in 0..2**64-1, as every int-hash engine sends them)
    needs no work, so the input list itself is returned: callers must not mutate the
    result. Any bytes or out-of-range int falls back to a mapped copy.
    """
    for h in block_hashes:
        if type(h) is not int or h < 0 or h > MASK64:
            return [to_key(x) for x in block_hashes]
    return block_hashes  # type: ignore[return-value]


# -- decoding ----------------------------------------------------------------------------


class _ArrayBlockStored(BlockStored, array_like=True, tag="BlockStored", gc=False):
    pass


class _ArrayBlockRemoved(BlockRemoved, array_like=True, tag="BlockRemoved", gc=False):
    pass


class _ArrayAllBlocksCleared(AllBlocksCleared, array_like=True, tag="AllBlocksCleared", gc=False):
    pass


class _ArrayEventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Union[_ArrayBlockStored, _ArrayBlockRemoved, _ArrayAllBlocksCleared]]
    data_parallel_rank: int | None = None


class _RawEventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


_MAP_DECODER = msgspec.msgpack.Decoder(EventBatch)
_ARRAY_DECODER = msgspec.msgpack.Decoder(_ArrayEventBatch)
_RAW_DECODER = msgspec.msgpack.Decoder(_RawEventBatch)
_MAP_EVENT_DECODER = msgspec.msgpack.Decoder(Union[BlockStored, BlockRemoved, AllBlocksCleared])
_ARRAY_EVENT_DECODER = msgspec.msgpack.Decoder(
    Union[_ArrayBlockStored, _ArrayBlockRemoved, _ArrayAllBlocksCleared]
)
_ANY_DECODER = msgspec.msgpack.Decoder()
_KNOWN_TAGS = frozenset({"BlockStored", "BlockRemoved", "AllBlocksCleared"})

_PUBLIC_TYPE: dict[type, type] = {
    _ArrayBlockStored: BlockStored,
    _ArrayBlockRemoved: BlockRemoved,
    _ArrayAllBlocksCleared: AllBlocksCleared,
}


def _from_array(ev: msgspec.Struct) -> Event:
    """The public struct for an array-decoded event (same fields, map-tagged class)."""
    cls = _PUBLIC_TYPE.get(type(ev))
    if cls is None:
        return ev  # type: ignore[return-value]
    return cls(*msgspec.structs.astuple(ev))


def _looks_positional(payload: bytes) -> bool:
    """Whether the first event of a batch laid out as vLLM sends it is an array.

    vLLM always sends ``fixarray(3), float64 ts, events array``, so the first event
    starts right after the events header at byte 11, 13 or 15. Any other layout says
    False; that only costs one failed attempt, as :func:`decode_batch` tries both forms.
    """
    if len(payload) < 12 or payload[1] != 0xCB:
        return False
    head = payload[10]
    if 0x90 <= head <= 0x9F:
        i = 11
    elif head == 0xDC:
        i = 13
    elif head == 0xDD:
        i = 15
    else:
        return False
    return i < len(payload) and (0x90 <= payload[i] <= 0x9F or payload[i] in (0xDC, 0xDD))


def _decode_map(payload: bytes) -> EventBatch:
    return _MAP_DECODER.decode(payload)


def _decode_array(payload: bytes) -> EventBatch:
    raw = _ARRAY_DECODER.decode(payload)
    return EventBatch(raw.ts, [_from_array(ev) for ev in raw.events], raw.data_parallel_rank)


def decode_batch(payload: bytes) -> EventBatch:
    """Decode one PUB payload (frame 3) of any vLLM version into an :class:`EventBatch`.

    Each form decodes in one msgspec call: maps (>= 0.24) straight into the public
    structs, positional arrays (<= 0.23) into array twins that are then copied into
    them. The form is guessed from the first event's first byte and the other form is
    tried if the guess fails validation. Only a batch holding an event tag neither
    form knows (or a mix of both forms) takes the slow per-event path.

    Raises :class:`EventDecodeError` for anything that is not a valid batch.
    """
    attempts = (_decode_array, _decode_map) if _looks_positional(payload) else (_decode_map, _decode_array)
    for attempt in attempts:
        try:
            return attempt(payload)
        except msgspec.ValidationError:
            continue
        except Exception as e:
            raise EventDecodeError(f"not a msgpack event batch: {e}") from None
    return _decode_per_event(payload)


def _decode_per_event(payload: bytes) -> EventBatch:
    try:
        raw = _RAW_DECODER.decode(payload)
    except Exception as e:
        raise EventDecodeError(f"not an event batch: {e}") from None
    events: list[Event] = []
    for i, item in enumerate(raw.events):
        events.append(_decode_one(bytes(item), i))
    return EventBatch(raw.ts, events, raw.data_parallel_rank)  # type: ignore[arg-type]


def _decode_one(item: bytes, index: int) -> Event:
    head = item[0] if item else 0
    is_map = 0x80 <= head <= 0x8F or head in (0xDE, 0xDF)
    try:
        generic = _ANY_DECODER.decode(item)
    except Exception as e:
        raise EventDecodeError(f"event {index}: {e}") from None
    if is_map:
        tag = generic.get("type") if isinstance(generic, dict) else None
    else:
        tag = generic[0] if isinstance(generic, list) and generic else None
    if not isinstance(tag, str):
        raise EventDecodeError(f"event {index}: no event type tag")
    if tag not in _KNOWN_TAGS:
        return UnknownEvent(tag)
    try:
        if is_map:
            return _MAP_EVENT_DECODER.decode(item)
        return _from_array(_ARRAY_EVENT_DECODER.decode(item))
    except Exception as e:
        raise EventDecodeError(f"event {index} ({tag}): {e}") from None


# -- per-version wire schema and encoding ------------------------------------------------


@dataclass(frozen=True)
class WireSchema:
    """How one vLLM version lays events out on the wire.

    ``anchor`` is the first release (one of :data:`LAYOUT_VERSIONS`) with the field
    sets this schema uses. In the map form the first ``len(required)`` fields are
    always sent (they have no default in vLLM); the rest are omitted while ``None``.
    """

    anchor: str
    stored_fields: tuple[str, ...]
    removed_fields: tuple[str, ...]
    array_like: bool
    replay_topic_frame: bool


_STORED_REQUIRED = STORED_FIELDS[:7]
_REMOVED_REQUIRED = REMOVED_FIELDS[:2]

# (first release, number of BlockStored fields, number of BlockRemoved fields): every
# release's structs are a prefix of the newest field order, and a row starts wherever a
# release added a field ("both": to BlockStored and BlockRemoved). Read off each minor
# release's kv_events.py from 0.11 to 0.32 (sampled patch releases changed nothing);
# the golden captures of 0.11, 0.14, 0.22, 0.28 and 0.33 confirm the rows they fall in.
_FIELD_SETS: tuple[tuple[tuple[int, int], int, int], ...] = (
    ((0, 11), 6, 2),
    ((0, 14), 7, 2),  # + lora_name
    ((0, 17), 8, 2),  # + extra_keys
    ((0, 20), 9, 3),  # + group_idx (both)
    ((0, 22), 11, 3),  # + kv_cache_spec_kind, kv_cache_spec_sliding_window
    ((0, 26), 12, 4),  # + locality (both)
    ((0, 29), 13, 5),  # + ownership (both)
    ((0, 30), 14, 5),  # + session_id
    ((0, 33), 15, 5),  # + lookahead_token_ids
)
LAYOUT_VERSIONS: tuple[str, ...] = tuple(f"{v[0]}.{v[1]}" for v, _, _ in _FIELD_SETS)
"""The first vLLM release of each distinct set of event fields, oldest first."""

_MAP_SINCE = (0, 24)
_REPLAY_TOPIC_SINCE = (0, 26)
_VERSION_RE = re.compile(r"^v?(\d+)\.(\d+)")


def _parse_version(vllm_version: str) -> tuple[int, int]:
    m = _VERSION_RE.match(vllm_version.strip())
    if m is None:
        raise ValueError(f"not a vLLM version: {vllm_version!r} (expected e.g. '0.22.1')")
    return int(m.group(1)), int(m.group(2))


@lru_cache(maxsize=64)
def schema_for(vllm_version: str) -> WireSchema:
    """The wire layout of ``vllm_version`` ("0.22.1", "v0.33.0", ...).

    Versions older than 0.11 use 0.11's layout and versions newer than 0.33 use 0.33's,
    with a logged warning, since neither was checked against a real engine.
    """
    ver = _parse_version(vllm_version)
    if not _FIELD_SETS[0][0] <= ver <= _FIELD_SETS[-1][0]:
        log.warning("vLLM %s is outside the verified 0.11-0.33 range; using the nearest layout", vllm_version)
    anchor, n_stored, n_removed = _FIELD_SETS[0]
    for candidate in _FIELD_SETS:
        if candidate[0] <= ver:
            anchor, n_stored, n_removed = candidate
    return WireSchema(
        anchor=f"{anchor[0]}.{anchor[1]}",
        stored_fields=STORED_FIELDS[:n_stored],
        removed_fields=REMOVED_FIELDS[:n_removed],
        array_like=ver < _MAP_SINCE,
        replay_topic_frame=ver >= _REPLAY_TOPIC_SINCE,
    )


def _wire_struct(name: str, fields: tuple[str, ...], required: tuple[str, ...], array_like: bool) -> type:
    spec = [(f, Any) if f in required else (f, Any, None) for f in fields]
    return msgspec.defstruct(
        name, spec, tag=name, tag_field="type", array_like=array_like, omit_defaults=True, gc=False
    )


class _WireBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


def _converter(wire: type, fields: tuple[str, ...]) -> Callable[[Any], msgspec.Struct]:
    if not fields:
        return lambda ev: wire()
    get = operator.attrgetter(*fields)
    if len(fields) == 1:
        return lambda ev: wire(get(ev))
    return lambda ev: wire(*get(ev))


@lru_cache(maxsize=32)
def _converters_for(schema: WireSchema) -> dict[type, Callable[[Any], msgspec.Struct]]:
    """msgspec structs shaped exactly like that version's, so msgspec emits vLLM's bytes.

    vLLM encodes with msgspec's default ``Encoder``; mirroring its struct definitions
    (field order, which fields have defaults, ``omit_defaults``, ``array_like``, the
    tag) reproduces its output, down to the map header width msgspec picks from the
    number of fields.
    """
    a = schema.array_like
    stored = _wire_struct("BlockStored", schema.stored_fields, _STORED_REQUIRED, a)
    removed = _wire_struct("BlockRemoved", schema.removed_fields, _REMOVED_REQUIRED, a)
    cleared = _wire_struct("AllBlocksCleared", (), (), a)
    return {
        BlockStored: _converter(stored, schema.stored_fields),
        BlockRemoved: _converter(removed, schema.removed_fields),
        AllBlocksCleared: _converter(cleared, ()),
    }


_MSGPACK = msgspec.msgpack.Encoder()


def encode_batch(batch: EventBatch, vllm_version: str) -> bytes:
    """The payload ``vllm_version``'s publisher sends for ``batch``, byte for byte.

    Fields that version does not have are dropped; ``ts`` is sent as float64 like
    vLLM's ``float`` field. Raises ``ValueError`` for an :class:`UnknownEvent`, which
    has no known encoding.
    """
    convert = _converters_for(schema_for(vllm_version))
    wire_events = []
    for ev in batch.events:
        fn = convert.get(type(ev))
        if fn is None:
            raise ValueError(f"cannot encode event of type {type(ev).__name__}")
        wire_events.append(fn(ev))
    return _MSGPACK.encode(_WireBatch(float(batch.ts), wire_events, batch.data_parallel_rank))


# -- named rendering ---------------------------------------------------------------------


def _jsonable(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"hex": bytes(value).hex()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return value


def to_expected_json(batch: EventBatch, vllm_version: str | None = None) -> dict[str, Any]:
    """The named rendering of ``kvrouter events decode`` (the golden ``expected`` shape).

    ``{"ts", "data_parallel_rank", "events": [{"type": tag, field: value, ...}]}``
    with bytes as ``{"hex": ...}``. Events list every field of ``vllm_version``'s
    struct (all fields of the newest version when ``None``), unsent ones as null.
    """
    if vllm_version is None:
        stored_fields, removed_fields = STORED_FIELDS, REMOVED_FIELDS
    else:
        schema = schema_for(vllm_version)
        stored_fields, removed_fields = schema.stored_fields, schema.removed_fields
    events = []
    for ev in batch.events:
        if isinstance(ev, BlockStored):
            fields = stored_fields
        elif isinstance(ev, BlockRemoved):
            fields = removed_fields
        else:
            fields = ()
        out: dict[str, Any] = {"type": ev.type if isinstance(ev, UnknownEvent) else type(ev).__name__}
        for f in fields:
            out[f] = _jsonable(getattr(ev, f))
        events.append(out)
    return {"ts": batch.ts, "data_parallel_rank": batch.data_parallel_rank, "events": events}


# -- ZMQ framing -------------------------------------------------------------------------


def _seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def _seq_of(frame: bytes, what: str) -> int:
    if len(frame) != 8:
        raise EventDecodeError(f"{what}: seq frame has {len(frame)} bytes, expected 8")
    return int.from_bytes(frame, "big")


def build_pub_frames(topic: bytes, seq: int, payload: bytes) -> list[bytes]:
    """The PUB multipart message ``[topic, seq as 8-byte big-endian, payload]``."""
    return [topic, _seq_bytes(seq), payload]


def parse_pub_frames(frames: Sequence[bytes]) -> tuple[bytes, int, bytes]:
    """``(topic, seq, payload)`` of a PUB message; :class:`EventDecodeError` if misshapen."""
    if len(frames) != 3:
        raise EventDecodeError(f"PUB message has {len(frames)} frames, expected 3")
    topic, seq, payload = (bytes(f) for f in frames)
    return topic, _seq_of(seq, "PUB message"), payload


def build_replay_request(start_seq: int) -> list[bytes]:
    """What a DEALER sends to the replay socket: ``[b"", start_seq as 8-byte big-endian]``."""
    return [b"", _seq_bytes(start_seq)]


def parse_replay_request(frames: Sequence[bytes]) -> int:
    """The start seq of a replay request as the ROUTER holds it after popping the identity.

    vLLM answers only ``[identity, b"", seq]``; anything else is refused here with
    :class:`EventDecodeError`, as vLLM ignores it.
    """
    if len(frames) != 2 or bytes(frames[0]) != b"":
        raise EventDecodeError(f"replay request must be [b'', seq], got {len(frames)} frames")
    return _seq_of(bytes(frames[1]), "replay request")


def build_replay_reply(seq: int, payload: bytes, topic: bytes, vllm_version: str) -> list[bytes]:
    """One buffered message as ``vllm_version``'s ROUTER sends it, without the identity frame.

    ``[b"", seq, payload]`` up to 0.24; ``[b"", topic, seq, payload]`` from 0.26.
    """
    if schema_for(vllm_version).replay_topic_frame:
        return [b"", topic, _seq_bytes(seq), payload]
    return [b"", _seq_bytes(seq), payload]


def build_replay_end(vllm_version: str) -> list[bytes]:
    """The end-of-replay marker (seq -1), without the identity frame."""
    if schema_for(vllm_version).replay_topic_frame:
        return [b"", b"", REPLAY_END_SEQ, b""]
    return [b"", REPLAY_END_SEQ, b""]


def parse_replay_reply(frames: Sequence[bytes]) -> tuple[int, bytes] | None:
    """``(seq, payload)`` of a replay reply as a DEALER receives it, ``None`` for the end marker.

    Accepts both framings (with and without the topic frame), so the subscriber does
    not need to know the engine's version to replay.
    """
    n = len(frames)
    if n not in (3, 4) or bytes(frames[0]) != b"":
        raise EventDecodeError(f"replay reply must be [b'', (topic,) seq, payload], got {n} frames")
    seq_frame = bytes(frames[n - 2])
    if seq_frame == REPLAY_END_SEQ:
        return None
    return _seq_of(seq_frame, "replay reply"), bytes(frames[n - 1])
