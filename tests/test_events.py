"""indexer.events against the golden captures made by real vLLM 0.11-0.33, and the CLI."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from indexer.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventDecodeError,
    UnknownEvent,
    build_pub_frames,
    build_replay_end,
    build_replay_reply,
    build_replay_request,
    decode_batch,
    encode_batch,
    parse_pub_frames,
    parse_replay_reply,
    parse_replay_request,
    schema_for,
    to_expected_json,
    to_key,
    to_keys,
)
from indexer.events_cli import infer_array_version
from support import GOLDEN, KVROUTER, REPO, free_port

EVENT_FILES = sorted(GOLDEN.glob("kv_events_vllm-*.jsonl"))
TRACE_FILES = sorted(GOLDEN.glob("blockmanager_trace_vllm-*.jsonl"))
HASH_FILES = sorted(GOLDEN.glob("hash_vectors_vllm-*.jsonl"))


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


PUB_LINES = [d for f in EVENT_FILES for d in _lines(f) if d["kind"] == "pub"]
REPLAY_LINES = [d for f in EVENT_FILES for d in _lines(f) if d["kind"] == "replay"]
SCHEMA_LINES = [d for f in EVENT_FILES for d in _lines(f) if d["kind"] == "schema"]


def _pub_id(d: dict) -> str:
    return f"{d['vllm_version']}-{d['publisher']}-{d['label']}"


def _golden(version: str, label: str) -> dict:
    return next(d for d in PUB_LINES if d["vllm_version"] == version and d["label"] == label)


def test_golden_captures_cover_every_version():
    assert {d["vllm_version"] for d in PUB_LINES} == {"0.11.0", "0.14.0", "0.22.0", "0.28.0", "0.33.0"}
    assert len(PUB_LINES) == 53 and len(REPLAY_LINES) == 5 and len(SCHEMA_LINES) == 5


@pytest.mark.parametrize("line", PUB_LINES, ids=_pub_id)
def test_decode_renders_golden_expected(line):
    batch = decode_batch(bytes.fromhex(line["payload_hex"]))
    assert to_expected_json(batch, line["vllm_version"]) == line["expected"]


@pytest.mark.parametrize("line", PUB_LINES, ids=_pub_id)
def test_encode_is_byte_identical_to_vllm_publisher(line):
    payload = bytes.fromhex(line["payload_hex"])
    assert encode_batch(decode_batch(payload), line["vllm_version"]) == payload


@pytest.mark.parametrize("schema", SCHEMA_LINES, ids=lambda d: d["vllm_version"])
def test_schema_for_matches_captured_struct_layout(schema):
    s = schema_for(schema["vllm_version"])
    assert list(s.stored_fields) == schema["BlockStored_fields"]
    assert list(s.removed_fields) == schema["BlockRemoved_fields"]
    assert s.array_like == schema["event_array_like"]


def test_newest_fields_default_to_none_when_old_engine_omits_them():
    batch = decode_batch(bytes.fromhex(_golden("0.11.0", "stored_int_noparent")["payload_hex"]))
    (ev,) = batch.events
    assert type(ev) is BlockStored
    assert ev.lora_name is None and ev.extra_keys is None and ev.lookahead_token_ids is None
    assert ev.block_hashes == [1311768467294899695, 2**64 - 1]


def test_array_and_map_payloads_of_the_same_batch_decode_equal():
    for label in ("stored_int_noparent", "stored_bytes_parent", "all_cleared", "empty_events"):
        old = decode_batch(bytes.fromhex(_golden("0.11.0", label)["payload_hex"]))
        new = decode_batch(bytes.fromhex(_golden("0.33.0", label)["payload_hex"]))
        assert old == new, label


def test_encoding_for_another_version_reproduces_that_versions_capture():
    for label in ("stored_int_noparent", "stored_bytes_parent", "all_cleared", "empty_events", "dp1_stored"):
        old = decode_batch(bytes.fromhex(_golden("0.11.0", label)["payload_hex"]))
        for version in ("0.14.0", "0.28.0", "0.33.0"):
            assert encode_batch(old, version).hex() == _golden(version, label)["payload_hex"], (label, version)


def test_every_block_manager_trace_batch_decodes_and_reencodes_exactly():
    n = 0
    for path in TRACE_FILES:
        lines = _lines(path)
        version = lines[0]["vllm_version"]
        for d in lines:
            if d["kind"] != "events":
                continue
            payload = bytes.fromhex(d["payload_hex"])
            batch = decode_batch(payload)
            summary = [[type(e).__name__, len(getattr(e, "block_hashes", ()))] for e in batch.events]
            assert summary == d["summary"], (path.name, d["seq"])
            assert encode_batch(batch, version) == payload, (path.name, d["seq"])
            n += 1
    assert n > 5000


def test_bytes_and_int_hash_forms_meet_on_the_same_key():
    n = 0
    for path in HASH_FILES:
        for d in _lines(path):
            digests = [bytes.fromhex(h) for h in d["block_hashes_hex"]]
            assert [to_key(h) for h in digests] == d["block_hashes_int64"]
            assert to_keys(digests) == d["block_hashes_int64"]
            assert to_keys(d["block_hashes_int64"]) == d["block_hashes_int64"]
            n += len(digests)
    assert n > 1000


def test_to_key_masks_signed_ints_onto_unsigned_keys():
    assert to_key(-1) == 2**64 - 1
    assert to_keys([1, -2, b"\x00" * 24 + b"\x00\x00\x00\x00\x00\x00\x01\x00"]) == [1, 2**64 - 2, 256]
    assert to_keys([2**64 + 5]) == [5]
    plain = [0, 5, 2**64 - 1]
    assert to_keys(plain) is plain


def _batch_payload(events: list, rank: object = 0, extra: tuple = ()) -> bytes:
    return msgspec.msgpack.encode([1.5, events, rank, *extra] if rank is not None else [1.5, events])


def test_unknown_map_keys_and_extra_array_fields_are_ignored():
    stored_map = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [1, 2],
                  "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None, "future_field": {"x": 1}}
    batch = decode_batch(_batch_payload([stored_map], extra=("future batch field",)))
    assert batch.events[0].block_hashes == [1]
    stored_array = ["BlockStored", [1], None, [1, 2], 2, None, "GPU"] + [None] * 8 + ["future", 42]
    removed_array = ["BlockRemoved", [1], "CPU", None, None, None, "future"]
    batch = decode_batch(_batch_payload([stored_array, removed_array]))
    assert batch.events[1] == BlockRemoved(block_hashes=[1], medium="CPU")


def test_rank_may_be_omitted():
    batch = decode_batch(_batch_payload([["AllBlocksCleared"]], rank=None))
    assert batch == EventBatch(1.5, [AllBlocksCleared()], None)


def test_positional_events_decode_whatever_the_batch_header_looks_like():
    stored = ["BlockStored", [3], None, list(range(16)), 16, None, "GPU"]
    many = [["BlockRemoved", [i], "GPU"] for i in range(20)]
    for payload in (msgspec.msgpack.encode([7, [stored], 0]), msgspec.msgpack.encode([7.0, many + [stored]])):
        batch = decode_batch(payload)
        assert batch.events[-1] == BlockStored([3], None, list(range(16)), 16, None, "GPU")


def test_unknown_event_type_is_kept_and_others_still_decode():
    events = [
        {"type": "BlockMoved", "block_hashes": [1]},
        {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"},
    ]
    batch = decode_batch(_batch_payload(events))
    assert batch.events == [UnknownEvent("BlockMoved"), BlockRemoved(block_hashes=[7], medium="GPU")]
    assert to_expected_json(batch)["events"][0] == {"type": "BlockMoved"}
    with pytest.raises(ValueError):
        encode_batch(batch, "0.33.0")


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",
        b"not msgpack at all",
        msgspec.msgpack.encode({"ts": 1.0}),
        msgspec.msgpack.encode(["ts", [], 0]),
        msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": ["x"]}], 0]),
        msgspec.msgpack.encode([1.0, [["BlockRemoved"]], 0]),
        msgspec.msgpack.encode([1.0, [{"block_hashes": [1], "medium": "GPU"}], 0]),
        bytes.fromhex(PUB_LINES[0]["payload_hex"])[:-3],
    ],
    ids=["empty", "reserved-byte", "text", "map-batch", "bad-ts", "bad-hash", "short-array", "no-tag", "truncated"],
)
def test_malformed_payload_raises_event_decode_error(payload):
    with pytest.raises(EventDecodeError):
        decode_batch(payload)


def test_schema_for_parses_versions_and_switch_points():
    assert schema_for("0.22.1").array_like and not schema_for("0.22.1").replay_topic_frame
    assert not schema_for("0.24.0").array_like and not schema_for("0.24.0").replay_topic_frame
    assert schema_for("0.26.0").replay_topic_frame
    assert schema_for("v0.33.0").anchor == "0.33" and schema_for("0.40.0").anchor == "0.33"
    assert schema_for("0.13.0").stored_fields == schema_for("0.11.0").stored_fields
    with pytest.raises(ValueError):
        schema_for("latest")


# -- every field of every version (issue 13) ---------------------------------------------

# The fields each vLLM release added to its event structs, read off every minor release's
# vllm/distributed/kv_events.py from 0.11 to 0.32 (0.33 from its golden capture); a
# release has every field added at or before it, in this order. Kept apart from
# indexer.events so the two are checked against each other, not against themselves.
_ADDED: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "0.11": (("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"),
             ("block_hashes", "medium")),
    "0.14": (("lora_name",), ()),
    "0.17": (("extra_keys",), ()),
    "0.20": (("group_idx",), ("group_idx",)),
    "0.22": (("kv_cache_spec_kind", "kv_cache_spec_sliding_window"), ()),
    "0.26": (("locality",), ("locality",)),
    "0.29": (("ownership",), ("ownership",)),
    "0.30": (("session_id",), ()),
    "0.33": (("lookahead_token_ids",), ()),
}
_TESTED_VERSIONS = ("0.11", "0.14", "0.17", "0.20", "0.22", "0.26", "0.28", "0.29", "0.30", "0.33")
_FULL_STORED = {
    "block_hashes": [2**63, 42], "parent_block_hash": 16045690984503098046, "token_ids": list(range(32)),
    "block_size": 16, "lora_id": 7, "medium": "CPU", "lora_name": "sql-adapter",
    "extra_keys": [["sql-adapter", ["img-hash-aaaa", 5], "tenant-a"], ["sql-adapter"]], "group_idx": 1,
    "kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 4096, "locality": "LOCAL",
    "ownership": "OWNED", "session_id": "sess-1", "lookahead_token_ids": [[5], [6]],
}
_FULL_REMOVED = {"block_hashes": [2**63, 42], "medium": "CPU", "group_idx": 1, "locality": "LOCAL",
                 "ownership": "OWNED"}


def _vllm_fields(version: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``version``'s BlockStored and BlockRemoved fields, from :data:`_ADDED`."""
    ver = tuple(int(x) for x in version.split(".")[:2])
    stored: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    for since, (s_added, r_added) in _ADDED.items():
        if tuple(int(x) for x in since.split(".")) <= ver:
            stored, removed = stored + s_added, removed + r_added
    return stored, removed


