"""Hash self-verification of the engines' events, and re-hash mode when they disagree.

The router finds cached prefixes by hashing a request itself and looking the hashes up
in an index filled with the engines' hashes, so the two must agree bit for bit. They
agree only if the config names the engines' real ``hash_algo``, ``hash_seed``
(PYTHONHASHSEED), ``block_size`` and ``vllm_version``; a wrong one makes every lookup
miss without any error. :class:`HashVerifier` re-derives the hash of every block an
engine reports stored (``BlockStored`` carries the block's tokens and extra keys) and
compares:

* ``match`` / ``mismatch`` count blocks whose hash could be re-derived;
* ``unverifiable`` counts blocks whose parent digest is unknown, or whose extra keys the
  event does not fully say (events before vLLM 0.22 carry no extra keys, so a salted or
  multimodal block cannot be told from a wrong configuration; 0.31+ events omit the
  LoRA path, which comes from the config's ``lora_adapters``).

Events usually carry only the low 64 bits of each hash, from which a chain cannot be
continued, so the verifier keeps, per worker, engine key -> the router's full digest of
every block it holds (engine-reported removals drop entries; the map is bounded, oldest
out first, by ``max_tracked_blocks`` and by the worker's key caps in the tiers it stored
into, so a forged stream costs no more here than in the index). A
block whose parent is in that map, or whose parent is null (NONE_HASH), can be checked.

With ``settle_after`` set (the router and the indexer use :data:`SETTLE_AFTER`), once a
worker has verified that many blocks in a row it is *settled*: from then on
only the first ``spot_blocks`` blocks of root events (parent null) are re-derived, and
events continuing a cached prefix are skipped (counted as ``skipped``). Checking every
block cost the router about 15% of a core under the Mooncake bench, all of it spent
re-confirming a configuration that had already matched thousands of times; a
misconfiguration (algorithm, seed, block size, version, LoRA, salt) shows in a request's
first block, so spot checks still catch an engine restarted with other settings. The
first mismatch ends the settled state and every block is checked again. The price: a
settled worker's skipped blocks have no router digest, so a later switch to re-hash
mode re-indexes only the blocks it still knows.

After sustained disagreement (``min_mismatches`` mismatches and no match among the last
``window`` checked blocks) the worker switches to *re-hash mode*: the batch handed to the
index carries the router's keys instead of the engine's (the same map turns an engine
key in ``BlockRemoved`` back into the router key), and the worker's current blocks are
re-indexed under router keys. A loud warning names the likely cause, found by trying
the other algorithms, seeds and version dialects on a mismatching first block. The
switch reverses when the engine's hashes match again (the operator fixed the engines).
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from indexer.events import (
    MASK64,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    schema_for,
    to_key,
)
from indexer.hashing import ALGOS, BlockHasher, Dialect, HashConfigError, to_int64
from indexer.index import KeyCaps, Worker

__all__ = ["SETTLE_AFTER", "HashVerifier", "VerifyOutcome", "verifiers_from_config"]

log = logging.getLogger(__name__)

_GPU = "GPU"
SETTLE_AFTER = 1024
"""Blocks verified in a row after which a worker is only spot-checked (see the module docstring)."""
_DIAGNOSE_VERSIONS = ("0.11.0", "0.14.0", "0.20.0", "0.28.0", "0.30.0", "0.33.0")
_DIAGNOSE_SEEDS: tuple[str | None, ...] = (None, *map(str, range(10)), "42", "1234", "12345")
"""PYTHONHASHSEED values tried when diagnosing a mismatch: unset and the ones people pick."""


class _UnknownKeys(Exception):
    """The block's extra keys cannot be put in hashed form (e.g. a LoRA path not configured)."""


@dataclass(frozen=True)
class VerifyOutcome:
    """What :meth:`HashVerifier.check` found in one batch, and the batch to index."""

    batch: EventBatch
    match: int = 0
    mismatch: int = 0
    unverifiable: int = 0
    mode_changed: bool = False
    skipped: int = 0


class _Held:
    """One block the engine holds: the router's digest for it (None if not derivable) and its tiers."""

    __slots__ = ("digest", "media")

    def __init__(self, digest: bytes | None, medium: str) -> None:
        self.digest = digest
        self.media = [medium]


@dataclass(frozen=True)
class _Sample:
    """A first block (parent NONE_HASH) whose hash mismatched: the material for a diagnosis."""

    tokens: tuple[int, ...]
    extra: Any
    lora_name: str | None
    lora_id: int | None
    engine_hash: int | bytes
    block_size: int


