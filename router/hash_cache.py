"""Block hashes of recently seen prompt prefixes, so a re-sent history is not re-hashed.

Most traffic re-sends a long shared prefix (multi-turn chat, system prompts), and vLLM's
block hash (SHA-256 over a pickled tuple, ~2 µs per block here) of an 8k-token history
costs about a millisecond per request. This cache maps a cheap chained key of each
block, ``k_i = xxh3_128(tokens of block i, seed=k_{i-1} mod 2^64)`` seeded by the
request's extra-key context (LoRA adapter, cache_salt), to the block's vLLM digest. A
request walks its keys from the start, takes the digests of its longest cached prefix,
and hashes only the rest with :meth:`BlockHasher.hash_blocks` continuing from the last
cached digest.

Invariant: ``HashCache(h).hash_int64(ids, ...) == h.hash_blocks_int64(ids, ...)`` for
every input (the tests compare the two on shared-prefix, LoRA and salted prompts).
``k_i`` identifies the whole prefix up to block ``i`` (it chains every earlier block
and the context), so a hit can only return the digest vLLM computes for that prefix,
barring a 128-bit xxh3 collision. Multimodal requests bypass the cache.

Bounded FIFO: past ``max_blocks`` entries the oldest are dropped (hits do not refresh
them; re-inserting after eviction is one hash, and FIFO needs no per-hit bookkeeping).
"""

from __future__ import annotations

import threading
from array import array
from typing import Any

import xxhash

from indexer.hashing import BlockHasher

_MASK64 = (1 << 64) - 1


class HashCache:
    def __init__(self, hasher: BlockHasher, max_blocks: int = 500_000) -> None:
        self.hasher = hasher
        self.max_blocks = max_blocks
        self._digests: dict[int, tuple[bytes, int]] = {}
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._digests)

    def hash_int64(self, token_ids: list[int], *, lora: dict[str, Any] | None = None, cache_salt: str | None = None) -> list[int]:
        """vLLM's 64-bit block keys of ``token_ids`` (one per full block)."""
        bs = self.hasher.block_size
        n_blocks = len(token_ids) // bs
        if n_blocks == 0:
            return []
        try:
            raw = array("I", token_ids[: n_blocks * bs]).tobytes()
        except OverflowError:
            return self.hasher.hash_blocks_int64(token_ids, lora=lora, cache_salt=cache_salt)
        width = 4 * bs
        seed = xxhash.xxh3_64_intdigest(repr((lora and (lora["name"], lora["path"], lora["int_id"]), cache_salt)).encode())
        chain = []
        out: list[int] = []
        digests = self._digests
        parent: bytes | None = None
        cached = 0
        key = seed
        for i in range(n_blocks):
            key = xxhash.xxh3_128_intdigest(raw[i * width : (i + 1) * width], seed=key & _MASK64)
            chain.append(key)
            if cached == i:
                hit = digests.get(key)
                if hit is not None:
                    parent = hit[0]
                    out.append(hit[1])
                    cached += 1
        self.hits += cached
        if cached == n_blocks:
            return out
        self.misses += n_blocks - cached
        rest = self.hasher.hash_blocks(
            token_ids[cached * bs : n_blocks * bs],
            parent=parent,
            start_block=cached,
            lora=lora,
            cache_salt=cache_salt,
        )
        with self._lock:
            for i, digest in enumerate(rest, start=cached):
                k64 = int.from_bytes(digest[-8:], "big")
                out.append(k64)
                digests[chain[i]] = (digest, k64)
            while len(digests) > self.max_blocks:
                del digests[next(iter(digests))]
        return out