@pytest.mark.parametrize("version", [f"0.{minor}.0" for minor in range(11, 34)])
def test_schema_for_has_exactly_the_fields_each_vllm_release_sends(version):
    stored, removed = _vllm_fields(version)
    schema = schema_for(version)
    assert (schema.stored_fields, schema.removed_fields) == (stored, removed)


@pytest.mark.parametrize("version", _TESTED_VERSIONS)
def test_every_field_a_version_sends_survives_encode_decode_and_rendering(version):
    stored, removed = _vllm_fields(version)
    batch = EventBatch(1.5, [BlockStored(**_FULL_STORED), BlockRemoved(**_FULL_REMOVED), AllBlocksCleared()], 0)
    decoded = decode_batch(encode_batch(batch, version))
    ev_stored, ev_removed, _ = decoded.events
    for ev, full, fields in ((ev_stored, _FULL_STORED, stored), (ev_removed, _FULL_REMOVED, removed)):
        assert {f: getattr(ev, f) for f in full} == {f: (v if f in fields else None) for f, v in full.items()}
    rendered = to_expected_json(decoded, version)["events"]
    assert rendered[0] == {"type": "BlockStored", **{f: _FULL_STORED[f] for f in stored}}
    assert rendered[1] == {"type": "BlockRemoved", **{f: _FULL_REMOVED[f] for f in removed}}
    assert rendered[2] == {"type": "AllBlocksCleared"}
    if "lora_name" in stored:
        assert ev_stored.lora_name == rendered[0]["lora_name"] == "sql-adapter"


