"""vLLM's prefix-cache block pool, rebuilt without the GPU.

Modelled on vLLM v1 ``core/block_pool.py`` and ``core/kv_cache_manager.py`` (one
full-attention KV-cache group), because routing quality depends on exactly which blocks
an engine still holds:

* The pool has ``num_blocks`` blocks; block 0 is vLLM's *null block*, taken out at start,
  so ``num_blocks - 1`` are usable (as on a real engine).
* A block is cached once it is full: its hash chains its parent's, so a hit is always a
  prefix, found by walking the request's hashes left to right and stopping at the first
  miss. The walk never covers the whole prompt: at most ``num_tokens - 1`` tokens are
  reused, so the last token is always recomputed (VLLM_FACTS §2).
* Blocks are reference counted. A block whose count drops to 0 goes to the tail of an
  LRU free queue but stays cached; a request frees its blocks tail first, so a chain's
  tail is evicted before its head. Allocation pops the queue head and, if that block
  was cached, evicts it (one ``BlockRemoved`` per block, like vLLM).
* Freed blocks without a hash (a request's partial last block: it can never be hit) go
  to the *head* of the free queue instead, in freeing order, so the next allocation
  reuses them before it evicts anything (vLLM >= 0.24, ``prepend_n`` in
  ``BlockPool.free_blocks``; 0.11-0.23 append them to the tail like cached ones, see
  :func:`reuses_uncached_first`).
* Blocks are cached when they are *scheduled* (``allocate_slots``), not when computed,
  exactly as vLLM does, and that includes blocks filled by generated tokens.
* Duplicates are kept like vLLM: two requests that computed the same block at the same
  time each cache their own copy (and each emit ``BlockStored``); a lookup returns the
  first. :meth:`BlockPool.cached_hashes` is the set of distinct hashes held.

An optional CPU tier (:class:`CpuOffloadTier`) models vLLM's native KV offloading (the
``OffloadingConnector`` with its LRU CPU manager): every block cached on the GPU is
also stored there (write-through), and on admission the CPU tier continues the GPU
prefix hit; those blocks are loaded into new GPU blocks instead of being recomputed.

Events are recorded as plain records (digests as ``bytes``) and turned into a given vLLM
version's wire form by :mod:`loadtest.sim.publisher`.

There is no preemption: the scheduler (:mod:`loadtest.sim.engine`) admits a request
only when its whole lifetime fits (see :meth:`BlockManager.can_admit`), so a running
request's later allocations always succeed.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
"""The ``medium`` of each tier's events, as vLLM names them (the CPU backend's medium)."""

UNCACHED_FIRST_SINCE = (0, 24)
"""First vLLM release whose ``BlockPool.free_blocks`` puts freed blocks without a hash at
the head of the free queue (0.11-0.23 append every freed block to the tail)."""


def reuses_uncached_first(vllm_version: str) -> bool:
    """Whether ``vllm_version`` ("0.22.1", "v0.33.0") reuses freed unhashed blocks first.

    Unparseable versions count as the newest, as the hashing dialect does.
    """
    m = re.match(r"^\s*v?(\d+)\.(\d+)", str(vllm_version))
    return m is None or (int(m[1]), int(m[2])) >= UNCACHED_FIRST_SINCE


@dataclass(slots=True)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


@dataclass(slots=True)
class StoredRecord:
    """``BlockStored``: new full blocks in chain order, ``parent`` the hash before the first."""

    block_hashes: list[bytes]
    parent: bytes | None
    token_ids: list[int]
    lora_id: int | None
    lora_name: str | None
    extra_keys: list[Any]
    medium: str = MEDIUM_GPU


@dataclass(slots=True)
class RemovedRecord:
    block_hash: bytes
    medium: str = MEDIUM_GPU


@dataclass(slots=True)
class ClearedRecord:
    pass


CacheRecord = StoredRecord | RemovedRecord | ClearedRecord


@dataclass(slots=True)
class CacheRequest:
    """What the block manager needs from a request.

    Invariant: ``block_hashes[i]`` (and ``block_extra_keys[i]``, the untagged event form)
    describe block i of ``all_token_ids`` for every *full* block; the engine extends
    them as generated tokens fill blocks.
    """

    request_id: str
    all_token_ids: list[int]
    block_hashes: list[bytes] = field(default_factory=list)
    block_extra_keys: list[Any] = field(default_factory=list)
    lora_id: int | None = None
    lora_name: str | None = None


class BlockPool:
    """Blocks, the LRU free queue and the hash -> block map (vLLM's ``BlockPool``).

    ``uncached_first``: freed blocks without a hash go to the head of the free queue,
    to be reused before any cached block is evicted (vLLM >= 0.24); otherwise every
    freed block goes to the tail (0.11-0.23).
    """

    def __init__(self, num_blocks: int, uncached_first: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError("num_blocks must be at least 2 (block 0 is the null block)")
        self.num_blocks = num_blocks
        self.uncached_first = uncached_first
        self.blocks = [Block(i) for i in range(num_blocks)]
        # OrderedDict: O(1) pop of the LRU head, append at the tail and removal of a
        # touched block from the middle (vLLM uses a doubly linked list for the same).
        self.free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[bytes, dict[int, Block]] = {}
        self.null_block = self.free.popitem(last=False)[1]
        self.events: list[CacheRecord] = []

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def usage(self) -> float:
        """``vllm:kv_cache_usage_perc``: 1 - free/total, the null block excluded (vLLM's get_usage)."""
        total = self.num_blocks - 1
        return 1.0 - self.num_free_blocks / total if total else 0.0

    def get_cached_block(self, block_hash: bytes) -> Block | None:
        hit = self.cached.get(block_hash)
        return next(iter(hit.values())) if hit else None

    def cached_hashes(self) -> list[bytes]:
        return list(self.cached)

    def num_duplicates(self) -> int:
        """Extra copies of cached hashes (an index with set semantics loses these on eviction)."""
        return sum(len(copies) - 1 for copies in self.cached.values())

    def get_new_blocks(self, n: int) -> list[Block]:
        if n > len(self.free):
            raise ValueError(f"cannot get {n} free blocks from the pool ({len(self.free)} free)")
        out = []
        for _ in range(n):
            block = self.free.popitem(last=False)[1]
            self._maybe_evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _maybe_evict(self, block: Block) -> None:
        h = block.block_hash
        if h is None:
            return
        copies = self.cached.get(h)
        if copies is not None and copies.pop(block.block_id, None) is not None:
            if not copies:
                del self.cached[h]
            self.events.append(RemovedRecord(h))
        block.block_hash = None

    def touch(self, blocks: list[Block]) -> None:
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered: list[Block]) -> None:
        """Release ``ordered`` (first = evicted first) to the free queue.

        Cached blocks go to the tail (LRU). With :attr:`uncached_first`, blocks without a
        hash go to the head instead, keeping their order (the first freed becomes the
        head), as vLLM's ``prepend_n`` does; without it they go to the tail too.
        """
        free = self.free
        uncached: list[Block] = []
        for block in ordered:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None and self.uncached_first:
                    uncached.append(block)
                else:
                    free[block.block_id] = block
        for block in reversed(uncached):
            free[block.block_id] = block
            free.move_to_end(block.block_id, last=False)

    def cache_full_blocks(self, req: CacheRequest, blocks: list[Block], num_cached: int, num_full: int, block_size: int) -> None:
        if num_full <= num_cached:
            return
        parent = blocks[num_cached - 1].block_hash if num_cached else None
        new_hashes = req.block_hashes[num_cached:num_full]
        for block, h in zip(blocks[num_cached:num_full], new_hashes):
            block.block_hash = h
            self.cached.setdefault(h, {})[block.block_id] = block
        self.events.append(
            StoredRecord(
                block_hashes=list(new_hashes),
                parent=parent,
                token_ids=req.all_token_ids[num_cached * block_size : num_full * block_size],
                lora_id=req.lora_id,
                lora_name=req.lora_name,
                extra_keys=req.block_extra_keys[num_cached:num_full],
            )
        )

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash; refused (False) while any request holds blocks, like vLLM."""
        if self.num_blocks - self.num_free_blocks != 1:
            return False
        self.cached.clear()
        for block in self.blocks:
            block.block_hash = None
        self.events.append(ClearedRecord())
        return True

    def take_events(self) -> list[CacheRecord]:
        events, self.events = self.events, []
        return events


class CpuOffloadTier:
    """The CPU tier of vLLM's native KV offloading: ``num_blocks`` blocks, evicted LRU.

    Modelled on vLLM's ``LRUOffloadingManager`` over the CPU backend, as driven by the
    ``OffloadingConnector`` scheduler (offloaded block size = GPU block size):

    * :meth:`lookup` counts the leading hashes held; blocks are keyed by the GPU block
      hash, so, as on the GPU, a hit is a prefix of the chain.
    * :meth:`touch` moves held blocks to the LRU tail, walking the request's hashes
      backwards so its head is the most recently used and outlives its tail.
    * :meth:`store` skips hashes already held (no duplicates in this tier, unlike the
      GPU pool), evicts the LRU head to make room and emits one ``BlockRemoved`` per
      evicted block, then one ``BlockStored`` per contiguous run of new blocks. A store
      larger than the whole tier is dropped, as vLLM's ``prepare_store`` gives up when
      it cannot evict enough.
    * Stored events carry the run's parent hash, token ids and extra keys, like
      vLLM's self-describing offload events (older connectors sent ``parent=None`` and
      no tokens), so a consumer can check the hashes of either tier the same way.

    Loads and stores complete within the step that starts them (vLLM's are
    asynchronous and their events trail by a step or two); a loaded block is therefore
    never pinned, and the engine charges the transfer to that step's duration.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("the CPU offload tier needs at least 1 block")
        self.num_blocks = num_blocks
        self.blocks: OrderedDict[bytes, None] = OrderedDict()
        self.events: list[CacheRecord] = []

    def usage(self) -> float:
        return len(self.blocks) / self.num_blocks

    def cached_hashes(self) -> list[bytes]:
        return list(self.blocks)

    def lookup(self, block_hashes: Sequence[bytes]) -> int:
        held = self.blocks
        n = 0
        for h in block_hashes:
            if h not in held:
                break
            n += 1
        return n

    def touch(self, block_hashes: Sequence[bytes]) -> None:
        held = self.blocks
        for h in reversed(block_hashes):
            if h in held:
                held.move_to_end(h)

    def store(self, req: CacheRequest, start: int, end: int, block_size: int) -> None:
        """Offload blocks ``start..end-1`` of ``req`` (all full and hashed)."""
        held = self.blocks
        new = [i for i in range(start, end) if req.block_hashes[i] not in held]
        if not new or len(new) > self.num_blocks:
            return
        for _ in range(len(held) + len(new) - self.num_blocks):
            evicted, _ = held.popitem(last=False)
            self.events.append(RemovedRecord(evicted, MEDIUM_CPU))
        run_start = new[0]
        for pos, i in enumerate(new):
            held[req.block_hashes[i]] = None
            if pos + 1 == len(new) or new[pos + 1] != i + 1:
                self._stored(req, run_start, i + 1, block_size)
                if pos + 1 < len(new):
                    run_start = new[pos + 1]

    def _stored(self, req: CacheRequest, start: int, end: int, block_size: int) -> None:
        self.events.append(
            StoredRecord(
                block_hashes=req.block_hashes[start:end],
                parent=req.block_hashes[start - 1] if start else None,
                token_ids=req.all_token_ids[start * block_size : end * block_size],
                lora_id=req.lora_id,
                lora_name=req.lora_name,
                extra_keys=req.block_extra_keys[start:end],
                medium=MEDIUM_CPU,
            )
        )

    def clear(self) -> None:
        """Drop every block, and events not yet taken, silently: the pool's ``AllBlocksCleared`` covers all media."""
        self.blocks.clear()
        self.events.clear()

    def take_events(self) -> list[CacheRecord]:
        events, self.events = self.events, []
        return events