@dataclass
class _WorkerState:
    window: deque[bool]
    held: OrderedDict[int, _Held] = field(default_factory=OrderedDict)  # O(1) oldest-first eviction: a dict's next(iter()) walks the slots its deletions left
    rehash: bool = False
    diagnosis: str | None = None
    samples: deque[_Sample] = field(default_factory=lambda: deque(maxlen=4))
    matched_ever: bool = False
    ambiguous_roots: int = 0
    streak: int = 0
    """Blocks verified in a row (reset by a mismatch): ``settle_after`` of them settle the worker."""
    media: set[str] = field(default_factory=set)
    """Tiers the worker stored into: the sum of their key caps bounds ``held``."""
    limit: int = 0
    """The most blocks ``held`` keeps (see :meth:`HashVerifier._limit`)."""


@dataclass
class _Counts:
    match: int = 0
    mismatch: int = 0
    unverifiable: int = 0
    skipped: int = 0


class HashVerifier:
    """Checks one model's engine hashes against ``hasher`` and re-hashes when they disagree.

    ``lora_paths`` maps adapter name -> path (the engines' ``--lora-modules``), needed to
    verify LoRA blocks of vLLM >= 0.31, whose hash includes the path. Not thread-safe:
    the subscriber thread is its only caller.
    """

    def __init__(
        self,
        hasher: BlockHasher,
        lora_paths: dict[str, str] | None = None,
        *,
        window: int = 64,
        min_mismatches: int = 8,
        max_tracked_blocks: int = 1 << 20,
        settle_after: int | None = None,
        spot_blocks: int = 2,
        caps: KeyCaps | None = None,
    ) -> None:
        self.hasher = hasher
        self.lora_paths = dict(lora_paths or {})
        self._window = window
        self._min_mismatches = min_mismatches
        self._max_tracked = max_tracked_blocks
        self._caps = caps
        self._settle_after = settle_after
        self._spot_blocks = spot_blocks
        self._events_have_keys = "extra_keys" in schema_for(hasher.vllm_version).stored_fields
        self._workers: dict[Worker, _WorkerState] = {}

    # -- public API -------------------------------------------------------------------

    def check(self, worker: Worker, batch: EventBatch) -> VerifyOutcome:
        """Verify every ``BlockStored`` of ``batch``; return the batch the index should apply.

        In normal mode that is ``batch`` itself; in re-hash mode a copy keyed by router
        hashes. On a mode switch the returned batch ends by clearing the worker and
        storing its current blocks under the new mode's keys.
        """
        st = self._state(worker)
        st.limit = self._limit(worker, st, batch)
        counts = _Counts()
        rehash = st.rehash
        out: list[Any] = []
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                digests = self._stored(st, ev, counts)
                if rehash:
                    keys = [to_int64(d) for d in digests if d is not None]
                    if keys:
                        out.append(_stored_event(keys, ev.medium, ev.block_size))
            elif isinstance(ev, BlockRemoved):
                if rehash:
                    keys = [to_int64(h.digest) for h in map(st.held.get, _keys(ev.block_hashes)) if h and h.digest]
                    if keys:
                        out.append(BlockRemoved(keys, ev.medium, ev.group_idx))
                self._removed(st, ev)
            else:
                if isinstance(ev, AllBlocksCleared):
                    st.held.clear()
                if rehash:
                    out.append(ev)
        changed = self._maybe_switch(worker, st)
        if rehash:
            batch = EventBatch(batch.ts, out, batch.data_parallel_rank)
        if changed:
            batch = EventBatch(batch.ts, list(batch.events) + self._reindex(st), batch.data_parallel_rank)
        return VerifyOutcome(batch, counts.match, counts.mismatch, counts.unverifiable, changed, counts.skipped)

    def forget(self, worker: Worker) -> None:
        """The worker's entries were cleared from the index: drop what we know of its blocks."""
        st = self._workers.get(worker)
        if st is not None:
            st.held.clear()

    def rehash_mode(self, worker: Worker) -> bool:
        st = self._workers.get(worker)
        return bool(st and st.rehash)

    def diagnosis(self, worker: Worker) -> str | None:
        """Why the worker is in re-hash mode (the likely misconfiguration), else None."""
        st = self._workers.get(worker)
        return st.diagnosis if st and st.rehash else None

    # -- per event ----------------------------------------------------------------------

    def _state(self, worker: Worker) -> _WorkerState:
        st = self._workers.get(worker)
        if st is None:
            st = self._workers[worker] = _WorkerState(deque(maxlen=self._window))
        return st

    def _stored(self, st: _WorkerState, ev: BlockStored, counts: _Counts) -> list[bytes | None]:
        """The router's digest of each stored block (None where it cannot be derived)."""
        n = len(ev.block_hashes)
        size = self.hasher.block_size
        medium = ev.medium or _GPU
        digests: list[bytes | None] = [None] * n
        if ev.block_size != size or len(ev.token_ids) != n * size:
            if ev.block_size != size:
                counts.mismatch += n
                st.window.extend([False] * min(n, self._window))
                if ev.parent_block_hash is None and n and len(ev.token_ids) >= ev.block_size:
                    st.samples.append(self._sample(ev, 0))
            else:
                counts.unverifiable += n
            for h in ev.block_hashes:
                self._hold(st, to_key(h), None, medium)
            return digests
        checked = n
        if self._settled(st):
            checked = 0 if ev.parent_block_hash is not None else min(n, self._spot_blocks)
            counts.skipped += n - checked
        parent = self._parent_digest(st, ev.parent_block_hash)
        for i, engine_hash in enumerate(ev.block_hashes[:checked]):
            digest = None
            if parent is not None:
                try:
                    keys, definitive = _extra_keys(
                        self.hasher.dialect, ev, i, self.lora_paths, self._events_have_keys
                    )
                except _UnknownKeys:
                    keys, definitive = None, None
                if definitive is not None:
                    digest = self.hasher.hash_block(parent, ev.token_ids[i * size : (i + 1) * size], keys)
                    if _same(digest, engine_hash):
                        counts.match += 1
                        st.matched_ever = True
                        st.window.append(True)
                        st.streak += 1
                    elif definitive:
                        counts.mismatch += 1
                        st.window.append(False)
                        st.streak = 0
                        if i == 0 and ev.parent_block_hash is None:
                            st.samples.append(self._sample(ev, i))
                    else:
                        digest = None
                        if i == 0 and ev.parent_block_hash is None:
                            self._ambiguous_root(st, ev)
            if digest is None:
                counts.unverifiable += 1
            digests[i] = digest
            self._hold(st, to_key(engine_hash), digest, medium)
            parent = digest
        return digests

    def _limit(self, worker: Worker, st: _WorkerState, batch: EventBatch) -> int:
        """``max_tracked_blocks``, or less: the sum of the worker's key caps over the tiers it
        stored into (the index holds no more; the caps may change with every scrape)."""
        if self._caps is None:
            return self._max_tracked
        st.media.update(ev.medium or _GPU for ev in batch.events if type(ev) is BlockStored)
        return min(self._max_tracked, sum(self._caps.cap(worker, m) for m in st.media) or self._max_tracked)

    def _settled(self, st: _WorkerState) -> bool:
        return self._settle_after is not None and not st.rehash and st.streak >= self._settle_after

    def _ambiguous_root(self, st: _WorkerState, ev: BlockStored) -> None:
        """A first block mismatched, but the event cannot say whether it had a salt or image.

        Such blocks never switch modes (a salted fleet would look misconfigured), but a
        stream where not one first block ever matches is almost surely misconfigured:
        say so once, with the diagnosis.
        """
        st.samples.append(self._sample(ev, 0))
        st.ambiguous_roots += 1
        if st.ambiguous_roots == self._window and not st.matched_ever:
            log.warning(
                "kv events: none of %d first blocks verified and vLLM %s events carry no extra keys "
                "to tell cache_salt/multimodal blocks from a wrong config; unless all traffic is "
                "salted, check the config: %s",
                st.ambiguous_roots, self.hasher.vllm_version, self._diagnose(st),
            )

    def _parent_digest(self, st: _WorkerState, parent: int | bytes | None) -> bytes | None:
        if parent is None:
            return self.hasher.none_hash
        held = st.held.get(to_key(parent))
        if held is not None and held.digest is not None:
            return held.digest
        if isinstance(parent, bytes) and not st.rehash:
            return parent
        return None

    def _removed(self, st: _WorkerState, ev: BlockRemoved) -> None:
        medium = ev.medium or _GPU
        for key in _keys(ev.block_hashes):
            held = st.held.get(key)
            if held is None:
                continue
            if medium in held.media:
                held.media.remove(medium)
            if not held.media:
                del st.held[key]

    def _hold(self, st: _WorkerState, key: int, digest: bytes | None, medium: str) -> None:
        held = st.held.get(key)
        if held is None:
            st.held[key] = _Held(digest, medium)
            while len(st.held) > st.limit:
                st.held.popitem(last=False)
            return
        if digest is not None:
            held.digest = digest
        if medium not in held.media:
            held.media.append(medium)

    # -- mode switches --------------------------------------------------------------------

    def _maybe_switch(self, worker: Worker, st: _WorkerState) -> bool:
        matches = sum(st.window)
        mismatches = len(st.window) - matches
        if not st.rehash and mismatches >= self._min_mismatches and matches == 0:
            st.rehash = True
            st.diagnosis = self._diagnose(st)
            log.warning(
                "\n!!! kv events %s[%d]: the engine's block hashes do not match the router's "
                "(%d mismatches, 0 matches in the last %d checked blocks).\n!!! Likely cause: %s\n"
                "!!! Indexing router-computed hashes for this worker (re-hash mode) until they match again.",
                worker.backend, worker.dp_rank, mismatches, len(st.window), st.diagnosis,
            )
        elif st.rehash and matches >= self._min_mismatches and mismatches == 0:
            st.rehash = False
            st.diagnosis = None
            log.warning(
                "kv events %s[%d]: engine block hashes match the router's again; leaving re-hash mode",
                worker.backend, worker.dp_rank,
            )
        else:
            return False
        st.window.clear()
        return True

    def _reindex(self, st: _WorkerState) -> list[Any]:
        """Events that replace the worker's entries by its held blocks under the current mode's keys."""
        by_medium: dict[str, list[int]] = {}
        for engine_key, held in st.held.items():
            if st.rehash:
                if held.digest is None:
                    continue
                key = to_int64(held.digest)
            else:
                key = engine_key
            for medium in held.media:
                by_medium.setdefault(medium, []).append(key)
        events: list[Any] = [AllBlocksCleared()]
        events += [_stored_event(keys, medium, self.hasher.block_size) for medium, keys in by_medium.items()]
        return events

    def _sample(self, ev: BlockStored, i: int) -> _Sample:
        extra = ev.extra_keys[i] if isinstance(ev.extra_keys, list) and i < len(ev.extra_keys) else None
        b = ev.block_size
        return _Sample(tuple(ev.token_ids[i * b : (i + 1) * b]), extra, ev.lora_name, ev.lora_id,
                       ev.block_hashes[i], b)

    def _diagnose(self, st: _WorkerState) -> str:
        """Name the setting that makes a mismatching first block match, by trying the alternatives."""
        h = self.hasher
        current = f"hash_algo={h.algo}, hash_seed={h.seed!r}, block_size={h.block_size}, vllm_version={h.vllm_version}"
        if not st.samples:
            return (
                f"no first block to test; check the engines' --prefix-caching-hash-algo, PYTHONHASHSEED, "
                f"--block-size and vLLM version against the config ({current})"
            )
        sample = st.samples[-1]
        if sample.block_size != h.block_size:
            return (
                f"block size: the engine stores blocks of {sample.block_size} tokens but the config says "
                f"block_size={h.block_size}"
            )
        found = _alternatives(sample, h, self.lora_paths)
        if found:
            return "the engines hash like " + " or ".join(found[:3]) + f" (config: {current})"
        return (
            "no combination of algorithm, common PYTHONHASHSEED (unset, 0-9, 42, 1234, 12345) and version "
            f"dialect reproduces the engine's hash: the engines likely run with an unset PYTHONHASHSEED on vLLM < 0.30 "
            f"or an xxhash algorithm (random NONE_HASH per process), or with another seed (config: {current})"
        )