def _wire_event(tag: str, full: dict, fields: tuple[str, ...], positional: bool) -> list | dict:
    """An event laid out as vLLM sends it: ``[tag, *fields]`` up to 0.23, a map after."""
    if positional:
        return [tag, *(full[f] for f in fields)]
    return {"type": tag, **{f: full[f] for f in fields}}


@pytest.mark.parametrize("version", _TESTED_VERSIONS)
def test_hand_built_wire_payload_of_each_version_decodes_every_field(version):
    stored, removed = _vllm_fields(version)
    positional = tuple(int(x) for x in version.split(".")) <= (0, 23)
    payload = msgspec.msgpack.encode([1.5, [_wire_event("BlockStored", _FULL_STORED, stored, positional),
                                            _wire_event("BlockRemoved", _FULL_REMOVED, removed, positional)], 0])
    ev_stored, ev_removed = decode_batch(payload).events
    assert {f: getattr(ev_stored, f) for f in stored} == {f: _FULL_STORED[f] for f in stored}
    assert {f: getattr(ev_removed, f) for f in removed} == {f: _FULL_REMOVED[f] for f in removed}
    assert ev_stored.lora_name == ("sql-adapter" if "lora_name" in stored else None)
    assert encode_batch(decode_batch(payload), version) == payload


