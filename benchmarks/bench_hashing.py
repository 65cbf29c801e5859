"""Block hashing speed: ``BlockHasher.hash_blocks`` vs the naive per-block reference, same run.

Workload: one prompt of ``--tokens`` random token ids (default 8192, Qwen3's id range),
block size 16, PYTHONHASHSEED "0", vLLM 0.33, no extra keys; plus one LoRA + cache_salt
row for sha256_cbor (the tagged extra keys go through cbor2 once per distinct tuple).

The naive baseline is vLLM's own loop: for each block,
``hash_fn(serialize((parent, tuple(tokens), extra)))`` with ``pickle.dumps`` or
``cbor2.dumps(canonical=True)``, and the first block is also checked against
``_reference_hash_block``. For the pickle algorithms a
third column times a hand-emitted pickle (numpy-encoded opcodes, the trick the CBOR path
uses), which is why ``hash_blocks`` keeps calling ``pickle.dumps`` there.

All variants run interleaved ``--reps`` times; the table shows medians of CPU time per
block (``time.process_time``, so that other processes on a shared machine inflate the
numbers less than wall time would) and the speed-up over naive. Every variant is checked
to produce the same digests first.

    .venv/bin/python benchmarks/bench_hashing.py [--tokens 8192] [--reps 15]
"""

from __future__ import annotations

import argparse
import hashlib
import pickle
import random
import statistics
import time
from collections.abc import Callable

import cbor2
import numpy as np
import xxhash
from rich.console import Console
from rich.table import Table

from indexer.hashing import ALGOS, BlockHasher, _reference_hash_block

BLOCK_SIZE = 16
LORA = {"name": "sql-adapter", "path": "/adapters/sql", "int_id": 7}


def naive_chain(
    algo: str, none_hash: bytes, tokens: list[int], extra_first: tuple | None, extra_rest: tuple | None
) -> list[bytes]:
    """vLLM's loop as vLLM writes it: ``hash_fn((parent, tuple(tokens), extra))`` per block."""
    if algo.endswith("_cbor"):
        def serialize(obj: object) -> bytes:
            return cbor2.dumps(obj, canonical=True)
    else:
        def serialize(obj: object) -> bytes:
            return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    new = hashlib.sha256 if algo.startswith("sha256") else xxhash.xxh3_128
    parent, out = none_hash, []
    for i in range(len(tokens) // BLOCK_SIZE):
        extra = extra_first if i == 0 else extra_rest
        parent = new(serialize((parent, tuple(tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]), extra))).digest()
        out.append(parent)
    return out


_PK_BOUNDS = np.array([256, 65536], dtype=np.int64)
_PK_WIDTH = np.array([2, 3, 5], dtype=np.int64)
_PK_OPCODE = np.array([ord("K"), ord("M"), ord("J")], dtype=np.int64)  # BININT1, BININT2, BININT


def hand_pickle_chain(hasher: BlockHasher, tokens: list[int]) -> list[bytes]:
    """Protocol-5 pickle of ``(parent, tuple(tokens), None)`` emitted by hand (ids < 2**31, 32-byte parent)."""
    ints = np.fromiter(tokens, dtype=np.int64, count=len(tokens))
    cls = np.searchsorted(_PK_BOUNDS, ints, side="right")
    width = _PK_WIDTH[cls]
    rows = ((ints << 8) + _PK_OPCODE[cls]).astype("<u8").view(np.uint8)
    ends = np.cumsum(width)
    data = rows[np.arange(int(ends[-1])) + np.repeat(np.arange(0, 8 * ints.size, 8) - (ends - width), width)].tobytes()
    block_ends = ends[BLOCK_SIZE - 1 :: BLOCK_SIZE]
    frame_sizes = (np.diff(block_ends, prepend=0) + 10 + len(hasher.none_hash)).astype("<u8").tobytes()
    head = b"C" + bytes((len(hasher.none_hash),))
    parent, out, start, new = hasher.none_hash, [], 0, hasher._new
    for i, end in enumerate(block_ends.tolist()):
        frame = frame_sizes[8 * i : 8 * i + 8]
        message = (b"\x80\x05\x95", frame, head, parent, b"\x94(", data[start:end], b"t\x94N\x87\x94.")
        parent = new(b"".join(message)).digest()
        out.append(parent)
        start = end
    return out


def cpu_us_per_block(fn: Callable[[], list[bytes]], n_blocks: int, samples: list[float]) -> None:
    t0 = time.process_time()
    fn()
    samples.append((time.process_time() - t0) / n_blocks * 1e6)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    rng = random.Random(0)
    tokens = [rng.randrange(151_000) for _ in range(args.tokens)]
    n_blocks = len(tokens) // BLOCK_SIZE

    cases = [(algo, None, None) for algo in ALGOS] + [("sha256_cbor", LORA, "tenant-0")]
    table = Table(title=f"block hashing, {len(tokens)} tokens = {n_blocks} blocks of {BLOCK_SIZE}, "
                        f"median CPU µs/block of {args.reps} interleaved runs")
    table.add_column("algorithm")
    table.add_column("extra keys")
    for col in ("hash_blocks", "naive", "speed-up", "hand pickle"):
        table.add_column(col, justify="right")

    for algo, lora, salt in cases:
        hasher = BlockHasher(algo, BLOCK_SIZE, "0", "0.33.0")
        d = hasher.dialect
        extra_rest = (d.lora_extra_key(lora),) if lora else None
        extra_first = (*(extra_rest or ()), d.salt_extra_key(salt)) if salt else extra_rest
        variants: dict[str, Callable[[], list[bytes]]] = {
            "fast": lambda: hasher.hash_blocks(tokens, lora=lora, cache_salt=salt),
            "naive": lambda: naive_chain(algo, hasher.none_hash, tokens, extra_first, extra_rest),
        }
        if not algo.endswith("_cbor"):
            variants["hand pickle"] = lambda: hand_pickle_chain(hasher, tokens)
        want = variants["naive"]()
        if want[0] != _reference_hash_block(algo, hasher.none_hash, tokens[:BLOCK_SIZE], extra_first):
            raise SystemExit(f"{algo}: the naive loop disagrees with the reference")
        for name, fn in variants.items():
            if fn() != want:
                raise SystemExit(f"{algo}: {name} disagrees with the reference")
        samples: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.reps):
            for name, fn in variants.items():
                cpu_us_per_block(fn, n_blocks, samples[name])
        med = {name: statistics.median(s) for name, s in samples.items()}
        hand = f"{med['hand pickle']:.3f}" if "hand pickle" in med else "-"
        table.add_row(algo, "LoRA + cache_salt" if lora else "none", f"{med['fast']:.3f}", f"{med['naive']:.3f}",
                      f"{med['naive'] / med['fast']:.2f}x", hand)
    Console().print(table)


if __name__ == "__main__":
    main()
