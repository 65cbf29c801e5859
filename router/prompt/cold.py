"""Route a never-seen prompt on its first block, before the whole prompt is tokenized.

Tokenizing is most of what the router costs (1.3-1.8 µs per token: ~7 ms for a cold
4k-token prompt, ~55 ms for 32k), but for a prompt whose *first* block no backend holds
it decides nothing: vLLM's prefix hashes are chained, so a backend that lacks block 0
matches zero blocks, every backend ties on the cache, and the policy chooses by load.
So the router tokenizes only a short prefix of the text, hashes block 0 and looks it
up; when nobody holds it (nor the router's own recent decisions), the request is sent
at once and the full tokenization, hashing, speculative insertion and exact load
accounting finish in the background (:class:`router.plans.ColdHead` routes it,
:mod:`router.settle` finishes it).

The first ``n`` ids from a prefix are exact by construction: HF tokenizers cut the text
at added tokens, then split it into pre-tokens (words) with a left-to-right regex, and
BPE each word on its own. Cutting the text can only change the word that touches the
cut (a regex match that reads to the end, a whitespace run, a character the normalizer
would have composed with the next one), so dropping that last word leaves ids that
the full text produces too. A cut never falls inside an added token's text. Every
deferred request later compares these ids with its full tokenization; a mismatch is
counted and turns the probe off for the model, like the segment cache's check.

The same holds for the new turn of a conversation the router has seen. The segment
cache (:meth:`PromptTokenizer.scan`) gives the exact ids of the history, every segment
up to the first one it lacks; a backend cannot hold blocks past that point unless the
new text was sent before, and this router tokenized none of it lately. So the request is
routed on the history's blocks (outcome ``tail``, :class:`router.plans.SeenTail`) and
the new turn, at most the tuning's ``inline_tokenize_bytes`` (router/tuning.py) characters of it, is tokenized in
the background like a cold prompt's rest. Longer unseen tails take the probe or the full path: the cost of a miss grows
with them, and a text sent through another router replica would be one.

The router must still refuse prompts longer than ``max_model_len`` before sending
them. Deferral therefore needs a bound that holds without tokenizing: with a byte-level
BPE every token covers at least one byte of the normalized text, so ``tokens <=
bytes + special tokens``. Tokenizers without a byte-level pre-tokenizer, and prompts
the bound cannot clear, take the full path.
"""

from __future__ import annotations

import json
import logging

from prometheus_client import Counter

from router.prompt.tokenize import PromptTokenizer

log = logging.getLogger(__name__)

PROBE_CHARS = 256
"""First prefix tried; doubled until it yields a whole block (long words, CJK, runs of
whitespace need more), up to :data:`MAX_PROBE_CHARS`."""

MAX_PROBE_CHARS = 8192

HEAD_CHECKS = Counter(
    "kvrouter_cold_head_checks_total",
    "Deferred requests whose first-block ids were compared with their full tokenization",
    ["model"],
)
HEAD_MISMATCHES = Counter(
    "kvrouter_cold_head_mismatches_total",
    "First-block ids from a text prefix that differed from the full tokenization (probe then disabled)",
    ["model"],
)


class HeadProbe:
    """One model's first-block probe: exact leading ids of a prompt from a prefix of it."""

    def __init__(self, tokenizer: PromptTokenizer, model: str | None = None) -> None:
        self.tok = tokenizer
        self.model = model or tokenizer.name
        self.disabled_reason: str | None = self._unsupported()

    @property
    def enabled(self) -> bool:
        return self.disabled_reason is None and self.tok.segment_enabled

    def _unsupported(self) -> str | None:
        backend = self.tok.backend
        if backend is None:
            return "tokenizer has no tokenizers backend"
        spec = json.loads(backend.to_str())
        if "ByteLevel" not in json.dumps(spec.get("pre_tokenizer")):
            return "not a byte-level BPE: no token-count bound from the text's length"
        return None

    def max_tokens(self, text: str, add_special: bool) -> int:
        """An upper bound on ``len(encode(text, add_special))`` (see the module docstring)."""
        normalizer = self.tok.backend.normalizer
        normalized = normalizer.normalize_str(text) if normalizer is not None else text
        return len(normalized.encode("utf-8", "surrogatepass")) + (self.tok.special_count if add_special else 0)

    def head_ids(self, text: str, add_special: bool, n: int) -> tuple[list[int], float] | None:
        """The first ``n`` ids of ``encode(text, add_special)`` and the prefix's tokens per
        character (to estimate the whole prompt's length), or None if no prefix up to
        :data:`MAX_PROBE_CHARS` gives them."""
        prefix = self.tok.special_prefix if add_special else []
        if prefix is None:
            return None
        encode = self.tok.backend.encode
        cut = PROBE_CHARS
        while cut < len(text) and cut <= MAX_PROBE_CHARS:
            cut = self.tok.cut_outside_added(text, cut)
            enc = encode(text[:cut], add_special_tokens=False)
            ids, words = enc.ids, enc.word_ids
            last = len(ids)
            while last > 0 and words[last - 1] == words[-1]:
                last -= 1
            if len(prefix) + last >= n:
                return [*prefix, *ids[:last]][:n], len(ids) / cut
            cut *= 2
        return None

    def check(self, head: list[int], full: list[int]) -> bool:
        """Compare a deferred request's probed ids with its full ids; disable on a mismatch."""
        HEAD_CHECKS.labels(self.model).inc()
        if full[: len(head)] == head:
            return True
        HEAD_MISMATCHES.labels(self.model).inc()
        self.disabled_reason = "runtime check found a prefix/full first-block mismatch"
        log.warning("tokenizer %s: first-block ids from a text prefix differ from full tokenization; "
                    "cold-prompt deferral disabled", self.model)
        return False


__all__ = ["HeadProbe"]
