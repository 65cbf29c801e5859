"""Deterministic output tokens for simulated requests.

The same prompt always yields the same output (seeded from the prompt's token ids), so
tests and repeated benchmark runs see identical traffic. Outputs are drawn from a
table of plain word tokens (``" the"``, ``" cache"``...) so that the text of a token
sequence is the concatenation of per-token pieces: streaming deltas and the final text
agree without an incremental detokenizer.

Length depends on the prompt only, so every routing policy sees the same amount of
decode work. The tokens depend on the prompt and a sampling seed: the request's
``seed``, or for ``temperature: 0`` none at all (greedy: identical prompts give
identical outputs, and identical generated blocks, as on vLLM), or else a fresh one
per request, as sampling would.

Length: with ``ignore_eos`` the request runs to ``max_tokens``; otherwise a natural
length is drawn (exponential, mean ``mean_output_tokens``), kept within
``[min_tokens, max_tokens]``. A natural stop ends with the EOS token, which counts in
``completion_tokens`` but has no text, like vLLM.
"""

from __future__ import annotations

import random
import re
from array import array
from dataclasses import dataclass

import xxhash

_WORD = re.compile(r"^ [a-z]{2,9}$")
_SCAN = range(256, 40_000)
_MAX_WORDS = 1024


@dataclass(frozen=True, slots=True)
class PlannedOutput:
    token_ids: list[int]
    finish_reason: str
    """``"stop"`` (natural end, last token is EOS) or ``"length"`` (hit max_tokens)."""


class OutputGenerator:
    def __init__(self, tokenizer: object, mean_output_tokens: float = 128.0) -> None:
        decode = tokenizer.decode  # type: ignore[attr-defined]
        pieces: dict[int, str] = {}
        for tid in _SCAN:
            text = decode([tid])
            if _WORD.match(text):
                pieces[tid] = text
                if len(pieces) >= _MAX_WORDS:
                    break
        if not pieces:
            raise ValueError("tokenizer has no plain word tokens to generate from")
        self.pieces = pieces
        self.words = list(pieces)
        self.eos_token_id: int | None = getattr(tokenizer, "eos_token_id", None)
        self.mean_output_tokens = mean_output_tokens

    def plan(
        self, prompt_ids: list[int], max_tokens: int, min_tokens: int = 0, ignore_eos: bool = False,
        sample_seed: int | None = None,
    ) -> PlannedOutput:
        prompt_seed = xxhash.xxh64_intdigest(array("q", prompt_ids).tobytes())
        rng = random.Random(prompt_seed)
        natural = self._natural_length(rng, max_tokens, min_tokens, ignore_eos)
        n = min(natural, max_tokens)
        if sample_seed is not None:
            rng = random.Random(prompt_seed ^ sample_seed)
        ids = rng.choices(self.words, k=n)
        if natural <= max_tokens and not ignore_eos and self.eos_token_id is not None:
            ids[-1] = self.eos_token_id
            return PlannedOutput(ids, "stop")
        return PlannedOutput(ids, "length")

    def planned_length(self, prompt_ids: list[int], max_tokens: int, min_tokens: int = 0, ignore_eos: bool = False) -> int:
        """``len(plan(...).token_ids)`` without drawing the tokens (the length depends on the prompt only)."""
        rng = random.Random(xxhash.xxh64_intdigest(array("q", prompt_ids).tobytes()))
        return min(self._natural_length(rng, max_tokens, min_tokens, ignore_eos), max_tokens)

    def _natural_length(self, rng: random.Random, max_tokens: int, min_tokens: int, ignore_eos: bool) -> int:
        if ignore_eos or self.eos_token_id is None:
            return max_tokens
        return max(1, min_tokens, 1 + int(rng.expovariate(1.0 / self.mean_output_tokens)))

    def text(self, token_ids: list[int]) -> str:
        pieces = self.pieces
        return "".join(pieces.get(t, "") for t in token_ids)
