"""vLLM-identical prefix-cache block hashing, for every vLLM version from 0.11 on.

A prompt is cut into full blocks of ``block_size`` tokens and block ``i`` hashes to
``H_i = hash_fn((H_{i-1}, tuple(block_tokens), extra_keys_i))`` with ``H_{-1} = NONE_HASH``
(vLLM ``v1/core/kv_cache_utils.py``; ``docs/vllm-facts.md`` §1). Hits are always a
prefix because each hash chains its parent, so the router only ever needs the chain.

What differs between versions (the *dialect*, table in ``tests/fixtures/golden/README.md``):
which algorithms exist, what NONE_HASH is when PYTHONHASHSEED is unset, and the shape
of the extra keys (LoRA, multimodal items, cache_salt, prompt-embeds digests).

Speed: requests of 8k-128k tokens are normal and hashing sits on the request path.
``pickle.dumps`` is C code and already fast, so the pickle algorithms call it directly
(a hand-emitted pickle was measured slower). ``cbor2.dumps(canonical=True)`` costs about
4 µs a block, so the CBOR algorithms emit the fixed shape ``[bytes, [uint, ...], extra]``
by hand (:func:`_cbor_token_blob`, :func:`_cbor_tokens`) and fall back to cbor2 for any
shape they do not cover. ``_reference_hash_block`` is the plain pickle/cbor2
implementation the tests compare every fast path against.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import pickle
import re
import struct
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import cbor2
import numpy as np
import xxhash

log = logging.getLogger(__name__)

ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
PICKLE_PROTOCOL = 5
"""``pickle.HIGHEST_PROTOCOL`` on every Python vLLM supports (3.8+); pinned so that a
router on a newer Python still hashes like the engines the golden files came from."""

UNSET_SEED_FIXED_INPUT = "vllm-none-hash"


class HashConfigError(ValueError):
    """The hashing set-up cannot reproduce the engines' hashes; the message says what to set."""


@dataclass(frozen=True)
class Dialect:
    """How one range of vLLM versions forms block hashes.

    ``mm_key`` also fixes the overlap rule. With bare identifiers a block skips an item
    only when it starts *after* the item's end, and the walk stops early only when the
    last item ends before the block; vLLM PR #36708 (which added the offset) made both
    comparisons include equality. The item cursor vLLM carries from block to block hides
    the difference except for zero-length or out-of-order items; both rules are kept.
    """

    name: str
    since: tuple[int, int, int]
    algos: frozenset[str]
    unset_seed_fixed: bool
    lora_key: Literal["int_id", "name", "tagged"]
    mm_key: Literal["identifier", "identifier_offset", "tagged"]
    tagged_salt: bool
    prompt_embeds: bool
    tagged_prompt_embeds: bool

    def lora_extra_key(self, lora: Mapping[str, Any]) -> Any:
        """The hashed form of a LoRA adapter (``name``, ``path``, ``int_id``) in this dialect."""
        try:
            if self.lora_key == "int_id":
                return _require(lora, "int_id", int)
            if self.lora_key == "name":
                return _require(lora, "name", str)
            return ("lora", _require(lora, "name", str), _require(lora, "path", str))
        except (KeyError, TypeError) as e:
            raise HashConfigError(
                f"LoRA adapter for vLLM {self.name} hashing needs {e.args[0]}; give each adapter "
                "its name, path and id exactly as in the engines' --lora-modules"
            ) from None

    def mm_extra_key(self, identifier: str, offset_in_block: int) -> Any:
        """The hashed form of a multimodal item overlapping a block (offset may be negative)."""
        if self.mm_key == "identifier":
            return identifier
        if self.mm_key == "identifier_offset":
            return (identifier, offset_in_block)
        return ("mm", identifier, offset_in_block)

    def salt_extra_key(self, cache_salt: str) -> Any:
        """The hashed form of ``cache_salt`` (first block only)."""
        return ("cache_salt", cache_salt) if self.tagged_salt else cache_salt

    def prompt_embeds_extra_key(self, digest: bytes) -> Any:
        """The hashed form of a block's prompt-embeds digest (sha256 of the block's tensor bytes)."""
        if not self.prompt_embeds:
            raise HashConfigError(f"vLLM {self.name} has no prompt-embeds block keys")
        return ("prompt_embeds", digest) if self.tagged_prompt_embeds else digest


