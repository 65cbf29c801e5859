"""KV-event decoding speed: ``indexer.events.decode_batch`` vs a naive generic decoder, same run.

Workload: every event batch a real vLLM ``KVCacheManager`` produced in the golden
block-manager traces (prefill BlockStored with token ids, decode-step stores, heavy
eviction BlockRemoved), once in the map encoding of 0.33 and once in the positional
encoding of 0.22, plus the index keys of every event's hashes (what the subscriber
does next).

The naive baseline is what one writes without typed structs: ``msgpack.unpackb`` to
generic Python objects, then a walk that names each event's fields (positional or
by key), fills in omitted ones and normalises hashes, yielding the same information.
Prints the median events/s and blocks/s of each and the ratio.

    .venv/bin/python benchmarks/bench_events.py [--reps 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import msgpack

from indexer.events import REMOVED_FIELDS, STORED_FIELDS, BlockRemoved, BlockStored, decode_batch, to_key, to_keys

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO / "tests" / "fixtures" / "golden"


def load_payloads(version: str) -> list[bytes]:
    path = GOLDEN / f"blockmanager_trace_vllm-{version}.jsonl"
    out = []
    for line in path.read_text().splitlines():
        d = json.loads(line)
        if d["kind"] == "events":
            out.append(bytes.fromhex(d["payload_hex"]))
    return out


def fast(payloads: list[bytes]) -> tuple[int, int]:
    n_events = n_blocks = 0
    for p in payloads:
        for ev in decode_batch(p).events:
            n_events += 1
            if isinstance(ev, (BlockStored, BlockRemoved)):
                n_blocks += len(to_keys(ev.block_hashes))
    return n_events, n_blocks


def naive(payloads: list[bytes]) -> tuple[int, int]:
    fields = {"BlockStored": STORED_FIELDS, "BlockRemoved": REMOVED_FIELDS, "AllBlocksCleared": ()}
    n_events = n_blocks = 0
    for p in payloads:
        raw = msgpack.unpackb(p, raw=False, strict_map_key=False)
        batch = {"ts": float(raw[0]), "data_parallel_rank": raw[2] if len(raw) > 2 else None, "events": []}
        for item in raw[1]:
            if isinstance(item, dict):
                tag = item["type"]
                ev = {"type": tag, **{f: item.get(f) for f in fields[tag]}}
            else:
                tag = item[0]
                names = fields[tag]
                ev = {"type": tag, **{f: (item[i + 1] if i + 1 < len(item) else None) for i, f in enumerate(names)}}
            if "block_hashes" in ev:
                ev["keys"] = [to_key(h) for h in ev["block_hashes"]]
                n_blocks += len(ev["keys"])
            batch["events"].append(ev)
            n_events += 1
    return n_events, n_blocks


def median_s(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    print(f"{'encoding':<22} {'batches':>7} {'events':>7} {'blocks':>7} "
          f"{'fast ev/s':>11} {'naive ev/s':>11} {'fast blk/s':>11} {'ratio':>6}")
    for version, label in (("0.33.0", "map (0.33)"), ("0.22.0", "positional (0.22)")):
        payloads = load_payloads(version)
        n_events, n_blocks = fast(payloads)
        assert naive(payloads) == (n_events, n_blocks)
        t_fast = median_s(lambda: fast(payloads), args.reps)
        t_naive = median_s(lambda: naive(payloads), args.reps)
        print(f"{label:<22} {len(payloads):>7} {n_events:>7} {n_blocks:>7} "
              f"{n_events / t_fast:>11,.0f} {n_events / t_naive:>11,.0f} {n_blocks / t_fast:>11,.0f} "
              f"{t_naive / t_fast:>5.1f}x")


if __name__ == "__main__":
    main()
