"""``kvrouter events decode``: read vLLM KV-event payloads, for machines and for operators.

``--jsonl`` is the machine contract (the README's command table): one input line
``{"topic_hex", "seq", "payload_hex"}`` in, one line in the golden ``expected`` shape
out, ``{"error": ...}`` for a line that cannot be decoded, and on to the next.

The other modes are for a person chasing an event mismatch: ``--hex`` decodes one
payload, ``--listen`` subscribes to a live engine's PUB socket and ``--replay`` asks
its replay socket for buffered batches; each batch is printed as a table.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from typing import Any, TextIO

import msgspec
from rich.console import Console
from rich.table import Table

from indexer.events import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventDecodeError,
    LAYOUT_VERSIONS,
    WireSchema,
    build_replay_request,
    decode_batch,
    parse_pub_frames,
    parse_replay_reply,
    schema_for,
    to_expected_json,
)

_ARRAY_SCHEMAS: tuple[WireSchema, ...] = tuple(
    s for s in (schema_for(v) for v in LAYOUT_VERSIONS) if s.array_like
)


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="events_command", metavar="SUBCOMMAND", required=True)
    p = sub.add_parser(
        "decode",
        help="decode KV-event payloads",
        description="Decode vLLM KV-event payloads: JSON lines for machines, tables for operators.",
    )
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument(
        "--jsonl", action="store_true", help='stdin lines {"topic_hex","seq","payload_hex"} -> JSON lines'
    )
    mode.add_argument("--hex", metavar="PAYLOAD", help="decode one msgpack payload given in hex")
    mode.add_argument(
        "--listen", metavar="ENDPOINT", help="subscribe to an engine's PUB socket, e.g. tcp://10.0.0.1:5557"
    )
    mode.add_argument("--replay", metavar="ENDPOINT", help="ask an engine's replay socket for buffered batches")
    p.add_argument(
        "--vllm-version",
        help="render the fields of this version (default: the line's vllm_version, else inferred from the payload)",
    )
    p.add_argument("--topic", default="", help="--listen: topic prefix to subscribe to (default: all)")
    p.add_argument(
        "--bind", action="store_true", help="--listen: bind ENDPOINT (for engines that connect to a collector)"
    )
    p.add_argument("--count", type=int, default=0, help="--listen: stop after N messages (default: run until Ctrl-C)")
    p.add_argument("--start-seq", type=int, default=0, help="--replay: first seq to ask for (default 0)")
    p.add_argument("--timeout", type=float, default=5.0, help="--replay: seconds to wait for each reply")


def run(args: argparse.Namespace) -> int:
    if args.vllm_version is not None:
        try:
            schema_for(args.vllm_version)
        except ValueError as e:
            print(f"kvrouter events decode: {e}", file=sys.stderr)
            return 2
    if args.jsonl:
        return decode_jsonl(sys.stdin, sys.stdout, args.vllm_version)
    console = Console()
    if args.hex is not None:
        try:
            payload = bytes.fromhex(args.hex.strip())
            batch = decode_batch(payload)
        except (ValueError, EventDecodeError) as e:
            console.print(f"[red]cannot decode payload:[/red] {e}")
            return 1
        print_batch(console, batch, seq=None, topic=None)
        return 0
    try:
        if args.listen:
            return _listen(console, args)
        return _replay(console, args)
    except KeyboardInterrupt:
        return 0


# -- JSONL contract ----------------------------------------------------------------------


def render_line(line: str, vllm_version: str | None) -> dict[str, Any]:
    """The output object for one input line: the named rendering, or ``{"error": ...}``."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        return {"error": f"not JSON: {e}"}
    if not isinstance(obj, dict) or not isinstance(obj.get("payload_hex"), str):
        return {"error": "expected an object with a payload_hex string"}
    try:
        payload = bytes.fromhex(obj["payload_hex"])
    except ValueError as e:
        return {"error": f"payload_hex is not hex: {e}"}
    try:
        batch = decode_batch(payload)
    except EventDecodeError as e:
        return {"error": str(e)}
    version = vllm_version or obj.get("vllm_version")
    if not isinstance(version, str):
        version = infer_array_version(payload)
    try:
        return to_expected_json(batch, version)
    except ValueError as e:
        return {"error": str(e)}


def decode_jsonl(stdin: TextIO, stdout: TextIO, vllm_version: str | None) -> int:
    """One output line per non-blank input line; bad lines become error objects."""
    for line in stdin:
        if not line.strip():
            continue
        stdout.write(json.dumps(render_line(line, vllm_version)) + "\n")
        stdout.flush()
    return 0