@pytest.mark.parametrize("version", ["0.17", "0.20", "0.22"])
def test_cli_infers_positional_layouts_between_the_golden_versions(version):
    stored, removed = _vllm_fields(version)
    events = [_wire_event("BlockRemoved", _FULL_REMOVED, removed, True),
              _wire_event("BlockStored", _FULL_STORED, stored, True)]
    assert infer_array_version(msgspec.msgpack.encode([1.5, events, 0])) == version


def test_pub_frames_round_trip_and_reject_misshapen_messages():
    frames = build_pub_frames(b"kv", 258, b"\x90")
    assert frames == [b"kv", b"\x00" * 6 + b"\x01\x02", b"\x90"]
    assert parse_pub_frames(frames) == (b"kv", 258, b"\x90")
    with pytest.raises(EventDecodeError):
        parse_pub_frames([b"kv", b"\x01", b"\x90"])
    with pytest.raises(EventDecodeError):
        parse_pub_frames([b"kv", b"\x90"])


@pytest.mark.parametrize("replay", REPLAY_LINES, ids=lambda d: d["vllm_version"])
def test_replay_exchange_matches_golden_frames(replay):
    version = replay["vllm_version"]
    pubs = {d["seq"]: d for d in PUB_LINES if d["vllm_version"] == version and d["publisher"] == "A"}
    request = [bytes.fromhex(x) for x in replay["request_frames_hex"]]
    assert build_replay_request(replay["start_seq"]) == request
    assert parse_replay_request(request) == replay["start_seq"]

    replies = [[bytes.fromhex(x) for x in msg] for msg in replay["reply_frames_hex"]]
    topic = bytes.fromhex(pubs[0]["topic_hex"])
    wanted = sorted(s for s in pubs if s >= replay["start_seq"])
    built = [build_replay_reply(s, bytes.fromhex(pubs[s]["payload_hex"]), topic, version) for s in wanted]
    assert built + [build_replay_end(version)] == replies

    parsed = [parse_replay_reply(msg) for msg in replies]
    assert parsed[-1] is None
    assert parsed[:-1] == [(s, bytes.fromhex(pubs[s]["payload_hex"])) for s in wanted]


def test_malformed_replay_messages_raise_event_decode_error():
    bad = ([b"x", b"\x00" * 8, b""], [b"", b"\x00" * 8], [b"", b"\x01", b"p"], [b"", b"t", b"s", b"\x00" * 8, b"p"])
    for frames in bad:
        with pytest.raises(EventDecodeError):
            parse_replay_reply(frames)
    with pytest.raises(EventDecodeError):
        parse_replay_request([b"x", b"\x00" * 8])