def verifiers_from_config(config: Any, caps: KeyCaps | None = None) -> dict[str, HashVerifier]:
    """One verifier per model of a ``kvconfig.Config``, keyed by model name; ``caps``: the
    index's, which bound what each verifier keeps per worker.

    A model whose hashes cannot be reproduced at all (:class:`HashConfigError`, e.g. an
    unset PYTHONHASHSEED on vLLM < 0.30) gets none, with a warning: there is nothing to
    verify against, and the router reports that model's hashing error itself.
    """
    out: dict[str, HashVerifier] = {}
    for model in config.models:
        try:
            hasher = BlockHasher(model.hash_algo, model.block_size, model.hash_seed, model.vllm_version)
        except HashConfigError as e:
            log.warning("model %s: hash verification off: %s", model.name, e)
            continue
        out[model.name] = HashVerifier(hasher, {a.name: a.path for a in model.lora_adapters}, settle_after=SETTLE_AFTER,
                                       caps=caps)
    return out


def _alternatives(sample: _Sample, current: BlockHasher, lora_paths: dict[str, str]) -> list[str]:
    """The settings (differing from ``current``) under which ``sample`` hashes like the engine."""
    seeds = list(dict.fromkeys([current.seed, *_DIAGNOSE_SEEDS]))
    versions = list(dict.fromkeys([current.vllm_version, *_DIAGNOSE_VERSIONS]))
    ev = BlockStored([sample.engine_hash], None, list(sample.tokens), sample.block_size, sample.lora_id, None,
                     sample.lora_name, [sample.extra] if sample.extra is not None else None)
    found: list[tuple[str, ...]] = []
    for algo in ALGOS:
        for seed in seeds:
            for version in versions:
                try:
                    hasher = BlockHasher(algo, sample.block_size, seed, version)
                    keys, _ = _extra_keys(hasher.dialect, ev, 0, lora_paths, sample.extra is not None)
                except (_UnknownKeys, HashConfigError):
                    continue
                if not _same(hasher.hash_block(None, list(sample.tokens), keys), sample.engine_hash):
                    continue
                diffs = tuple(
                    f"{name}={_show(value)}"
                    for name, value, now in (
                        ("hash_algo", algo, current.algo),
                        ("hash_seed", seed, current.seed),
                        ("vllm_version", version, current.vllm_version),
                    )
                    if value != now
                )
                if diffs and diffs not in found:
                    found.append(diffs)
    # Keep the smallest changes: a version that hashes unkeyed blocks alike adds nothing.
    minimal = [d for d in found if not any(set(o) < set(d) for o in found)]
    return [", ".join(d) for d in minimal]