def infer_array_version(payload: bytes) -> str | None:
    """The first release of the positional layout the payload's events have, if any.

    Positional events (<= 0.23) carry every field of their version, so each event's
    length narrows the candidate layouts. A BlockStored's length names one layout, but
    a BlockRemoved's is shared by several (0.20 and 0.22 both send three fields), so the
    newest layout that every event fits is taken: it renders each event's fields alike.
    Map events do not say, and get the newest field set (``None``).
    """
    try:
        raw = msgspec.msgpack.decode(payload)
        events = raw[1]
    except Exception:
        return None
    candidates = _ARRAY_SCHEMAS
    narrowed = False
    for ev in events if isinstance(events, list) else ():
        if not isinstance(ev, list) or not ev or ev[0] not in ("BlockStored", "BlockRemoved"):
            continue
        n_fields = len(ev) - 1
        if ev[0] == "BlockStored":
            candidates = tuple(s for s in candidates if len(s.stored_fields) == n_fields)
        else:
            candidates = tuple(s for s in candidates if len(s.removed_fields) == n_fields)
        narrowed = True
    return candidates[-1].anchor if narrowed and candidates else None


# -- readable modes ----------------------------------------------------------------------


def _short(h: BlockHash | None) -> str:
    if h is None:
        return "-"
    if isinstance(h, bytes):
        return h.hex()[:16] + ("..." if len(h) > 8 else "")
    return str(h)


def print_batch(console: Console, batch: EventBatch, *, seq: int | None, topic: bytes | None) -> None:
    """One batch as a table: per event its type, number of hashes, first hash, medium, details."""
    try:
        when = datetime.fromtimestamp(batch.ts, tz=timezone.utc).isoformat(timespec="milliseconds")
    except (OverflowError, OSError, ValueError):
        when = "out of range"
    title = f"seq {seq if seq is not None else '-'}  ts {batch.ts} ({when})  rank {batch.data_parallel_rank}"
    if topic:
        title += f"  topic {topic.decode('utf-8', 'replace')}"
    table = Table(title=title, title_justify="left")
    table.add_column("#", justify="right")
    table.add_column("type", no_wrap=True)
    table.add_column("hashes", justify="right")
    table.add_column("first hash", no_wrap=True)
    table.add_column("medium")
    table.add_column("details")
    for i, ev in enumerate(batch.events):
        if isinstance(ev, BlockStored):
            lora = ev.lora_name or (str(ev.lora_id) if ev.lora_id is not None else None)
            details = f"parent {_short(ev.parent_block_hash)}, {len(ev.token_ids)} tokens, block size {ev.block_size}"
            details += f", lora {lora}" if lora else ""
            details += f", group {ev.group_idx}" if ev.group_idx is not None else ""
            row = ("BlockStored", ev.block_hashes, ev.medium, details)
        elif isinstance(ev, BlockRemoved):
            details = f"group {ev.group_idx}" if ev.group_idx is not None else ""
            row = ("BlockRemoved", ev.block_hashes, ev.medium, details)
        elif isinstance(ev, AllBlocksCleared):
            row = ("AllBlocksCleared", [], None, "")
        else:
            row = (f"{ev.type} (unknown)", [], None, "")
        name, hashes, medium, details = row
        first = _short(hashes[0]) if hashes else ""
        table.add_row(str(i), name, str(len(hashes)), first, medium or "-", details)
    if not batch.events:
        table.add_row("", "(no events)", "", "", "", "")
    console.print(table)


def _listen(console: Console, args: argparse.Namespace) -> int:
    import zmq

    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, args.topic.encode())
    (sock.bind if args.bind else sock.connect)(args.listen)
    console.print(f"{'bound' if args.bind else 'subscribed'} to {args.listen}; Ctrl-C to stop")
    seen = 0
    try:
        while not args.count or seen < args.count:
            frames = sock.recv_multipart()
            seen += 1
            try:
                topic, seq, payload = parse_pub_frames(frames)
                batch = decode_batch(payload)
            except EventDecodeError as e:
                console.print(f"[red]undecodable message ({len(frames)} frames):[/red] {e}")
                continue
            print_batch(console, batch, seq=seq, topic=topic)
    finally:
        sock.close()
    return 0


def _replay(console: Console, args: argparse.Namespace) -> int:
    import zmq

    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(args.replay)
    try:
        sock.send_multipart(build_replay_request(args.start_seq))
        while True:
            if not sock.poll(int(args.timeout * 1000)):
                console.print(f"[red]no reply from {args.replay} within {args.timeout}s[/red]")
                return 1
            frames = sock.recv_multipart()
            try:
                reply = parse_replay_reply(frames)
                if reply is None:
                    console.print("end of replay")
                    return 0
                seq, payload = reply
                batch = decode_batch(payload)
            except EventDecodeError as e:
                console.print(f"[red]undecodable reply:[/red] {e}")
                continue
            print_batch(console, batch, seq=seq, topic=None)
    finally:
        sock.close()
