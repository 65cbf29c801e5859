"""Block hashes of recently seen prompt prefixes, so a re-sent history is not re-hashed.

Most traffic re-sends a long shared prefix (multi-turn chat, system prompts), and vLLM's
block hash (SHA-256 over a pickled tuple, ~2 µs per block here) of an 8k-token history
costs about a millisecond per request. This cache works on *chunks* of
:data:`CHUNK_BLOCKS` blocks: chunk ``j`` gets the chained key ``k_j = xxh3_128(token
bytes of the chunk, seed=k_{j-1} mod 2^64)``, seeded by the request's extra-key
context (LoRA adapter, cache_salt), and maps to the vLLM digests of its blocks. A
request walks its chunk keys from the start, takes the digests of its longest cached
run of chunks, and hashes only the rest with :meth:`BlockHasher.hash_blocks`,
continuing from the last cached digest (the tail that does not fill a chunk is always
hashed: at most ``CHUNK_BLOCKS - 1`` blocks). Chunks keep the Python loop ~16 times
shorter than per-block keys.

Invariant: ``HashCache(h).hash_int64(ids, ...) == h.hash_blocks_int64(ids, ...)`` for
every input (the tests compare the two on shared-prefix, LoRA and salted prompts).
``k_j`` identifies the whole prefix up to chunk ``j`` (it chains every earlier chunk
and the context), so a hit can only return the digests vLLM computes for that prefix,
barring a 128-bit xxh3 collision. Multimodal requests bypass the cache.

Bounded FIFO: past ``max_blocks`` cached blocks the oldest chunks are dropped (hits do not refresh
them; re-inserting after eviction is one hash, and FIFO needs no per-hit bookkeeping).
the tuning's ``hash_cache_blocks`` (router/tuning.py) sets the bound; ``kvrouter_hash_cache_blocks`` shows the fill.

Memory: each chunk is one ``bytes`` (its last digest, then its 16 keys packed as native
``uint64``) under its 128-bit key, about 290 bytes, so ~18 bytes per block and ~9 MB at
the default 500,000 blocks (tests/test_router_hash_cache.py measures it). Chunks used to
be a tuple of the digest and a list of 16 Python ints, ~1 KB each: the 1-hour soak saw
the router grow ~21 MB/hour while the cache filled, which at its traffic takes longer
than the hour (``kvrouter chaos --soak`` now samples the fill). Unpacking a hit's keys
costs ~0.2 µs per chunk more than reading a list (16 ints are made), ~7 µs for an
8k-token prompt, against ~2 µs for each block hashed.
"""

from __future__ import annotations

import struct
import threading
from array import array
from typing import Any

import xxhash
from prometheus_client import Gauge

from indexer.hashing import BlockHasher

_MASK64 = (1 << 64) - 1


CHUNK_BLOCKS = 16
KEY_BYTES = 8 * CHUNK_BLOCKS
"""The packed keys at the end of a chunk's value (``array("Q")`` bytes)."""
_UNPACK_KEYS = struct.Struct(f"={CHUNK_BLOCKS}Q").unpack_from
DEFAULT_MAX_BLOCKS = 500_000

BLOCKS = Gauge(
    "kvrouter_hash_cache_blocks",
    "Blocks whose hashes the prefix hash cache holds (bounded by the tuning's hash_cache_blocks)",
    ["model"],
    multiprocess_mode="livesum",
)


class HashCache:
    def __init__(self, hasher: BlockHasher, max_blocks: int = DEFAULT_MAX_BLOCKS, model: str | None = None) -> None:
        self.hasher = hasher
        self.max_chunks = max(1, max_blocks // CHUNK_BLOCKS)
        self._chunks: dict[int, bytes] = {}
        """chunk key -> digest of the chunk's last block + the chunk's 64-bit block keys (native uint64)"""
        self._gauge = BLOCKS.labels(model) if model is not None else None
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        """Cached blocks."""
        return len(self._chunks) * CHUNK_BLOCKS

    def hash_int64(self, token_ids: list[int], *, lora: dict[str, Any] | None = None, cache_salt: str | None = None) -> list[int]:
        """vLLM's 64-bit block keys of ``token_ids`` (one per full block)."""
        bs = self.hasher.block_size
        n_blocks = len(token_ids) // bs
        n_chunks = n_blocks // CHUNK_BLOCKS
        if n_chunks == 0:
            return self.hasher.hash_blocks_int64(token_ids, lora=lora, cache_salt=cache_salt)
        try:
            raw = memoryview(array("I", token_ids[: n_chunks * CHUNK_BLOCKS * bs]).tobytes())
        except OverflowError:
            return self.hasher.hash_blocks_int64(token_ids, lora=lora, cache_salt=cache_salt)
        width = 4 * bs * CHUNK_BLOCKS
        key = xxhash.xxh3_64_intdigest(repr((lora and (lora["name"], lora["path"], lora["int_id"]), cache_salt)).encode())
        chain: list[int] = []
        out: list[int] = []
        chunks = self._chunks
        parent: bytes | None = None
        cached = 0
        for j in range(n_chunks):
            key = xxhash.xxh3_128_intdigest(raw[j * width : (j + 1) * width], seed=key & _MASK64)
            chain.append(key)
            if cached == j:
                hit = chunks.get(key)
                if hit is not None:
                    parent = hit[:-KEY_BYTES]
                    out += _UNPACK_KEYS(hit, len(hit) - KEY_BYTES)
                    cached += 1
        start = cached * CHUNK_BLOCKS
        self.hits += start
        if start == n_blocks:
            return out
        self.misses += n_blocks - start
        rest = self.hasher.hash_blocks(
            token_ids[start * bs : n_blocks * bs], parent=parent, start_block=start, lora=lora, cache_salt=cache_salt
        )
        keys = [int.from_bytes(d[-8:], "big") for d in rest]
        out += keys
        with self._lock:
            for j in range(cached, n_chunks):
                lo = (j - cached) * CHUNK_BLOCKS
                chunks[chain[j]] = rest[lo + CHUNK_BLOCKS - 1] + array("Q", keys[lo : lo + CHUNK_BLOCKS]).tobytes()
            while len(chunks) > self.max_chunks:
                del chunks[next(iter(chunks))]
            if self._gauge is not None:
                self._gauge.set(len(chunks) * CHUNK_BLOCKS)
        return out