def _show(value: str | None) -> str:
    return "null (PYTHONHASHSEED unset)" if value is None else repr(value)


def _extra_keys(
dialect: Dialect, ev: BlockStored, i: int, lora_paths: dict[str, str], events_have_keys: bool
) -> tuple[tuple | None, bool]:
    """Block ``i``'s extra keys in ``dialect``'s hashed form, and whether they are complete.

    Engines that publish extra keys send the untagged form (vLLM >= 0.31 hashes the
    tagged one): LoRA first (the event's ``lora_name``), then ``[mm_id, offset]``
    pairs, then the bare salt, then prompt-embeds digests. Older engines send none,
    so only the LoRA key (from ``lora_id``/``lora_name``) is known and a mismatch may
    be a salt or an image rather than a wrong configuration.
    """
    if not events_have_keys and ev.extra_keys is None:
        lora = _lora_key(dialect, ev, lora_paths)
        return ((lora,) if lora is not None else None), False
    entry = ev.extra_keys[i] if isinstance(ev.extra_keys, list) and i < len(ev.extra_keys) else None
    if not entry:
        return None, True
    if not isinstance(entry, list):
        raise _UnknownKeys(f"block {i}'s extra keys are a {type(entry).__name__}, not a list")
    out: list[Any] = []
    for j, item in enumerate(entry):
        if j == 0 and ev.lora_name is not None and item == ev.lora_name:
            out.append(_lora_key(dialect, ev, lora_paths))
        elif isinstance(item, (list, tuple)) and len(item) == 2:
            out.append(dialect.mm_extra_key(item[0], item[1]))
        elif isinstance(item, str):
            out.append(dialect.salt_extra_key(item))
        elif isinstance(item, bytes):
            out.append(dialect.prompt_embeds_extra_key(item) if dialect.prompt_embeds else item)
        else:
            out.append(_tupled(item))
    return tuple(out), True


def _lora_key(dialect: Dialect, ev: BlockStored, lora_paths: dict[str, str]) -> Any:
    if ev.lora_id is None and ev.lora_name is None:
        return None
    lora: dict[str, Any] = {"int_id": ev.lora_id, "name": ev.lora_name}
    if dialect.lora_key == "tagged":
        path = lora_paths.get(ev.lora_name or "")
        if path is None:
            raise _UnknownKeys(f"LoRA adapter {ev.lora_name!r} has no path in the config")
        lora["path"] = path
    try:
        return dialect.lora_extra_key(lora)
    except HashConfigError as e:
        raise _UnknownKeys(str(e)) from None


def _tupled(item: Any) -> Any:
    if isinstance(item, list):
        return tuple(_tupled(x) for x in item)
    return item


def _same(digest: bytes, engine_hash: int | bytes) -> bool:
    if isinstance(engine_hash, bytes):
        return digest == engine_hash
    return to_int64(digest) == engine_hash & MASK64


def _keys(hashes: Iterable[int | bytes]) -> list[int]:
    return [to_key(h) for h in hashes]


def _stored_event(keys: list[int], medium: str | None, block_size: int) -> BlockStored:
    return BlockStored(keys, None, [], block_size, None, medium)