# -- the CLI as a real process -----------------------------------------------------------


def _cli(*args: str, stdin: str = "", timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*KVROUTER, "events", "decode", *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)


def test_cli_jsonl_reproduces_expected_for_every_capture_line():
    stdin = "".join(
        json.dumps({"topic_hex": d["topic_hex"], "seq": d["seq"], "payload_hex": d["payload_hex"],
                    "vllm_version": d["vllm_version"]}) + "\n"
        for d in PUB_LINES
    )
    out = _cli("--jsonl", stdin=stdin)
    assert out.returncode == 0, out.stderr
    assert [json.loads(x) for x in out.stdout.splitlines()] == [d["expected"] for d in PUB_LINES]


def test_cli_jsonl_without_version_infers_array_layouts_and_uses_newest_for_maps():
    lines = [d for d in PUB_LINES if d["vllm_version"] in ("0.11.0", "0.14.0", "0.22.0", "0.33.0")]
    stdin = "".join(json.dumps({k: d[k] for k in ("topic_hex", "seq", "payload_hex")}) + "\n" for d in lines)
    out = _cli("--jsonl", stdin=stdin)
    assert [json.loads(x) for x in out.stdout.splitlines()] == [d["expected"] for d in lines]


def test_cli_jsonl_reports_bad_lines_and_goes_on():
    good = json.dumps({"topic_hex": "", "seq": 0, "payload_hex": PUB_LINES[0]["payload_hex"]})
    stdin = "\n".join(["not json", '{"seq": 1}', '{"payload_hex": "zz"}', '{"payload_hex": "93cb00"}', good]) + "\n"
    out = _cli("--jsonl", stdin=stdin)
    assert out.returncode == 0, out.stderr
    rows = [json.loads(x) for x in out.stdout.splitlines()]
    assert len(rows) == 5
    assert all(set(r) == {"error"} for r in rows[:4])
    assert rows[4]["events"][0]["block_hashes"] == [1311768467294899695, 2**64 - 1]


def test_cli_hex_prints_a_readable_table():
    out = _cli("--hex", _golden("0.33.0", "mixed")["payload_hex"])
    assert out.returncode == 0, out.stderr
    for text in ("BlockStored", "BlockRemoved", "AllBlocksCleared", "GPU", "48 tokens"):
        assert text in out.stdout
    bad = _cli("--hex", "93cb00")
    assert bad.returncode == 1 and "cannot decode" in bad.stdout


def test_cli_listen_decodes_a_live_pub_socket():
    port = free_port()
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(f"tcp://127.0.0.1:{port}")
    args = [*KVROUTER, "events", "decode", "--listen", f"tcp://127.0.0.1:{port}", "--count", "3"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        payload = bytes.fromhex(_golden("0.28.0", "stored_lora_cpu_allfields")["payload_hex"])
        deadline = time.monotonic() + 30
        seq = 0
        while proc.poll() is None and time.monotonic() < deadline:
            pub.send_multipart(build_pub_frames(b"kv@test", seq, payload if seq % 2 == 0 else b"\xc1"))
            seq += 1
            time.sleep(0.05)
        out, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        pub.close()
    assert proc.returncode == 0, err
    assert "sql-adapter" in out and "CPU" in out and "kv@test" in out
    assert "undecodable" in out


def test_cli_replay_speaks_to_a_router_socket():
    replay = next(d for d in REPLAY_LINES if d["vllm_version"] == "0.33.0")
    port = free_port()
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(f"tcp://127.0.0.1:{port}")
    seen: list[int] = []

    def serve() -> None:
        if router.poll(30_000):
            identity, *request = router.recv_multipart()
            seen.append(parse_replay_request(request))
            for msg in replay["reply_frames_hex"]:
                router.send_multipart([identity, *(bytes.fromhex(x) for x in msg)])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        out = _cli("--replay", f"tcp://127.0.0.1:{port}", "--start-seq", "5", "--timeout", "20")
    finally:
        thread.join(timeout=35)
        router.close()
    assert out.returncode == 0, out.stdout + out.stderr
    assert seen == [5]
    assert "seq 5" in out.stdout and "seq 8" in out.stdout and "end of replay" in out.stdout