@dataclass(slots=True)
class _ReqState:
    blocks: list[Block] = field(default_factory=list)
    num_cached_blocks: int = 0
    reserved_left: int = 0


class BlockManager:
    """Per-request prefix hits, allocation and freeing over one :class:`BlockPool`.

    Follows vLLM's ``KVCacheManager``: :meth:`get_computed_blocks` finds the hit,
    :meth:`allocate_slots` touches the hit blocks, allocates the new ones and caches
    every block whose tokens are all known, :meth:`free` releases tail first.

    With ``cpu_offload_blocks`` > 0 a :class:`CpuOffloadTier` sits behind the pool:
    :meth:`get_offloaded_blocks` continues the GPU hit there, and every block
    :meth:`allocate_slots` caches on the GPU is stored to it as well. A request
    admitted with ``k`` offloaded blocks is allocated GPU blocks for them and passes
    ``num_computed_tokens`` past them, so they are cached on the GPU again (a GPU
    ``BlockStored``) and are not stored twice to the CPU, which already holds them.

    ``uncached_first`` is the pool's freeing rule (:class:`BlockPool`): True for vLLM
    >= 0.24, whose freed unhashed blocks (a request's partial last block) are reused
    before a cached block is evicted; :func:`reuses_uncached_first` gives it per version.
    """

    def __init__(
        self, num_blocks: int, block_size: int, cpu_offload_blocks: int = 0, uncached_first: bool = True
    ) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, uncached_first)
        self.cpu = CpuOffloadTier(cpu_offload_blocks) if cpu_offload_blocks > 0 else None
        self._reqs: dict[str, _ReqState] = {}
        self.reserved = 0
        """Blocks promised to running requests but not yet allocated (see :meth:`can_admit`)."""

    def get_computed_blocks(self, req: CacheRequest) -> tuple[list[Block], int]:
        """Leading cached blocks of ``req`` and the tokens they cover (never all of them)."""
        max_blocks = (len(req.all_token_ids) - 1) // self.block_size
        hits: list[Block] = []
        for h in req.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(h)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def get_offloaded_blocks(self, req: CacheRequest, num_gpu_hit_blocks: int) -> int:
        """Blocks the CPU tier holds right after the GPU hit (0 without a tier).

        Like :meth:`get_computed_blocks` it never covers the last prompt token. The
        request's prompt blocks are touched in the tier first, as vLLM's connector
        touches a request's keys when it looks them up.
        """
        cpu = self.cpu
        if cpu is None:
            return 0
        max_blocks = (len(req.all_token_ids) - 1) // self.block_size
        cpu.touch(req.block_hashes[:max_blocks])
        return cpu.lookup(req.block_hashes[num_gpu_hit_blocks:max_blocks])

    def blocks_needed(self, num_tokens: int, num_hit_blocks: int) -> int:
        return -(-num_tokens // self.block_size) - num_hit_blocks

    def can_admit(self, hits: list[Block], lifetime_blocks: int) -> bool:
        """Whether a request needing ``lifetime_blocks`` new blocks over its whole life fits.

        Hits that sit in the free queue stop being free once touched, and blocks
        already promised to running requests are not available. This replaces vLLM's
        preemption: admission waits instead, and no running request ever stalls.
        """
        evictable_hits = sum(1 for b in hits if b.ref_cnt == 0)
        return lifetime_blocks <= self.pool.num_free_blocks - evictable_hits - self.reserved

    def admit(self, req: CacheRequest, hits: list[Block], lifetime_blocks: int) -> None:
        self.pool.touch(hits)
        self._reqs[req.request_id] = _ReqState(list(hits), len(hits), lifetime_blocks)
        self.reserved += lifetime_blocks

    def allocate_slots(self, req: CacheRequest, num_computed_tokens: int, num_new_tokens: int) -> int:
        """Give ``req`` room for ``num_new_tokens`` more tokens and cache its full blocks.

        Returns the number of blocks the request now holds (the KV blocks the step reads).
        """
        state = self._reqs[req.request_id]
        required = -(-(num_computed_tokens + num_new_tokens) // self.block_size)
        n_new = required - len(state.blocks)
        if n_new > 0:
            state.blocks.extend(self.pool.get_new_blocks(n_new))
            used = min(n_new, state.reserved_left)
            state.reserved_left -= used
            self.reserved -= used
        num_full = min(num_computed_tokens + num_new_tokens, len(req.all_token_ids)) // self.block_size
        self.pool.cache_full_blocks(req, state.blocks, state.num_cached_blocks, num_full, self.block_size)
        if self.cpu is not None and num_full > state.num_cached_blocks:
            self.cpu.store(req, state.num_cached_blocks, num_full, self.block_size)
        state.num_cached_blocks = max(state.num_cached_blocks, num_full)
        return len(state.blocks)

    def free(self, req: CacheRequest) -> None:
        """Release ``req``'s blocks, tail first, and what it had reserved but not used.

        Its cached blocks join the free queue's tail; a partial last block joins its head
        under the >= 0.24 rule (see :class:`BlockPool`).
        """
        state = self._reqs.pop(req.request_id, None)
        if state is not None:
            self.pool.free_blocks(state.blocks[::-1])
            self.reserved -= state.reserved_left

    def num_blocks_of(self, request_id: str) -> int:
        state = self._reqs.get(request_id)
        return len(state.blocks) if state else 0

    def held_by(self, request_id: str) -> tuple[list[Block], int]:
        """The blocks ``request_id`` holds, and those promised to it but not yet allocated."""
        state = self._reqs.get(request_id)
        return (state.blocks, state.reserved_left) if state else ([], 0)

    def reset_prefix_cache(self) -> bool:
        """Reset the GPU pool and, with it, the CPU tier (one ``AllBlocksCleared`` clears every medium)."""
        ok = self.pool.reset_prefix_cache()
        if ok and self.cpu is not None:
            self.cpu.clear()
        return ok

    def take_events(self) -> list[CacheRecord]:
        """The step's records: the GPU pool's, then the CPU tier's (vLLM appends the connector's after the pool's)."""
        events = self.pool.take_events()
        if self.cpu is not None:
            events.extend(self.cpu.take_events())
        return events
