"""Refuse a prompt that cannot fit ``max_model_len`` without tokenizing all of it.

The engine refuses a prompt of ``max_model_len`` tokens or more anyway, but only after the
router has tokenized it, and tokenizing is linear in the text with a large constant: a
30 MiB completion prompt was 6.3M token ids, 78 s of router work and 4 GB of memory,
for a 400 at the end. A floor on the token count settles most such prompts first:

- **bytes**: a token covers at most :attr:`LengthFloor.max_token_bytes` bytes of the
  normalized text (the longest entry of the vocabulary: 128 for Qwen3, a run of spaces),
  so ``tokens >= bytes / max_token_bytes``: no tokenizing at all, nor normalizing (what
  a normalizer can take away is bounded instead: :data:`NORMALIZED_SHRINK`);
- **a prefix**: otherwise, a text longer than :data:`CHARS_PER_TOKEN` characters per
  token of the limit has its prefix tokenized, doubled until the prefix's ids reach the
  limit or the prefix is the whole text. The prefix's ids but its last word's are the
  full text's leading ids (the argument in :mod:`router.prompt.cold`), so their count is
  a floor. The work is a bounded multiple of the limit, whatever the text's size.

A text no floor settles is tokenized in full by the caller: it is at most
``CHARS_PER_TOKEN`` characters per token of the limit, or a prefix at twice that held
fewer ids than the limit.
"""

from __future__ import annotations

from typing import Any

CHARS_PER_TOKEN = 4
"""Texts up to this many characters per token of the limit are tokenized whole without a
floor: English averages ~4.2 characters per Qwen3 token, so a prompt near the limit
rarely pays for a prefix as well, and a longer text's first prefix (this many characters
per token) decides a typical too-long prompt in one step."""


NORMALIZED_SHRINK = 4
"""A normalizer leaves at least one byte of every this many of a text that is not ASCII
(NFC composes three Hangul jamo, 9 bytes, into one syllable of 3; stripping accents
leaves 1 of ``e`` + U+0301's 3)."""


class LengthFloor:
    """One tokenizer's floors (built with it, off the event loop: it reads the vocabulary)."""

    def __init__(self, hf_tokenizer: Any, cut_outside_added: Any) -> None:
        self._backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        self._cut = cut_outside_added
        self.max_token_bytes = _max_token_bytes(hf_tokenizer) + 1  # a decoder may strip a byte (a leading space)
        added = getattr(hf_tokenizer, "added_tokens_decoder", {}) or {}
        self.by_bytes = not any(getattr(t, "lstrip", False) or getattr(t, "rstrip", False) for t in added.values())
        """An added token that strips the whitespace around it covers any amount of it: no byte floor then."""

    def at_least(self, text: str, limit: int) -> int | None:
        """A floor of at least ``limit`` on ``len(encode(text))``, or None when the text
        may have fewer tokens (special tokens only add to the count)."""
        if len(text) <= limit:
            return None  # cheaper to tokenize whole than to bound
        # Normalizing costs as much as tokenizing (1.8 s for 15 MiB): bound what it can do
        # instead. ASCII text is the same length normalized, bar whitespace a normalizer strips.
        if self.by_bytes:
            size = len(text.strip()) if text.isascii() else len(text.encode("utf-8", "surrogatepass")) // NORMALIZED_SHRINK
            by_bytes = size // self.max_token_bytes
            if by_bytes >= limit:
                return by_bytes
        if self._backend is None or len(text) <= CHARS_PER_TOKEN * limit:
            return None
        cut = CHARS_PER_TOKEN * (limit + 1)
        while cut < len(text):
            cut = self._cut(text, cut)
            enc = self._backend.encode(text[:cut], add_special_tokens=False)
            words = enc.word_ids
            last = len(words)
            while last > 0 and words[last - 1] == words[-1]:
                last -= 1
            if last >= limit:
                return last
            cut *= 2
        return None


def _max_token_bytes(hf_tokenizer: Any) -> int:
    """The most UTF-8 bytes one token decodes to (a byte that is part of a character
    decodes to U+FFFD, 3 bytes: an overestimate, so the floor stays a floor)."""
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    n = len(hf_tokenizer)
    if backend is None:
        texts = [hf_tokenizer.decode([i]) for i in range(n)]
    else:
        texts = backend.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
    return max(1, max((len(t.encode("utf-8", "surrogatepass")) for t in texts), default=1))