_ALL = frozenset(ALGOS)
_TAGGED = {"lora_key": "tagged", "mm_key": "tagged", "tagged_salt": True, "tagged_prompt_embeds": True}
_PLAIN = {"tagged_salt": False, "tagged_prompt_embeds": False}
DIALECTS: tuple[Dialect, ...] = (
    Dialect("0.11", (0, 11, 0), frozenset({"sha256", "sha256_cbor"}), unset_seed_fixed=False,
            lora_key="int_id", mm_key="identifier", prompt_embeds=False, **_PLAIN),
    Dialect("0.12-0.19.0", (0, 12, 0), _ALL, unset_seed_fixed=False,
            lora_key="name", mm_key="identifier", prompt_embeds=True, **_PLAIN),
    # PR #36708 (offset in the MM key, inclusive boundaries) first shipped in v0.19.1.
    Dialect("0.19.1-0.29", (0, 19, 1), _ALL, unset_seed_fixed=False,
            lora_key="name", mm_key="identifier_offset", prompt_embeds=True, **_PLAIN),
    # 0.29 was not examined; it stays with the random unset seed, which only ever
    # turns an ambiguous set-up into a configuration error, never into a wrong hash.
    Dialect("0.30", (0, 30, 0), _ALL, unset_seed_fixed=True,
            lora_key="name", mm_key="identifier_offset", prompt_embeds=True, **_PLAIN),
    Dialect("0.31+", (0, 31, 0), _ALL, unset_seed_fixed=True, prompt_embeds=True, **_TAGGED),
)
NEWEST_VERIFIED = (0, 33, 0)
_VERSION = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?")


@functools.lru_cache(maxsize=64)
def dialect_for(vllm_version: str) -> Dialect:
    """The dialect of ``vllm_version`` ("0.22.1", "0.33.0rc1", "0.28.0+cu128").

    Unparseable and newer-than-verified versions get the newest dialect with a logged
    warning (new releases have so far changed hashing rarely). Versions before 0.11
    hashed differently (ints, the ``builtin`` algorithm) and are refused.
    """
    m = _VERSION.match(str(vllm_version))
    if m is None:
        log.warning("vLLM version %r is not a version number; hashing like vLLM %s",
                    vllm_version, DIALECTS[-1].name)
        return DIALECTS[-1]
    v = (int(m[1]), int(m[2]), int(m[3] or 0))
    if v < DIALECTS[0].since:
        raise HashConfigError(
            f"vLLM {vllm_version} is older than 0.11, whose block hashes kvrouter cannot reproduce; "
            "upgrade the engines or set vllm_version to what they run"
        )
    if v > NEWEST_VERIFIED:
        log.warning("vLLM %s is newer than the newest verified version (%s); hashing like vLLM %s",
                    vllm_version, ".".join(map(str, NEWEST_VERIFIED)), DIALECTS[-1].name)
    return [d for d in DIALECTS if d.since <= v][-1]


def to_int64(digest: bytes) -> int:
    """The 64-bit key events carry for a hash: the digest's low 64 bits, big-endian, unsigned."""
    return int.from_bytes(digest[-8:], "big")


