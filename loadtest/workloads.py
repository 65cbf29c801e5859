"""Workloads: what a replay sends, when, and in which session, deterministic from a seed.

A workload is a list of :class:`Session` objects. A session's first turn arrives at
``start_s`` on the *trace clock*; each later turn is sent only after the previous
turn's answer came back, plus its ``think_s``. Single-request traces (Mooncake,
synthetic, JSONL) are sessions of one turn. Bodies are OpenAI request bodies without
``model`` and ``stream`` (the replayer sets those).

Four sources:

* **Mooncake FAST'25** (``{"timestamp" ms, "input_length", "output_length",
  "hash_ids"}``): every ``hash_id`` names one 512-token block. Each id becomes one
  fixed pseudo-random block (seeded by ``(seed, hash_id)``), reused wherever the id
  appears, so shared ids become shared token prefixes exactly as in production. The
  prompt is the concatenation of the request's blocks cut to ``input_length``. It is
  sent to ``/v1/completions`` as a **token-id list** by default: vLLM accepts it, the
  engines and the router skip tokenization, and the block structure reaches the engine
  byte for byte. ``prompt_form="text"`` sends the decoded text instead; the blocks are
  drawn from whole-word tokens that re-encode to themselves, so the text tokenizes back
  to exactly the same ids (tested) and exercises tokenization on the way.
* **ShareGPT multi-turn** (``[{"id", "conversations": [{"from", "value"}]}]``): one
  chat session per conversation, its history growing turn by turn. The assistant
  messages in the history are the *recorded* answers, not the generated ones, so every
  policy sees byte-identical prompts (a fair comparison); ``max_tokens`` is the
  recorded answer's token count. Sessions start as a Poisson process and pause an
  exponential think time between turns.
* **Synthetic shared prefix**: ``groups`` system prompts x ``questions`` each, plus
  RAG-style documents drawn (skewed towards popular ones) from a shared pool.
* **Native JSONL**: one OpenAI body per line; optional ``timestamp`` (seconds) and
  ``session_id`` keys are taken out of the body. Bodies with ``messages`` go to chat.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MOONCAKE_BLOCK_TOKENS = 512
DATA_DIR = Path(__file__).resolve().parent / "data"
DEFAULT_TOKENIZER = DATA_DIR / "tokenizers" / "qwen3"

Format = Literal["mooncake", "sharegpt", "jsonl", "synthetic", "mixed"]
FORMATS: tuple[str, ...] = ("mooncake", "sharegpt", "jsonl", "synthetic", "mixed")


class WorkloadError(ValueError):
    """The trace cannot be read or holds no usable request."""


@dataclass(frozen=True, slots=True)
class Turn:
    path: str
    body: dict[str, Any]
    think_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Session:
    session_id: str
    start_s: float
    turns: tuple[Turn, ...]


@dataclass(slots=True)
class Workload:
    """Sessions sorted by start; ``skipped`` counts input records that were unusable."""

    name: str
    sessions: list[Session]
    skipped: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    @property
    def duration_s(self) -> float:
        """The span of the requests' arrivals on the trace clock, each turn arriving its think
        time after the one before as if answers took no time (a session's later turns count:
        starts alone understate a multi-turn workload's span and overstate its rate)."""
        if not self.sessions:
            return 0.0
        first = self.sessions[0].start_s
        return max(s.start_s + sum(t.think_s for t in s.turns[1:]) for s in self.sessions) - first

    @property
    def arrival_rate(self) -> float:
        """Requests per trace-clock second over :attr:`duration_s` (0 if a single instant): the
        rate offered to a fleet that answers at once; a slower one sees a session's next turn later."""
        span = self.duration_s
        return self.num_requests / span if span > 0 else 0.0

    def head(self, max_requests: int | None) -> Workload:
        """The first ``max_requests`` requests in session-start order (the last session may be cut)."""
        if max_requests is None or max_requests >= self.num_requests:
            return self
        out: list[Session] = []
        left = max_requests
        for s in self.sessions:
            if left <= 0:
                break
            out.append(s if len(s.turns) <= left else replace(s, turns=s.turns[:left]))
            left -= len(out[-1].turns)
        return replace(self, sessions=out)

    def rate_scaled(self, rate_scale: float) -> Workload:
        """The trace's clock run ``rate_scale`` times faster: session starts *and* think times
        divided by it, so the arrival rate is multiplied by it. Compressing starts alone leaves
        each session's chain of think times as long as it was: past a point the sessions all
        overlap, and a 3x "rate" offered a multi-turn workload 1.4x its requests per second.
        The cost of a faster clock: a session's next turn comes sooner, so its cache has less
        time to be evicted, as in any trace replayed faster."""
        if rate_scale <= 0:
            raise WorkloadError(f"rate scale must be > 0, got {rate_scale}")
        if rate_scale == 1.0 or not self.sessions:
            return self
        t0 = self.sessions[0].start_s
        scaled = [replace(s, start_s=t0 + (s.start_s - t0) / rate_scale,
                          turns=tuple(replace(t, think_s=t.think_s / rate_scale) for t in s.turns))
                  for s in self.sessions]
        return replace(self, sessions=scaled)

    def turns(self) -> Iterator[Turn]:
        for s in self.sessions:
            yield from s.turns


# -- token material -----------------------------------------------------------------


@lru_cache(maxsize=4)
def word_vocab(tokenizer_path: str = str(DEFAULT_TOKENIZER)) -> tuple[int, ...]:
    """Ids of whole-word tokens (``" word"``) that encode back to themselves alone.

    A sequence of such tokens decodes to ``" w1 w2 ..."`` and the pre-tokenizer splits
    that text at the spaces into the very same tokens, so text prompts built from them
    tokenize to exactly the ids that were drawn.
    """
    tok = _hf_tokenizer(str(tokenizer_path))
    word = re.compile(r"Ġ[a-z]{3,9}")
    cand = sorted(i for s, i in tok.get_vocab().items() if word.fullmatch(s))
    texts = [tok.decode([i]) for i in cand]
    ok = tuple(i for i, enc in zip(cand, tok.encode_batch(texts, add_special_tokens=False)) if enc.ids == [i])
    if len(ok) < 1000:
        raise WorkloadError(f"tokenizer {tokenizer_path} has too few whole-word tokens ({len(ok)}) for random text")
    return ok


class TokenSource:
    """Deterministic pseudo-random token blocks and texts drawn from :func:`word_vocab`."""

    def __init__(self, seed: int, tokenizer_path: str | Path = DEFAULT_TOKENIZER) -> None:
        self.seed = seed
        self.tokenizer_path = str(tokenizer_path)
        self.vocab = word_vocab(self.tokenizer_path)
        self._tok: Any = None

    def block(self, key: object, n: int) -> list[int]:
        """``n`` ids fixed by ``(seed, key)``: the same key always yields the same block."""
        rng = random.Random(f"{self.seed}/{key}")
        return rng.choices(self.vocab, k=n)

    def decode(self, ids: list[int]) -> str:
        if self._tok is None:
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_file(str(Path(self.tokenizer_path) / "tokenizer.json"))
        return self._tok.decode(ids)

    def text(self, key: object, n: int) -> str:
        """Text of exactly ``n`` tokens (leading space included), fixed by ``(seed, key)``."""
        return self.decode(self.block(key, n)).lstrip()


# -- Mooncake -------------------------------------------------------------------------


def load_mooncake(
    path: str | Path,
    *,
    seed: int = 0,
    length_scale: float = 1.0,
    output_scale: float = 1.0,
    prompt_form: Literal["ids", "text"] = "ids",
    tokenizer_path: str | Path = DEFAULT_TOKENIZER,
    max_requests: int | None = None,
) -> Workload:
    """A Mooncake trace as single-turn completions (see the module docstring).

    ``length_scale`` shrinks every 512-token block (and ``input_length``) alike, so
    sharing between requests is kept at any scale; ``output_scale`` scales outputs.
    """
    if length_scale <= 0 or output_scale <= 0:
        raise WorkloadError("length and output scales must be > 0")
    src = TokenSource(seed, tokenizer_path)
    block_tokens = max(1, round(MOONCAKE_BLOCK_TOKENS * length_scale))
    sessions: list[Session] = []
    skipped = 0
    for lineno, rec in _jsonl_records(path, max_requests):
        try:
            ts = float(rec["timestamp"]) / 1000.0
            n_in = int(rec["input_length"])
            n_out = int(rec["output_length"])
            ids = [int(h) for h in rec["hash_ids"]]
        except (KeyError, TypeError, ValueError):
            skipped += 1
            continue
        if n_in <= 0 or not ids:
            skipped += 1
            continue
        n_in = max(1, min(round(n_in * length_scale), len(ids) * block_tokens))
        prompt: list[int] = []
        for h in ids:
            prompt.extend(src.block(("mooncake", h), block_tokens))
            if len(prompt) >= n_in:
                break
        prompt = prompt[:n_in]
        body: dict[str, Any] = {
            "prompt": prompt if prompt_form == "ids" else src.decode(prompt),
            "max_tokens": max(1, round(n_out * output_scale)),
            "ignore_eos": True,
            "temperature": 0.0,
        }
        sessions.append(Session(f"mc-{lineno}", ts, (Turn(COMPLETIONS, body),)))
    return _finish("mooncake", sessions, skipped, path)


# -- ShareGPT -------------------------------------------------------------------------


def load_sharegpt(
    path: str | Path,
    *,
    seed: int = 0,
    session_rate: float = 1.0,
    think_s: float = 5.0,
    max_output_tokens: int = 1024,
    max_context_tokens: int = 16384,
    system_prompt: str | None = None,
    tokenizer_path: str | Path = DEFAULT_TOKENIZER,
    max_requests: int | None = None,
) -> Workload:
    """ShareGPT conversations as multi-turn chat sessions (see the module docstring).

    A conversation stops before the turn whose history would pass
    ``max_context_tokens`` (counted on message contents, template tokens aside).
    """
    if session_rate <= 0 or think_s < 0:
        raise WorkloadError("session rate must be > 0 and think time >= 0")
    data = _read_json(path, "ShareGPT file")
    if not isinstance(data, list):
        raise WorkloadError(f"{path}: expected a JSON list of conversations")
    tok = _hf_tokenizer(str(tokenizer_path))
    rng = random.Random(seed)
    sessions: list[Session] = []
    skipped = 0
    t = 0.0
    total = 0
    for conv in data:
        if max_requests is not None and total >= max_requests:
            break
        pairs = _sharegpt_pairs(conv)
        if not pairs:
            skipped += 1
            continue
        history: list[dict[str, str]] = [{"role": "system", "content": system_prompt}] if system_prompt else []
        context = sum(len(tok.encode(m["content"]).ids) for m in history)
        turns: list[Turn] = []
        for human, gpt in pairs:
            n_human = len(tok.encode(human).ids)
            n_gpt = len(tok.encode(gpt).ids)
            if context + n_human + min(n_gpt, max_output_tokens) > max_context_tokens:
                break
            messages = [*history, {"role": "user", "content": human}]
            body = {"messages": messages, "max_tokens": max(1, min(n_gpt, max_output_tokens)),
                    "ignore_eos": True, "temperature": 0.0}
            turns.append(Turn(CHAT, body, rng.expovariate(1.0 / think_s) if turns and think_s > 0 else 0.0))
            history = [*messages, {"role": "assistant", "content": gpt}]
            context += n_human + n_gpt
        if not turns:
            skipped += 1
            continue
        sessions.append(Session(f"sg-{conv.get('id', len(sessions))}", t, tuple(turns)))
        total += len(turns)
        t += rng.expovariate(session_rate)
    return _finish("sharegpt", sessions, skipped, path).head(max_requests)


def _sharegpt_pairs(conv: Any) -> list[tuple[str, str]]:
    """(human, gpt) pairs from the start of a conversation; stops at the first irregular turn."""
    if not isinstance(conv, dict) or not isinstance(conv.get("conversations"), list):
        return []
    msgs = conv["conversations"]
    pairs: list[tuple[str, str]] = []
    for i in range(0, len(msgs) - 1, 2):
        a, b = msgs[i], msgs[i + 1]
        if not (isinstance(a, dict) and isinstance(b, dict)):
            break
        if a.get("from") != "human" or b.get("from") != "gpt":
            break
        if not isinstance(a.get("value"), str) or not isinstance(b.get("value"), str) or not a["value"] or not b["value"]:
            break
        pairs.append((a["value"], b["value"]))
    return pairs


# -- synthetic shared prefix ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SyntheticSpec:
    """G system prompts x P questions, each with ``docs_per_request`` shared documents.

    Documents are drawn from a pool of ``num_docs`` with Zipf-like popularity
    (weight 1/rank^``doc_skew``), the way RAG retrieval reuses a few hot documents.
    """

    groups: int = 8
    questions: int = 25
    prefix_tokens: int = 2048
    suffix_tokens: int = 128
    num_docs: int = 32
    docs_per_request: int = 2
    doc_tokens: int = 512
    doc_skew: float = 1.0
    output_tokens: int = 128
    rate: float = 4.0

    @classmethod
    def from_file(cls, path: str | Path) -> SyntheticSpec:
        """Read a JSON object of fields; ``default`` (or an empty path) gives the defaults."""
        raw = _spec_object(path, "synthetic spec")
        if raw is None:
            return cls()
        unknown = sorted(set(raw) - set(cls.__dataclass_fields__))
        if unknown:
            raise WorkloadError(f"{path}: unknown synthetic spec keys {unknown}")
        try:
            spec = cls(**raw)
        except TypeError as e:
            raise WorkloadError(f"{path}: {e}") from e
        spec.validate()
        return spec

    def validate(self) -> None:
        ints = ("groups", "questions", "prefix_tokens", "suffix_tokens", "output_tokens")
        if any(not isinstance(getattr(self, k), int) or getattr(self, k) < 1 for k in ints):
            raise WorkloadError(f"synthetic spec: {', '.join(ints)} must be integers >= 1")
        if self.docs_per_request < 0 or self.docs_per_request > self.num_docs:
            raise WorkloadError("synthetic spec: need 0 <= docs_per_request <= num_docs")
        if self.rate <= 0:
            raise WorkloadError("synthetic spec: rate must be > 0")


def synthetic(
    spec: SyntheticSpec = SyntheticSpec(),
    *,
    seed: int = 0,
    tokenizer_path: str | Path = DEFAULT_TOKENIZER,
    max_requests: int | None = None,
) -> Workload:
    """Shared-prefix chat requests in a seeded random order, Poisson arrivals at ``spec.rate``."""
    spec.validate()
    src = TokenSource(seed, tokenizer_path)
    rng = random.Random(seed)
    systems = [src.text(("system", g), spec.prefix_tokens) for g in range(spec.groups)]
    docs = [src.text(("doc", d), spec.doc_tokens) for d in range(spec.num_docs)]
    weights = [1.0 / (r + 1) ** spec.doc_skew for r in range(spec.num_docs)]
    order = [(g, q) for g in range(spec.groups) for q in range(spec.questions)]
    rng.shuffle(order)
    sessions: list[Session] = []
    t = 0.0
    for g, q in order[:max_requests] if max_requests is not None else order:
        chosen = _weighted_sample(rng, spec.num_docs, weights, spec.docs_per_request)
        parts = [f"Document {d}:\n{docs[d]}" for d in chosen]
        parts.append(f"Question: {src.text(('question', g, q), spec.suffix_tokens)}")
        body = {
            "messages": [{"role": "system", "content": systems[g]}, {"role": "user", "content": "\n\n".join(parts)}],
            "max_tokens": spec.output_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
        }
        sessions.append(Session(f"syn-{g}-{q}", t, (Turn(CHAT, body),)))
        t += rng.expovariate(spec.rate)
    return _finish("synthetic", sessions, 0, "synthetic")


def _weighted_sample(rng: random.Random, n: int, weights: list[float], k: int) -> list[int]:
    """``k`` distinct indices, drawn without replacement by weight, in ascending order.

    Sorting puts shared documents in a canonical order so two requests citing the same
    documents share the longest possible prefix.
    """
    keys = sorted(range(n), key=lambda i: -math.log(rng.random() or 1e-300) / weights[i])
    return sorted(keys[:k])


# -- mixed agentic and multi-tenant traffic --------------------------------------------

TUNING_SEEDS: tuple[int, ...] = (0, 1, 2, 3, 4)
"""Seeds of the mixed workload that policies and their weights may be tuned on (0 is the default)."""
HELD_OUT_SEEDS: tuple[int, ...] = (1001, 1002, 1003, 1004, 1005)
"""Seeds of the mixed workload kept for measurement: report these only, never tune on them."""
MIXED_KINDS = ("chat", "agent", "rag", "oneoff")
TENANT_MARK = "@"
"""Separates a session id from its tenant's name (``mx-chat-7@tenant-0``; ``noisy_tenant`` only)."""


def tenant_of(session_id: str) -> str | None:
    """The tenant a session id names, if any."""
    return session_id.rpartition(TENANT_MARK)[2] if TENANT_MARK in session_id else None


def without_tenant(wl: Workload, tenant: str) -> Workload:
    """``wl`` less the sessions of ``tenant``: the other tenants' traffic as it would be without it."""
    kept = [s for s in wl.sessions if tenant_of(s.session_id) != tenant]
    if len(kept) == len(wl.sessions):
        raise WorkloadError(f"no session of tenant {tenant!r} to leave out (the mixed workload names tenants with --mix noisy_tenant=X)")
    return replace(wl, sessions=kept, name=f"{wl.name} without {tenant}")


def seed_set(seed: int) -> str:
    """``held-out``, ``tuning`` or ``other``: which of the mixed workload's fixed seed sets ``seed`` is in."""
    return "held-out" if seed in HELD_OUT_SEEDS else "tuning" if seed in TUNING_SEEDS else "other"


@dataclass(frozen=True, slots=True)
class MixedSpec:
    """Knobs of :func:`mixed`: the mix, the context lengths, the burstiness.

    Lengths are means in tokens (each draw is log-normal around it, times
    ``length_scale``). ``chat``, ``agent``, ``rag`` and ``oneoff`` are the *request*
    fractions of each kind (normalised; multi-turn kinds start proportionally fewer
    sessions). Sessions start as a Poisson process at ``rate`` per second that spends
    ``burst_fraction`` of the time in bursts (mean ``burst_s`` long) at ``burst_factor``
    times the rate.
    """

    requests: int = 600
    chat: float = 0.35
    agent: float = 0.25
    rag: float = 0.25
    oneoff: float = 0.15
    tenants: int = 12
    tenant_skew: float = 1.0
    noisy_tenant: float = 0.0
    """Above 0: every session belongs to a tenant, named in its body's ``user`` (what the router's
    queue takes turns between) and in its session id (``...@tenant-N``), and ``tenant-0`` starts
    this many times the sessions of each other tenant (uniform among themselves), a noisy
    neighbour. 0: tenants by Zipf popularity (``tenant_skew``), chats and RAG only, unnamed."""
    system_tokens: int = 1024
    chat_turns: float = 4.0
    user_tokens: int = 200
    answer_tokens: int = 200
    think_s: float = 8.0
    max_context_tokens: int = 24576
    agent_system_tokens: int = 1536
    contexts: int = 6
    context_tokens: int = 8192
    context_skew: float = 1.0
    agent_steps: float = 6.0
    task_tokens: int = 150
    tool_tokens: int = 400
    agent_output_tokens: int = 120
    agent_think_s: float = 1.0
    docs: int = 200
    doc_tokens: int = 600
    doc_skew: float = 1.1
    docs_per_request: int = 3
    question_tokens: int = 60
    rag_output_tokens: int = 150
    oneoff_tokens: int = 1500
    oneoff_output_tokens: int = 200
    rate: float = 1.0
    burst_factor: float = 4.0
    burst_fraction: float = 0.15
    burst_s: float = 20.0
    length_scale: float = 1.0
    form: Literal["ids", "chat"] = "ids"
    """``ids``: ``/v1/completions`` with token-id prompts, segments concatenated (no template
    to tokenize: the routing, not the tokenizer, is measured); ``chat``: the same structure
    as chat messages in text."""

    @classmethod
    def from_file(cls, path: str | Path) -> MixedSpec:
        """A JSON object of fields; ``default`` (or an empty path) gives the defaults."""
        raw = _spec_object(path, "mixed workload spec")
        return cls() if raw is None else cls.with_overrides(raw, str(path))

    @classmethod
    def with_overrides(cls, raw: dict[str, Any], source: str = "mixed workload", base: MixedSpec | None = None) -> MixedSpec:
        """``base`` (the defaults) with ``raw``'s fields; strings (from the command line) are parsed."""
        unknown = sorted(set(raw) - set(cls.__dataclass_fields__))
        if unknown:
            raise WorkloadError(f"{source}: unknown mixed workload keys {unknown}")
        base = base or cls()
        values: dict[str, Any] = {}
        for k, v in raw.items():
            try:
                values[k] = _coerce(type(getattr(base, k)), v)
            except (TypeError, ValueError) as e:
                raise WorkloadError(f"{source}: {k}={v!r}: {e}") from e
        spec = replace(base, **values)
        spec.validate()
        return spec

    def validate(self) -> None:
        positive = ("requests", "tenants", "system_tokens", "user_tokens", "answer_tokens", "max_context_tokens",
                    "agent_system_tokens", "contexts", "context_tokens", "task_tokens", "tool_tokens",
                    "agent_output_tokens", "docs", "doc_tokens", "question_tokens", "rag_output_tokens",
                    "oneoff_tokens", "oneoff_output_tokens", "rate", "burst_s", "length_scale", "chat_turns",
                    "agent_steps", "burst_factor")
        bad = [k for k in positive if not getattr(self, k) > 0]
        if bad:
            raise WorkloadError(f"mixed workload: {', '.join(bad)} must be > 0")
        fractions = [getattr(self, k) for k in MIXED_KINDS]
        if any(f < 0 for f in fractions) or sum(fractions) <= 0:
            raise WorkloadError("mixed workload: the fractions chat, agent, rag, oneoff must be >= 0, not all 0")
        if not 0 <= self.burst_fraction < 1:
            raise WorkloadError("mixed workload: burst_fraction must be within [0, 1)")
        if self.chat_turns < 1 or self.agent_steps < 1:
            raise WorkloadError("mixed workload: chat_turns and agent_steps are means of at least 1")
        if not 0 <= self.docs_per_request <= self.docs:
            raise WorkloadError("mixed workload: need 0 <= docs_per_request <= docs")
        if min(self.think_s, self.agent_think_s, self.tenant_skew, self.context_skew, self.doc_skew, self.noisy_tenant) < 0:
            raise WorkloadError("mixed workload: think times, skews and noisy_tenant must be >= 0")
        if self.form not in ("ids", "chat"):
            raise WorkloadError("mixed workload: form is ids or chat")


def _coerce(kind: type, v: Any) -> Any:
    if kind is str:
        return str(v)
    number = float(v) if isinstance(v, str) else v
    if kind is int:
        if isinstance(number, bool) or number != int(number):
            raise ValueError("not an integer")
        return int(number)
    return float(number)


def mixed(
    spec: MixedSpec = MixedSpec(),
    *,
    seed: int = 0,
    tokenizer_path: str | Path = DEFAULT_TOKENIZER,
    max_requests: int | None = None,
) -> Workload:
    """Mixed agentic and multi-tenant traffic, everything drawn from ``seed``.

    Four kinds of session, each starting at a bursty Poisson arrival:

    * **chat**: a tenant's conversation (tenants by Zipf popularity, each with its own
      system prompt), its history growing turn by turn with recorded answers, think
      times between turns, until ``max_context_tokens``;
    * **agent**: a loop over a long shared context (a repository, a manual: one of
      ``contexts``, Zipf-popular) behind one agent system prompt; each step appends the
      agent's action and a tool's output and goes again after a short tool latency;
    * **rag**: a tenant's system prompt, ``docs_per_request`` documents retrieved from a
      Zipf-skewed pool (in canonical order, so shared documents share a prefix), a question;
    * **oneoff**: a prompt nobody else sends.

    Use :data:`TUNING_SEEDS` to tune and report :data:`HELD_OUT_SEEDS` only.
    """
    spec.validate()
    n_requests = max_requests if max_requests is not None else spec.requests
    rng = random.Random(f"mixed/{seed}")
    src = TokenSource(seed, tokenizer_path)
    gen = _MixedGen(spec, rng, src)
    sessions: list[Session] = []
    total = 0
    for start in _bursty_arrivals(spec, rng):
        if total >= n_requests:
            break
        kind = gen.kind()
        turns = gen.session(kind, len(sessions))
        tenant = f"{TENANT_MARK}{gen.user}" if gen.user is not None else ""
        sessions.append(Session(f"mx-{kind}-{len(sessions)}{tenant}", start, turns))
        total += len(turns)
    wl = _finish("mixed", sessions, 0, "mixed")
    wl.name = f"mixed (seed {seed}, {seed_set(seed)})"
    return wl.head(n_requests)


def _bursty_arrivals(spec: MixedSpec, rng: random.Random) -> Iterator[float]:
    """Session starts: Poisson at ``rate``, switching to ``burst_factor x rate`` for exponential
    bursts of mean ``burst_s`` that take ``burst_fraction`` of the time (a two-state MMPP)."""
    calm_s = spec.burst_s * (1 - spec.burst_fraction) / spec.burst_fraction if spec.burst_fraction > 0 else math.inf
    t = 0.0
    bursting = False
    regime_end = rng.expovariate(1 / calm_s) if math.isfinite(calm_s) else math.inf
    while True:
        rate = spec.rate * (spec.burst_factor if bursting else 1.0)
        t_next = t + rng.expovariate(rate)
        if t_next < regime_end:
            t = t_next
            yield t
            continue
        t = regime_end
        bursting = not bursting
        regime_end = t + rng.expovariate(1 / (spec.burst_s if bursting else calm_s))


class _MixedGen:
    """The token material and sessions of :func:`mixed` (one instance per workload)."""

    def __init__(self, spec: MixedSpec, rng: random.Random, src: TokenSource) -> None:
        self.spec = spec
        self.rng = rng
        self.src = src
        mean_turns = {"chat": spec.chat_turns, "agent": spec.agent_steps, "rag": 1.0, "oneoff": 1.0}
        self.kind_weights = [getattr(spec, k) / mean_turns[k] for k in MIXED_KINDS]
        self.tenant_weights = ([spec.noisy_tenant] + [1.0] * (spec.tenants - 1) if spec.noisy_tenant > 0 else
                               [1.0 / (r + 1) ** spec.tenant_skew for r in range(spec.tenants)])
        self.user: str | None = None
        """The tenant of the session being built, named in its bodies (``noisy_tenant`` only)."""
        self.context_weights = [1.0 / (r + 1) ** spec.context_skew for r in range(spec.contexts)]
        self.doc_weights = [1.0 / (r + 1) ** spec.doc_skew for r in range(spec.docs)]
        self.system_len = [self.length(spec.system_tokens) for _ in range(spec.tenants)]
        self.agent_system_len = self.length(spec.agent_system_tokens)
        self.context_len = [self.length(spec.context_tokens) for _ in range(spec.contexts)]
        self.doc_len = [self.length(spec.doc_tokens) for _ in range(spec.docs)]

    def kind(self) -> str:
        return self.rng.choices(MIXED_KINDS, weights=self.kind_weights)[0]

    def length(self, mean: float) -> int:
        """A log-normal draw with mean ``mean x length_scale`` (sigma 0.5), at least 1."""
        return max(1, round(mean * self.spec.length_scale * self.rng.lognormvariate(-0.125, 0.5)))

    def count(self, mean: float) -> int:
        """A geometric draw >= 1 with mean ``mean`` (turns, steps)."""
        return 1 + int(math.log(self.rng.random() or 1e-12) / math.log(1 - 1 / mean)) if mean > 1 else 1

    def segment(self, key: tuple[Any, ...], n: int) -> Any:
        """Fixed token material for ``key``: ids (form ``ids``) or text of exactly ``n`` tokens."""
        return self.src.block(key, n) if self.spec.form == "ids" else self.src.text(key, n)

    def session(self, kind: str, sid: int) -> tuple[Turn, ...]:
        s, rng = self.spec, self.rng
        t = rng.choices(range(s.tenants), weights=self.tenant_weights)[0] if kind in ("chat", "rag") or s.noisy_tenant > 0 else 0
        self.user = f"tenant-{t}" if s.noisy_tenant > 0 else None
        if kind == "chat":
            prefix = [("system", self.segment(("tenant", t), self.system_len[t]))]
            return self._dialogue(prefix, sid, self.count(s.chat_turns), s.user_tokens, s.answer_tokens, s.think_s)
        if kind == "agent":
            c = rng.choices(range(s.contexts), weights=self.context_weights)[0]
            shared = self.segment(("agent-system",), self.agent_system_len)
            context = self.segment(("context", c), self.context_len[c])
            prefix = [("system", shared), ("user", context)]
            return self._dialogue(prefix, sid, self.count(s.agent_steps), s.tool_tokens, s.agent_output_tokens,
                                  s.agent_think_s, first=s.task_tokens)
        if kind == "rag":
            docs = _weighted_sample(rng, s.docs, self.doc_weights, s.docs_per_request)
            parts = [("system", self.segment(("tenant", t), self.system_len[t]))]
            parts += [("user", self.segment(("doc", d), self.doc_len[d])) for d in docs]
            parts.append(("user", self.segment(("question", sid), self.length(s.question_tokens))))
            return (self._turn(parts, self.length(s.rag_output_tokens)),)
        parts = [("user", self.segment(("oneoff", sid), self.length(s.oneoff_tokens)))]
        return (self._turn(parts, self.length(s.oneoff_output_tokens)),)

    def _dialogue(self, prefix: list[tuple[str, Any]], sid: int, n_turns: int, in_tokens: int, out_tokens: int,
                  think_s: float, first: int | None = None) -> tuple[Turn, ...]:
        """Turns over a growing history: each turn adds a user (or tool) message and, once
        answered, the recorded answer; stops before the context passes ``max_context_tokens``."""
        s, rng = self.spec, self.rng
        history = list(prefix)
        turns: list[Turn] = []
        size = sum(_tokens(m) for _, m in history)
        for i in range(n_turns):
            n_in = self.length(first if first is not None and i == 0 else in_tokens)
            n_out = self.length(out_tokens)
            if turns and size + n_in + n_out > s.max_context_tokens:
                break
            history.append(("user", self.segment(("in", sid, i), n_in)))
            wait = rng.expovariate(1 / think_s) if turns and think_s > 0 else 0.0
            turns.append(self._turn(history, n_out, wait))
            history.append(("assistant", self.segment(("out", sid, i), n_out)))
            size += n_in + n_out
        return tuple(turns)

    def _turn(self, parts: list[tuple[str, Any]], max_tokens: int, think_s: float = 0.0) -> Turn:
        if self.spec.form == "ids":
            body: dict[str, Any] = {"prompt": [t for _, ids in parts for t in ids]}
            path = COMPLETIONS
        else:
            body = {"messages": _merge_roles(parts)}
            path = CHAT
        body.update({"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0})
        if self.user is not None:
            body["user"] = self.user
        return Turn(path, body, think_s)


def _tokens(segment: Any) -> int:
    """Tokens of a segment: ids are counted; a text of n tokens has n words (see :meth:`TokenSource.text`)."""
    return len(segment) if isinstance(segment, list) else segment.count(" ") + 1


def _merge_roles(parts: list[tuple[str, Any]]) -> list[dict[str, str]]:
    """Chat messages from (role, text) parts, consecutive parts of one role joined (chat
    templates expect user and assistant to alternate)."""
    out: list[dict[str, str]] = []
    for role, text in parts:
        if out and out[-1]["role"] == role:
            out[-1]["content"] += "\n\n" + text
        else:
            out.append({"role": role, "content": text})
    return out


# -- native JSONL ---------------------------------------------------------------------


def load_jsonl(path: str | Path, *, max_requests: int | None = None) -> Workload:
    """One OpenAI body per line; see the module docstring for the optional keys."""
    by_session: dict[str, list[tuple[float, Turn]]] = {}
    skipped = 0
    t_last = 0.0
    for lineno, rec in _jsonl_records(path, max_requests):
        body = dict(rec)
        ts = body.pop("timestamp", None)
        sid = body.pop("session_id", None)
        body.pop("model", None)
        body.pop("stream", None)
        if "messages" in body:
            route = CHAT
        elif "prompt" in body:
            route = COMPLETIONS
        else:
            skipped += 1
            continue
        try:
            t = float(ts) if ts is not None else t_last
        except (TypeError, ValueError):
            skipped += 1
            continue
        t_last = t
        key = str(sid) if sid is not None else f"jl-{lineno}"
        by_session.setdefault(key, []).append((t, Turn(route, body)))
    sessions = []
    for sid, items in by_session.items():
        start = items[0][0]
        turns = [items[0][1]] + [replace(turn, think_s=max(0.0, t - prev_t)) for (prev_t, _), (t, turn) in zip(items, items[1:])]
        sessions.append(Session(sid, start, tuple(turns)))
    return _finish("jsonl", sessions, skipped, path)


# -- helpers --------------------------------------------------------------------------


def _jsonl_records(path: str | Path, max_requests: int | None) -> Iterator[tuple[int, dict[str, Any]]]:
    """Parsed JSON objects with their line numbers; bad lines are skipped and counted by the caller."""
    try:
        fh = open(path, encoding="utf-8")
    except OSError as e:
        raise WorkloadError(f"cannot read trace {path}: {e}") from e
    n = 0
    with fh:
        for lineno, line in enumerate(fh, 1):
            if max_requests is not None and n >= max_requests:
                return
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                rec = None
            n += 1
            yield lineno, rec if isinstance(rec, dict) else {}


def _finish(name: str, sessions: list[Session], skipped: int, source: object) -> Workload:
    if not sessions:
        raise WorkloadError(f"{source}: no usable request in the {name} trace ({skipped} skipped)")
    sessions.sort(key=lambda s: s.start_s)
    notes = [f"{skipped} unusable records skipped"] if skipped else []
    return Workload(name, sessions, skipped, notes)


@lru_cache(maxsize=4)
def _spec_object(path: str | Path, what: str) -> dict[str, Any] | None:
    """A workload spec file's JSON object, or None for ``default`` (or an empty path): the defaults."""
    if str(path) in ("", "default", "-"):
        return None
    raw = _read_json(path, what)
    if not isinstance(raw, dict):
        raise WorkloadError(f"{path}: a {what} is a JSON object")
    return raw


def _read_json(path: str | Path, what: str) -> Any:
    """The JSON document at ``path``; :class:`WorkloadError` naming ``what`` if it cannot be read or parsed."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise WorkloadError(f"cannot read {what} {path}: {e}") from e


def _hf_tokenizer(path: str) -> Any:
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
    except Exception as e:  # the tokenizers library raises its own Exception subclass
        raise WorkloadError(f"cannot load tokenizer.json from {path}: {e}") from e


def detect_format(path: str | Path) -> Format:
    """Guess a trace's format from its content (first record)."""
    p = Path(path)
    if str(path) in ("default", "synthetic") or p.suffix == ".synthetic.json":
        return "synthetic"
    if str(path) == "mixed" or p.name.endswith(".mixed.json"):
        return "mixed"
    try:
        with open(p, encoding="utf-8") as fh:
            head = fh.read(4096).lstrip()
    except OSError as e:
        raise WorkloadError(f"cannot read trace {path}: {e}") from e
    if head.startswith("["):
        return "sharegpt"
    first = head.splitlines()[0] if head else ""
    if '"hash_ids"' in first:
        return "mooncake"
    if first.startswith("{") and '"groups"' in head and '"questions"' in head:
        return "synthetic"
    return "jsonl"


def load(
    path: str | Path,
    fmt: str | None = None,
    *,
    seed: int = 0,
    max_requests: int | None = None,
    tokenizer_path: str | Path = DEFAULT_TOKENIZER,
    **options: Any,
) -> Workload:
    """Load any supported workload; ``options`` go to the format's loader."""
    fmt = fmt or detect_format(path)
    if fmt == "mooncake":
        return load_mooncake(path, seed=seed, tokenizer_path=tokenizer_path, max_requests=max_requests, **options)
    if fmt == "sharegpt":
        return load_sharegpt(path, seed=seed, tokenizer_path=tokenizer_path, max_requests=max_requests, **options)
    if fmt == "synthetic":
        return synthetic(SyntheticSpec.from_file(path), seed=seed, tokenizer_path=tokenizer_path, max_requests=max_requests)
    if fmt == "mixed":
        spec = MixedSpec.from_file(path)
        overrides = options.pop("mix", None)
        if overrides:
            spec = MixedSpec.with_overrides(overrides, "--mix", spec)
        return mixed(spec, seed=seed, tokenizer_path=tokenizer_path, max_requests=max_requests)
    if fmt == "jsonl":
        return load_jsonl(path, max_requests=max_requests)
    raise WorkloadError(f"unknown trace format {fmt!r} (choose from {', '.join(FORMATS)})")


# -- reference: the cache an infinite pool would give ----------------------------------


def prompt_ids(turn: Turn, tokenizer: Any) -> list[int]:
    """The prompt ids the engine computes for ``turn`` (``tokenizer`` a router PromptTokenizer)."""
    if turn.path == CHAT:
        return tokenizer.chat_ids(turn.body)
    return tokenizer.completion_ids(turn.body)[0]


def ideal_hits(prompts: Iterable[list[int]], block_size: int) -> Iterator[tuple[int, int]]:
    """(prompt, cached) tokens of each prompt if one engine with an infinite cache served them in order.

    The reference for a policy's cached-token ratio and TTFT floor. It counts reuse of
    earlier *prompts* only (not of generated tokens) and caps a hit like vLLM does: at
    most ``floor((n - 1) / block_size)`` blocks, because the last token is always computed.
    """
    seen: set[int] = set()
    for ids in prompts:
        n = len(ids)
        parent = 0
        hit = 0
        still = True
        for i in range(n // block_size):
            parent = hash((parent, tuple(ids[i * block_size:(i + 1) * block_size])))
            if still and parent in seen:
                hit += 1
            else:
                still = False
                seen.add(parent)
        yield n, min(hit, (n - 1) // block_size) * block_size if n else 0


def ideal_cached_tokens(prompts: Iterable[list[int]], block_size: int) -> tuple[int, int]:
    """(cached, prompt) tokens over all ``prompts`` (see :func:`ideal_hits`)."""
    cached = total = 0
    for n, c in ideal_hits(prompts, block_size):
        total += n
        cached += c
    return cached, total