def _require(d: Mapping[str, Any], key: str, kind: type) -> Any:
    value = d[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise TypeError(f"{key} as {kind.__name__}")
    return value


def _hash_new(algo: str) -> Callable[[bytes], Any]:
    """The hash object constructor; hot loops call ``new(data).digest()`` with no Python frame between."""
    return hashlib.sha256 if algo.startswith("sha256") else xxhash.xxh3_128


def _digest_fn(algo: str) -> Callable[[bytes], bytes]:
    new = _hash_new(algo)
    return lambda data: new(data).digest()


def _serialize_fn(algo: str) -> Callable[[Any], bytes]:
    if algo.endswith("_cbor"):
        return functools.partial(cbor2.dumps, canonical=True)
    return functools.partial(pickle.dumps, protocol=PICKLE_PROTOCOL)


def _reference_hash_block(algo: str, parent: bytes, tokens: Sequence[int], extra_keys: tuple | None) -> bytes:
    """vLLM's ``hash_block_tokens`` spelled with plain pickle/cbor2: the oracle for the fast paths."""
    return _digest_fn(algo)(_serialize_fn(algo)((parent, tuple(tokens), extra_keys)))


# --- hand-emitted canonical CBOR ------------------------------------------------------

_CBOR_NULL = b"\xf6"
_U32_CODE = next(code for code in "ILH" if array(code).itemsize == 4)
# Token classes by magnitude: < 24 (1 byte), < 256 (2), < 65536 (3), < 2**32 (5).
_CBOR_BOUNDS = np.array([24, 256, 65536], dtype=np.uint32)
_CBOR_WIDTH = np.array([1, 2, 3, 5], dtype=np.int64)
_CBOR_LEAD = np.array([0, 0x18 << 8, 0x19 << 16, 0x1A << 32], dtype=np.uint64)
_CBOR_KEEP = np.arange(8) >= 8 - _CBOR_WIDTH[:, None]  # per class: the row's last w bytes


def _cbor_head(major: int, n: int) -> bytes:
    """A CBOR item head with the shortest argument, as canonical CBOR requires."""
    m = major << 5
    if n < 24:
        return bytes((m | n,))
    if n < 0x100:
        return bytes((m | 24, n))
    if n < 0x10000:
        return bytes((m | 25,)) + n.to_bytes(2, "big")
    if n < 0x100000000:
        return bytes((m | 26,)) + n.to_bytes(4, "big")
    return bytes((m | 27,)) + n.to_bytes(8, "big")


_U8 = tuple(bytes((i,)) for i in range(256))
_pack_u16 = struct.Struct(">BH").pack
_pack_u32 = struct.Struct(">BI").pack


def _cbor_tokens(tokens: Sequence[int]) -> bytes | None:
    """Canonical CBOR of the unsigned ints, concatenated; None if one is not an int in [0, 2**64).

    The per-block path (short prompts, :meth:`BlockHasher.hash_block`): :func:`_cbor_head`
    inlined for major type 0, which halves its cost.
    """
    out: list[bytes] = []
    append = out.append
    for t in tokens:
        if type(t) is not int or t < 0:
            return None
        if t < 24:
            append(_U8[t])
        elif t < 0x100:
            append(b"\x18" + _U8[t])
        elif t < 0x10000:
            append(_pack_u16(0x19, t))
        elif t < 0x100000000:
            append(_pack_u32(0x1A, t))
        elif t < 1 << 64:
            append(b"\x1b" + t.to_bytes(8, "big"))
        else:
            return None
    return b"".join(out)


def _cbor_token_blob(token_ids: Sequence[int]) -> tuple[bytes, np.ndarray] | None:
    """All token ids as concatenated canonical CBOR uints, and each token's end offset.

    Vectorised so the per-token cost is a few numpy passes instead of Python calls:
    each token becomes one big-endian 8-byte row ``lead << 8*(w-1) | value`` whose last
    ``w`` bytes are exactly its CBOR encoding, and a per-class byte mask keeps those.
    ``array`` of unsigned 32-bit ints is the fastest way from a list to numpy and
    refuses anything but ints in [0, 2**32); then this returns None (the caller falls back).
    """
    try:
        ints = np.frombuffer(array(_U32_CODE, token_ids), dtype=np.uint32)
    except (TypeError, OverflowError):
        return None
    if ints.size == 0:
        return None
    cls = np.searchsorted(_CBOR_BOUNDS, ints, side="right")
    rows = (ints + _CBOR_LEAD[cls]).astype(">u8").view(np.uint8).reshape(-1, 8)
    return rows[_CBOR_KEEP[cls]].tobytes(), np.cumsum(_CBOR_WIDTH[cls])


# --- the hasher ------------------------------------------------------------------------

_CHAIN_NUMPY_MIN_BLOCKS = 8
"""Below this many blocks numpy's fixed overhead costs more than per-token encoding."""


class BlockHasher:
    """Hashes token ids into vLLM's block hashes for one engine configuration.

    ``seed`` is the engines' PYTHONHASHSEED string, or None when it is unset there.
    Invariant: for any input, every result equals ``_reference_hash_block`` chained
    block by block, i.e. what vLLM's ``request_block_hasher`` computes for a prompt.
    """

    def __init__(self, algo: str, block_size: int, seed: str | int | None, vllm_version: str) -> None:
        if algo not in ALGOS:
            raise HashConfigError(f"unknown hash algorithm {algo!r}; expected one of {', '.join(ALGOS)}")
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise HashConfigError(f"block_size must be a positive integer, got {block_size!r}")
        self.dialect = dialect_for(vllm_version)
        if algo not in self.dialect.algos:
            raise HashConfigError(
                f"vLLM {vllm_version} has no {algo} prefix-caching hash; use one of "
                f"{', '.join(sorted(self.dialect.algos))} (--prefix-caching-hash-algo)"
            )
        self.algo = algo
        self.block_size = block_size
        self.vllm_version = vllm_version
        self.seed = None if seed is None else str(seed)
        self._new = _hash_new(algo)
        self._cbor = algo.endswith("_cbor")
        self.none_hash = self._none_hash()
        self._array_head = _cbor_head(4, block_size)

    def _none_hash(self) -> bytes:
        """NONE_HASH: hash_fn(seed) when set; when unset, fixed only for >= 0.30 crypto algorithms."""
        if self.seed is not None:
            return self._new(_serialize_fn(self.algo)(self.seed)).digest()
        if self.dialect.unset_seed_fixed and self.algo.startswith("sha256"):
            return self._new(_serialize_fn(self.algo)(UNSET_SEED_FIXED_INPUT)).digest()
        why = (
            "xxhash algorithms seed the chain randomly"
            if self.dialect.unset_seed_fixed
            else "vLLM before 0.30 seeds the chain with os.urandom"
        )
        raise HashConfigError(
            f"PYTHONHASHSEED is unset on the engines and {why} (vLLM {self.vllm_version}, {self.algo}), "
            'so their block hashes cannot be reproduced: set PYTHONHASHSEED=0 on every engine and '
            'hash_seed: "0" in the config'
        )

    # -- one block --------------------------------------------------------------------

    def hash_block(self, parent: bytes | None, tokens: Sequence[int], extra_keys: tuple | None) -> bytes:
        """One block's hash; ``extra_keys`` already in this dialect's hashed form (or None).

        A falsy ``parent`` means the first block (NONE_HASH), as in vLLM.
        """
        parent = parent or self.none_hash
        if self._cbor:
            data = self._cbor_message(parent, tokens, self._cbor_extra(extra_keys))
            if data is not None:
                return self._new(data).digest()
            return _reference_hash_block(self.algo, parent, tokens, extra_keys)
        return self._new(pickle.dumps((parent, tuple(tokens), extra_keys), PICKLE_PROTOCOL)).digest()

    def _cbor_extra(self, extra_keys: tuple | None) -> bytes:
        return _CBOR_NULL if extra_keys is None else cbor2.dumps(extra_keys, canonical=True)

    def _cbor_message(self, parent: bytes, tokens: Sequence[int], extra: bytes) -> bytes | None:
        body = _cbor_tokens(tokens)
        if body is None or not isinstance(parent, bytes):
            return None
        return b"".join((b"\x83", _cbor_head(2, len(parent)), parent, _cbor_head(4, len(tokens)), body, extra))

    # -- a chain of blocks ------------------------------------------------------------

    def hash_blocks(
        self,
        token_ids: Sequence[int],
        *,
        lora: Mapping[str, Any] | None = None,
        cache_salt: str | None = None,
        mm: Sequence[Mapping[str, Any]] | None = None,
        parent: bytes | None = None,
        start_block: int | None = None,
        prompt_embeds_digests: Sequence[bytes] | None = None,
    ) -> list[bytes]:
        """The full digests of every full block of ``token_ids``, in order.

        ``lora``: ``{"name", "path", "int_id"}``. ``mm``: ``[{"identifier", "offset",
        "length"}]`` in prompt order with absolute token offsets. ``cache_salt`` keys the
        first block only. ``prompt_embeds_digests``: one per full block of this call.

        Continuing a chain: ``parent`` is the digest of the block before ``token_ids[0]``
        and ``start_block`` that first block's index in the whole prompt, so ``token_ids``
        start at token ``start_block * block_size``. Multimodal offsets stay absolute and
        the salt applies only when ``start_block`` is 0, which makes
        ``hash_blocks(t[k*B:], parent=h[k-1], start_block=k, ...) == h[k:]`` for
        ``h = hash_blocks(t, ...)``. Without mm, salt or embeds the position does not
        matter and ``start_block`` may be left out.

        This is the prompt's hashing. For blocks that *generated* tokens complete, vLLM
        restarts its multimodal cursor at the last item, which before 0.19.1 can key the
        block right after an item ending on a block boundary with that item; such blocks
        of multimodal requests are not modelled.
        """
        first = self._first_block(parent, start_block, cache_salt, mm)
        if parent is not None and not isinstance(parent, bytes):
            kind = type(parent).__name__
            raise ValueError(f"parent must be the bytes digest of the previous block, got {kind}")
        if not isinstance(token_ids, (list, tuple)):
            token_ids = token_ids.tolist() if hasattr(token_ids, "tolist") else [int(t) for t in token_ids]
        n_blocks = len(token_ids) // self.block_size
        if n_blocks == 0:
            return []
        common, special = self._extra_keys(n_blocks, first, lora, cache_salt, mm, prompt_embeds_digests)
        extras = [common] * n_blocks
        for i, keys in special.items():
            extras[i] = keys
        start = parent or self.none_hash
        if self._cbor:
            return self._chain_cbor(start, token_ids, n_blocks, extras, common, special)
        return self._chain_pickle(start, token_ids, extras)

    def hash_blocks_int64(self, token_ids: Sequence[int], **kwargs: Any) -> list[int]:
        """:meth:`hash_blocks` in the 64-bit form events carry (:func:`to_int64`)."""
        return [int.from_bytes(d[-8:], "big") for d in self.hash_blocks(token_ids, **kwargs)]

    def _first_block(self, parent, start_block, cache_salt, mm) -> int:
        """The index of the first block hashed; only multimodal keys and the salt depend on it."""
        if start_block is None:
            if parent is not None and (cache_salt or mm):
                raise ValueError("continuing a chain with cache_salt or mm needs start_block (the block index)")
            return 0 if parent is None else 1
        if not isinstance(start_block, int) or start_block < 0:
            raise ValueError(f"start_block must be a non-negative int, got {start_block!r}")
        if start_block > 0 and parent is None:
            raise ValueError("start_block > 0 needs parent, the digest of the block before it")
        return start_block

    def _extra_keys(
        self, n_blocks, first, lora, cache_salt, mm, prompt_embeds_digests
    ) -> tuple[tuple | None, dict[int, tuple]]:
        """Extra keys in vLLM's order (LoRA, multimodal items, cache_salt, prompt embeds):
        those of every block, and those of the blocks that have more (by index in this call)."""
        d = self.dialect
        base = [d.lora_extra_key(lora)] if lora else []
        per_block: dict[int, list[Any]] = {}
        if mm:
            per_block = _mm_keys(d, _mm_items(mm), self.block_size, first, n_blocks)
        if cache_salt and first == 0:
            per_block.setdefault(0, []).append(d.salt_extra_key(cache_salt))
        if prompt_embeds_digests is not None:
            if len(prompt_embeds_digests) < n_blocks:
                raise ValueError(
                    f"prompt_embeds_digests has {len(prompt_embeds_digests)} digests for {n_blocks} blocks"
                )
            for i in range(n_blocks):
                per_block.setdefault(i, []).append(d.prompt_embeds_extra_key(prompt_embeds_digests[i]))
        return (tuple(base) if base else None), {i: tuple(base + keys) for i, keys in per_block.items()}

    def _chain_pickle(self, parent: bytes, token_ids: Sequence[int], extras: list) -> list[bytes]:
        """``pickle.dumps`` is C and beats a hand-emitted pickle (bench_hashing.py), so it is used as is."""
        new, dumps, proto = self._new, pickle.dumps, PICKLE_PROTOCOL
        blocks = zip(*[iter(token_ids)] * self.block_size)  # full blocks as tuples, built in C
        out = []
        for tokens, extra in zip(blocks, extras):
            parent = new(dumps((parent, tokens, extra), proto)).digest()
            out.append(parent)
        return out

    def _chain_cbor(self, parent: bytes, token_ids: Sequence[int], n_blocks: int, extras: list,
                    common: tuple | None, special: dict[int, tuple]) -> list[bytes]:
        """Hand-emitted ``[parent, [tokens...], extra]`` per block; each distinct extra encoded once by cbor2."""
        size = self.block_size
        tails = [self._cbor_extra(common)] * n_blocks
        for i, keys in special.items():
            tails[i] = self._cbor_extra(keys)
        blob = _cbor_token_blob(token_ids[: n_blocks * size]) if n_blocks >= _CHAIN_NUMPY_MIN_BLOCKS else None
        if blob is None:
            return self._chain_cbor_per_block(parent, token_ids, n_blocks, extras, tails)
        data, ends = blob
        block_ends = ends[size - 1 :: size].tolist()
        new, join, head = self._new, b"".join, self._array_head
        first = (b"\x83", _cbor_head(2, len(parent)), parent, head, data[: block_ends[0]], tails[0])
        parent = new(join(first)).digest()
        out = [parent]
        lead = b"\x83" + _cbor_head(2, len(parent))
        for start, end, tail in zip(block_ends, block_ends[1:], tails[1:]):
            parent = new(join((lead, parent, head, data[start:end], tail))).digest()
            out.append(parent)
        return out

    def _chain_cbor_per_block(self, parent, token_ids, n_blocks, extras, tails) -> list[bytes]:
        size, out = self.block_size, []
        for i in range(n_blocks):
            tokens = token_ids[i * size : (i + 1) * size]
            data = self._cbor_message(parent, tokens, tails[i])
            if data is None:
                parent = _reference_hash_block(self.algo, parent, tokens, extras[i])
            else:
                parent = self._new(data).digest()
            out.append(parent)
        return out


@dataclass(frozen=True)
class _MMItem:
    identifier: str
    offset: int
    length: int


def _mm_items(mm: Sequence[Mapping[str, Any]]) -> list[_MMItem]:
    items = []
    for i, item in enumerate(mm):
        try:
            items.append(_MMItem(_require(item, "identifier", str), _require(item, "offset", int),
                                 _require(item, "length", int)))
        except (KeyError, TypeError) as e:
            raise ValueError(f"mm[{i}] needs {e.args[0]} (identifier str, offset int, length int)") from None
        if items[-1].offset < 0 or items[-1].length < 0:
            raise ValueError(f"mm[{i}] offset and length must be >= 0")
    return items


def _mm_keys(d: Dialect, items: list[_MMItem], size: int, first: int, n_blocks: int) -> dict[int, list[Any]]:
    """Multimodal keys per block (index relative to ``first``), as vLLM's ``_gen_mm_extra_hash_keys``.

    vLLM walks the items with a cursor carried from block to block starting at block 0;
    the cursor is replayed over the blocks before ``first`` so that continuing a chain
    gives the same keys as hashing the whole prompt.
    """
    inclusive = d.mm_key != "identifier"
    last_end = items[-1].offset + items[-1].length
    keys: dict[int, list[Any]] = {}
    cursor = 0
    for b in range(first + n_blocks):
        start, end = b * size, (b + 1) * size
        if last_end < start or (inclusive and last_end == start):
            break
        found: list[Any] = []
        while cursor < len(items):
            it = items[cursor]
            if end <= it.offset:
                break
            item_end = it.offset + it.length
            if start > item_end or (inclusive and start == item_end):
                cursor += 1
                continue
            found.append(d.mm_extra_key(it.identifier, it.offset - start))
            if end >= item_end:
                cursor += 1
            else:
                break
        if found and b >= first:
            keys[b - first] = found
    return keys
