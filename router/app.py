"""The router's app: OpenAI endpoints, /health, /metrics and /debug/*.

One request: read the body (bounded), parse it once with msgspec, check the few fields
routing needs (the engine validates the rest), tokenize exactly like vLLM (inline for
small bodies, in a thread pool otherwise so a 100k-token prompt never stalls the event
loop), hash into vLLM block keys, look the keys up in the index, let the model's policy
choose, and hand the *original bytes* to :class:`router.proxy.ProxyResponse`. A long
prompt the router can route on part of its ids (a cold prompt's first block, a seen
history's cached segments) is sent first and tokenized after (:mod:`router.cold`).

Completions with a list of prompts are routed on the first prompt (all are checked
against ``max_model_len``): vLLM schedules each prompt as its own request, so only one
of them can decide the backend, and batches usually share their prefix anyway.

Errors are raised as :mod:`router.errors` exceptions and answered by
:class:`router.dispatch.Endpoints` (and by :func:`router.errors.error_response` inside the
proxy).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest
from starlette.responses import Response

from indexer.hashing import BlockHasher
from indexer.index import Index, MemoryIndex, Worker
from router import metrics
from router.auth import Access
from router.background import MAX_SETTLING, Background
from router.backends import BackendPool
from router.cold import MIN_CHARS, HeadProbe
from router.config import Config, Model
from router.dispatch import Endpoints
from router.hash_cache import HashCache
from router.history import Chain, Entry, HistoryMemo, Hit, chain_of, digest, learn_entries
from router.errors import (
    BadRequest,
    BodyTooLarge,
    NoHealthyBackend,
    PromptTooLong,
    RouterError,
    UnknownModel,
    UpstreamError,
)
from router.load import LoadTracker, Ticket, scrape_forever
from router.policies import make_policy
from router.policies.base import Candidate, Decision, Policy, PrefixMemory, ReadsEngineState, RequestCtx
from router.proxy import ProxyResponse, forwarded_headers
from router.tokenize import (
    ParityGuard,
    PromptTokenizer,
    RemoteTokenizeError,
    RemoteTokenizer,
    TokenizeError,
    UnsupportedPrompt,
    load_tokenizer,
)

log = logging.getLogger(__name__)

_decoder = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()
_STREAM_STATS_TTL_S = 0.5
PENDING_WAIT_S = 1.0
"""Longest a request waits for a deferred one with the same first block (its background
tokenization normally takes as long as this request's own)."""
SETTLE_DELAY_S = 0.02
"""A deferred request is tokenized this long after it is sent, or sooner: when its
response is complete, or when a request with the same first block needs its keys.
Starting at once would compete for the CPU (and the GIL) with the engine and the event
loop exactly while the request is being sent and first answered; nothing needs the
exact keys that soon, and its load ticket carries an estimate meanwhile."""
INLINE_UNCACHED_CHARS = 2048
"""A rendered prompt whose segments not yet in the segment cache total at most this many
characters is tokenized on the event loop: a re-sent history plus a new turn costs a
few hundred microseconds there, less than the hop to the tokenizer pool and back."""
INLINE_ID_TOKENS = 8192
"""Longest token-id prompt hashed on the event loop: a full cache miss of 512 blocks costs
~1.5 ms of SHA-256, still less than a thread hop under load (see Router._inline)."""


@dataclass
class ModelRuntime:
    """Everything one served model needs on the hot path, built once at start-up."""

    config: Model
    hasher: BlockHasher
    hash_cache: HashCache
    policy: Policy
    guard: ParityGuard
    remote: RemoteTokenizer
    backends: list[str]
    tier_weights: dict[str, float]
    tokenizer: PromptTokenizer | None = None
    probe: HeadProbe | None = None
    tokenizer_error: str | None = None
    max_model_len: int | None = None
    lora: dict[str, dict[str, Any]] = field(default_factory=dict)
    has_events: bool = False
    memory: PrefixMemory | None = None
    """The policy itself when it remembers its decisions by prefix (kv_aware, prefix_approx)."""
    history: HistoryMemo | None = None
    """Block keys of chat histories already tokenized (``router.history_memo``)."""
    engines: ReadsEngineState | None = None
    """The policy itself when it reads the engines' exact state (the bench's oracle, simulator only)."""

    def __post_init__(self) -> None:
        if isinstance(self.policy, PrefixMemory):
            self.memory = self.policy
        if isinstance(self.policy, ReadsEngineState):
            self.engines = self.policy


@dataclass(slots=True)
class Rendered:
    """A single-text prompt rendered once per request (see PromptTokenizer.prompt_text)."""

    text: str
    add_special: bool
    uncached_chars: int
    ids: list[int] | None = None
    """All of its ids, when the segment cache held every segment (nothing to tokenize)."""


@dataclass(slots=True)
class Deferred:
    """A prompt routed on the exact ids of its head; the rest is tokenized after it is sent.

    The head is the first block of a never-seen prompt (``cold``, :mod:`router.cold`),
    the part of a re-sent history the segment cache holds, its first ``head_chars``
    characters, whose tail is a new turn (see :meth:`Router._probe`), or the keys
    remembered for a history, nothing rendered yet (``history``, :mod:`router.history`)."""

    prompt: Rendered | None
    head: list[int]
    keys: list[int]
    estimate: int
    lora: dict[str, Any] | None
    salt: str | None
    body: dict[str, Any]
    kind: str
    head_chars: int = 0
    history: Hit | None = None

    @property
    def cold(self) -> bool:
        return self.head_chars == 0 and self.history is None

    def max_tokens(self, probe: HeadProbe) -> int:
        """An upper bound on the prompt's length: the exact head (or remembered history),
        a byte bound on the rest."""
        assert self.prompt is not None, "a history is routed unrendered only without a configured limit"
        known = self.history.entry.tokens if self.history is not None else 0 if self.cold else len(self.head)
        return known + probe.max_tokens(self.prompt.text[self.head_chars :], self.prompt.add_special)


@dataclass(slots=True)
class Pending:
    """A deferred request's background tokenization: ``wake`` starts it before its delay,
    ``done`` is set when its keys are known (or it failed)."""

    wake: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(slots=True)
class Prepared:
    """A request tokenized, hashed and matched, ready for a policy (``deferred``: only
    its first block so far, see :meth:`Router.settle_later`)."""

    runtime: ModelRuntime
    token_ids: list[int]
    ctx: RequestCtx
    candidates: list[Candidate]
    decision: Decision
    deferred: Deferred | None = None
    backend: str = ""
    chain: Chain | None = None
    """Its messages' history-memo keys, when the memo applies (it learns from the request)."""
    rendered: Rendered | None = None
    body: dict[str, Any] = field(default_factory=dict)


class Router:
    """The router's live state: models, backends, load, index and event subscriber."""

    def __init__(self, config: Config, index: Index | None = None) -> None:
        self.config = config
        self.settings = config.router
        self.pool = BackendPool(config)
        self.loads = LoadTracker(list(self.pool.backends))
        self.index: Index = index if index is not None else _make_index(config.index, config.index_namespace)
        # Two workers: tokenization holds the GIL for its Python part (template rendering), so
        # more threads would only contend with the event loop for it.
        self.executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")
        self.background = Background(MAX_SETTLING)
        """Work a request leaves behind once sent (settles, learning, sampled checks): off
        every request's critical path, on one low-priority thread (:mod:`router.background`)."""
        self.models: dict[str, ModelRuntime] = {}
        self.served: dict[str, tuple[ModelRuntime, dict[str, Any] | None]] = {}
        for m in config.models:
            w = self.settings.weights
            hasher = BlockHasher(m.hash_algo, m.block_size, m.hash_seed, m.vllm_version)
            rt = ModelRuntime(
                config=m,
                hasher=hasher,
                hash_cache=HashCache(hasher),
                policy=make_policy(m.policy or self.settings.policy, config, m),
                guard=ParityGuard(m.name, m.tokenizer_mode, m.parity_sample_rate),
                remote=RemoteTokenizer(m.name),
                backends=[b.name for b in m.backends],
                tier_weights={"GPU": 1.0, "CPU": w.cpu_tier, "STORAGE": w.storage_tier, "DISK": w.storage_tier},
                max_model_len=m.max_model_len,
                has_events=any(b.kv_events for b in m.backends),
            )
            if self.settings.history_memo and self.settings.defer_cold_prompts:
                rt.history = HistoryMemo(m.name)
            self.models[m.name] = rt
            self.served[m.name] = (rt, None)
            for a in m.lora_adapters:
                lora = {"name": a.name, "path": a.path, "int_id": a.id}
                rt.lora[a.name] = lora
                self.served[a.name] = (rt, lora)
        self.subscriber: Any = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stream_stats: dict[Worker, Any] = {}
        self._stream_stats_at = 0.0
        self._pending: dict[tuple[str, int], Pending] = {}
        """Cold deferred requests not yet settled, by (model, block 0 key): a request with
        the same first block starts their tokenization and waits for it instead of
        deciding blind."""
        self._unregister_metrics: Any = None
        self.stream_registry = CollectorRegistry(auto_describe=True)
        """The subscriber's own series, exposed through :class:`metrics.FleetCollector` so
        that several routers can live in one process (tests) without name clashes."""

    # -- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(self._load_tokenizer(loop, rt) for rt in self.models.values()))
        if self._subscribes():
            from indexer.subscriber import FleetSubscriber, specs_from_config
            from indexer.verify import SETTLE_AFTER, HashVerifier

            verifiers = {
                rt.config.name: HashVerifier(rt.hasher, {a.name: a.path for a in rt.config.lora_adapters},
                                             settle_after=SETTLE_AFTER)
                for rt in self.models.values()
            }
            self.subscriber = FleetSubscriber(
                self.index, specs_from_config(self.config), verifiers=verifiers, metrics_registry=self.stream_registry
            )
            self.subscriber.start()
        else:
            await _warn_if_unfilled(self.index, self.config)
        self._unregister_metrics = metrics.register_fleet(
            metrics.FleetCollector(self.pool, self.loads, self.stream_stats, self.stream_registry, self.background)
        )
        self.pool.open()
        await self.pool.check_all()
        for rt in self.models.values():
            if rt.engines is not None:
                await rt.engines.start()
        self._tasks = [
            asyncio.create_task(self.pool.health_forever(self._forget_backend)),
            asyncio.create_task(scrape_forever(self.pool, self.loads, self.settings.metrics_scrape_interval_s)),
            asyncio.create_task(self._learn_max_model_len()),
        ]
        # What exists now (the imports, the tokenizers: over a million objects) lives as long
        # as the router: out of the collector's sight, a full collection scans only what
        # routing allocates. Unfrozen, each took ~50 ms, a stall of every request in flight.
        gc.freeze()

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.subscriber is not None:
            await asyncio.to_thread(self.subscriber.stop)
        if self._unregister_metrics is not None:
            self._unregister_metrics()
        await self.pool.aclose()
        for rt in self.models.values():
            if rt.engines is not None:
                await rt.engines.aclose()
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.background.shutdown()
        close = getattr(self.index, "aclose", None)
        if close is not None:
            await close()

    def _subscribes(self) -> bool:
        wanted = self.settings.subscribe_events
        if wanted is None:
            wanted = self.config.index == "memory"
        return wanted and any(rt.has_events for rt in self.models.values())

    async def _load_tokenizer(self, loop: asyncio.AbstractEventLoop, rt: ModelRuntime) -> None:
        if rt.config.tokenizer_mode == "remote":
            return
        try:
            rt.tokenizer = await loop.run_in_executor(self.executor, load_tokenizer, rt.config.tokenizer)
            rt.probe = HeadProbe(rt.tokenizer, rt.config.name)
        except TokenizeError as e:
            if rt.config.tokenizer_mode == "local":
                raise
            rt.tokenizer_error = str(e)
            log.warning("model %s: local tokenizer unavailable (%s); tokenizing remotely", rt.config.name, e)

    def _forget_backend(self, name: str) -> None:
        """An ejected backend's cache is presumed gone (restart): drop what the router knew."""
        for rt in self.models.values():
            if name not in rt.backends:
                continue
            if rt.memory is not None:
                rt.memory.forget(name)
            if self.subscriber is not None:
                backend = self.pool.get(name).config
                for rank in range(backend.data_parallel_size):
                    self.subscriber.mark_dead(Worker(name, rank))

    async def _learn_max_model_len(self) -> None:
        """Models without ``max_model_len`` in the config take it from a backend's /v1/models."""
        for rt in self.models.values():
            if rt.max_model_len is not None:
                continue
            for name in rt.backends:
                try:
                    r = await self.pool.get(name).client.get("/v1/models", timeout=5.0)
                    for entry in r.json().get("data", []):
                        if entry.get("id") == rt.config.name and isinstance(entry.get("max_model_len"), int):
                            rt.max_model_len = entry["max_model_len"]
                except Exception as e:  # noqa: BLE001 - best effort; the engine still enforces its limit
                    log.debug("max_model_len from %s failed: %r", name, e)
                if rt.max_model_len is not None:
                    break

    def stream_stats(self) -> dict[Worker, Any]:
        if self.subscriber is None:
            return {}
        now = time.monotonic()
        if now - self._stream_stats_at > _STREAM_STATS_TTL_S:
            self._stream_stats = self.subscriber.stats()
            self._stream_stats_at = now
        return self._stream_stats

    def can_route(self) -> bool:
        return all(any(self.pool.get(n).routable for n in rt.backends) for rt in self.models.values())

    # -- the hot path ---------------------------------------------------------------

    def runtime_for(self, body: dict[str, Any]) -> tuple[ModelRuntime, dict[str, Any] | None]:
        model = body.get("model")
        if not isinstance(model, str):
            raise BadRequest("'model' is required and must be a string", code="missing_model")
        served = self.served.get(model)
        if served is None:
            raise UnknownModel(f"The model `{model}` does not exist.")
        return served

    async def prepare(self, body: dict[str, Any], raw_len: int, kind: str, headers: Any, *, defer: bool = False) -> Prepared:
        """Tokenize, hash, look up and decide (no side effects: /debug/route uses it too).

        With ``defer`` a long prompt whose first block is unknown everywhere is decided on
        that block alone (:mod:`router.cold`); the caller then owes :meth:`settle_later`."""
        started = time.perf_counter()
        rt, lora = self.runtime_for(body)
        _validate_fields(body, kind)
        salt = body.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise BadRequest("'cache_salt' must be a string")
        forced_reason = None
        rendered = deferred = chain = None
        if defer and self.settings.defer_cold_prompts and rt.engines is None and raw_len >= MIN_CHARS:
            chain = self._chain(rt, body, kind)
            prompt = None
            if chain is not None and not self.background.full:
                prompt, deferred = self._recall(rt, body, kind, lora, salt, chain)
            if deferred is None:
                rendered, deferred = self._probe(rt, body, kind, lora, salt, prompt)
            else:
                rendered = deferred.prompt
            if deferred is not None:
                hits = await self._lookup(rt, deferred.keys)
                outcome = "history" if deferred.history is not None else "deferred" if deferred.cold else "tail"
                memory = rt.memory
                if deferred.cold and (
                    hits or (memory is not None and memory.remembers(deferred.keys)) or (rt.config.name, deferred.keys[0]) in self._pending
                ):
                    outcome = "known"
                elif self.background.full:
                    outcome = "busy"
                elif rt.config.max_model_len is not None and _length_error(rt, body, [deferred.max_tokens(rt.probe)]):  # type: ignore[arg-type]
                    outcome = "ineligible"  # a configured limit, maybe below the engines': check it exactly
                metrics.child(metrics.COLD_PATH, rt.config.name, outcome).inc()
                if outcome not in ("deferred", "tail", "history"):
                    deferred = None
        if deferred is not None:
            token_ids: list[int] = []
            keys, num_tokens = deferred.keys, deferred.estimate
        else:
            try:
                token_ids, all_lengths, keys = await self._tokens_and_keys(rt, body, kind, raw_len, lora, salt, rendered)
            except UnsupportedPrompt as e:
                log.debug("routing without cache information: %s", e)
                token_ids, all_lengths, keys, forced_reason = [], [], [], "fallback"
            self._check_length(rt, body, all_lengths)
            if keys:
                await self._after_pending(rt.config.name, keys[0])
            hits = await self._lookup(rt, keys) if keys else {}
            num_tokens = len(token_ids)
        candidates = self._candidates(rt, hits)
        if not any(c.healthy for c in candidates):
            raise NoHealthyBackend(f"no healthy backend for model {rt.config.name!r}")
        ctx = RequestCtx(
            model=rt.config.name,
            num_tokens=num_tokens,
            block_size=rt.config.block_size,
            keys=keys,
            session_key=_session_key(body, headers, self.settings.session_header),
            events_connected=rt.has_events and self._events_connected(rt),
        )
        if rt.engines is not None:
            await rt.engines.observe(ctx, candidates, token_ids, body, kind)
        decision = rt.policy.choose(ctx, candidates)
        if forced_reason is not None:
            decision.reason = forced_reason
        decision.detail["prepare_s"] = time.perf_counter() - started
        if deferred is not None:
            decision.detail["deferred_tokens"] = num_tokens
        return Prepared(rt, token_ids, ctx, candidates, decision, deferred, chain=chain, rendered=rendered, body=body)

    @staticmethod
    def _chain(rt: ModelRuntime, body: dict[str, Any], kind: str) -> Chain | None:
        """The request's history-memo keys, when the memo can route it or learn from it."""
        memo, tok = rt.history, rt.tokenizer
        if kind != "chat" or memo is None or not memo.enabled or tok is None or not tok.segment_enabled or rt.guard.mode == "remote":
            return None
        return chain_of(body)

    async def _lookup(self, rt: ModelRuntime, keys: list[int]) -> dict[Worker, dict[str, int]]:
        t0 = time.perf_counter()
        hits = await self.index.lookup(rt.config.name, keys)
        metrics.child(metrics.LOOKUP_SECONDS, rt.config.name).observe(time.perf_counter() - t0)
        return hits

    def _recall(
        self, rt: ModelRuntime, body: dict[str, Any], kind: str, lora: dict[str, Any] | None, salt: str | None, chain: Chain
    ) -> tuple[tuple[str, bool] | None, Deferred | None]:
        """A chat whose messages start with a remembered history: deferred on that
        history's keys (see :mod:`router.history`). Its template is rendered only under a
        configured length limit, which needs a bound: the remembered prefix's tokens,
        when the rendering does start with that text, plus a byte bound on the rest.
        Also returns the rendered prompt when there was one."""
        assert rt.history is not None and rt.tokenizer is not None
        hit = rt.history.find(chain)
        if hit is None:
            return None, None
        entry = hit.entry
        if rt.config.max_model_len is None:
            return None, Deferred(None, [], entry.keys, hit.estimate(chain), lora, salt, body, kind, history=hit)
        prompt = _render(rt.tokenizer, body, kind)
        if prompt is None or digest(prompt[0], entry.chars) != entry.digest:
            return prompt, None
        text, add_special = prompt
        rendered = Rendered(text, add_special, len(text) - entry.chars)
        return prompt, Deferred(rendered, [], entry.keys, hit.estimate(chain), lora, salt, body, kind, entry.chars, history=hit)

    def _probe(
        self,
        rt: ModelRuntime,
        body: dict[str, Any],
        kind: str,
        lora: dict[str, Any] | None,
        salt: str | None,
        prompt: tuple[str, bool] | None = None,
    ) -> tuple[Rendered | None, Deferred | None]:
        """The rendered prompt (reused by the full path; ``prompt`` when already rendered)
        and, for a long one the segment cache has mostly not seen, a deferral candidate:
        its first block's key and estimated length (see :mod:`router.cold`)."""
        probe, tok = rt.probe, rt.tokenizer
        if probe is None or tok is None or rt.guard.mode == "remote":
            return None, None
        if prompt is None:
            prompt = _render(tok, body, kind)
        if prompt is None:
            return None, None
        text, add_special = prompt
        if len(text) < MIN_CHARS:  # below INLINE_UNCACHED_CHARS whatever the cache holds
            return Rendered(text, add_special, len(text)), None
        scan = tok.scan(text, add_special)
        head = scan.head
        rendered = Rendered(text, add_special, scan.uncached_chars, head if scan.complete else None)
        if rendered.uncached_chars <= INLINE_UNCACHED_CHARS:
            if scan.complete or len(head) < rt.config.block_size:
                metrics.child(metrics.COLD_PATH, rt.config.name, "seen").inc()
                return rendered, None
            # A re-sent history and a new turn: the history's ids are exact, and no backend
            # can hold blocks of text this router has not tokenized lately (the blocks are
            # chained), so routing on the history decides what the whole prompt would.
            keys = rt.hash_cache.hash_int64(head, lora=lora, cache_salt=salt)
            estimate = len(head) + round((len(text) - scan.head_chars) * len(head) / max(1, scan.head_chars))
            return rendered, Deferred(rendered, head, keys, estimate, lora, salt, body, kind, scan.head_chars)
        if not probe.enabled:
            metrics.child(metrics.COLD_PATH, rt.config.name, "disabled").inc()
            return rendered, None
        got = probe.head_ids(text, add_special, rt.config.block_size)
        if got is None:
            metrics.child(metrics.COLD_PATH, rt.config.name, "ineligible").inc()
            return rendered, None
        head, per_char = got
        keys = rt.hash_cache.hash_int64(head, lora=lora, cache_salt=salt)
        estimate = max(len(head), round(len(text) * per_char))
        return rendered, Deferred(rendered, head, keys, estimate, lora, salt, body, kind)

    async def _after_pending(self, model: str, first_key: int) -> None:
        """Wait (bounded) for a deferred request with the same first block to finish
        tokenizing, so this decision sees its keys (a burst follows its first request)."""
        pending = self._pending.get((model, first_key))
        if pending is not None:
            pending.wake.set()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(pending.done.wait(), PENDING_WAIT_S)

    def settle_later(self, prepared: Prepared, ticket: Ticket) -> Pending:
        """Tokenize and hash a deferred request in the background, then give the policy
        its keys and the load ticket its exact size. Called right after the decision,
        before any await, so a request with the same new first block finds it pending.
        Setting the returned ``wake`` starts the work before :data:`SETTLE_DELAY_S`."""
        d = prepared.deferred
        assert d is not None
        key = (prepared.runtime.config.name, prepared.ctx.keys[0])
        pending = Pending()
        if d.cold:
            self._pending[key] = pending
        self.background.spawn(self._settle(prepared, d, ticket, key, pending))
        return pending

    async def _settle(self, prepared: Prepared, d: Deferred, ticket: Ticket, key: tuple[str, int], pending: Pending) -> None:
        rt = prepared.runtime
        try:
            await _woken(pending.wake)
            ids, keys, learned = await self.background.run(self._settle_job, rt, d, prepared.chain)
            if d.cold:
                assert rt.probe is not None
                rt.probe.check(d.head, ids)
            if d.history is not None and rt.history is not None:
                rt.history.check(d.history, keys)
            self._remember_history(rt, learned)
            chosen = next(c for c in prepared.candidates if c.backend == ticket.load.name)
            ticket.settle(keys, _uncached(len(ids), chosen, prepared.ctx.block_size))
            if rt.memory is not None:
                rt.memory.remember(keys, prepared.backend)
            if rt.guard.should_check():
                self.background.spawn(self._parity_check(rt, d.body, d.kind, ids))
        except (TokenizeError, BadRequest) as e:  # routed unrendered, and the router cannot tokenize it: the engine judges it
            log.debug("a deferred %s request cannot be tokenized here: %s", rt.config.name, e)
            metrics.child(metrics.COLD_PATH, rt.config.name, "settle_error").inc()
            ticket.settle([], 0)  # what the full path would have charged it
        except Exception as e:  # noqa: BLE001 - the request is already on its way; keep its estimate
            log.warning("background tokenization of a deferred %s request failed: %r", rt.config.name, e)
            metrics.child(metrics.COLD_PATH, rt.config.name, "settle_error").inc()
        finally:
            if self._pending.get(key) is pending:
                del self._pending[key]
            pending.done.set()

    def _settle_job(self, rt: ModelRuntime, d: Deferred, chain: Chain | None) -> tuple[list[int], list[int], list[tuple[int, Entry]]]:
        """A deferred request's ids and keys, and the history entries it teaches (background thread)."""
        prompt = d.prompt
        if prompt is None:  # routed on remembered keys: rendered only now
            assert rt.tokenizer is not None
            prompt = _rendered_now(rt.tokenizer, d.body, d.kind)
        ids, _, keys = self._local(rt, d.body, d.kind, d.lora, d.salt, prompt)
        try:
            learned = self._history_job(rt, chain, d.body, prompt, keys)
        except Exception as e:  # noqa: BLE001 - learning is optional; the settle is not
            log.warning("learning a %s chat history failed: %r", rt.config.name, e)
            learned = []
        return ids, keys, learned

    def learn_later(self, prepared: Prepared) -> Any:
        """For a chat request tokenized before it was sent: remember its messages' keys
        for the next turn, in the background once it is answered (or after
        :data:`SETTLE_DELAY_S`). Returns the callable that starts it sooner, or None when
        there is nothing to learn."""
        memo, chain = prepared.runtime.history, prepared.chain
        if memo is None or chain is None or not prepared.ctx.keys:
            return None
        if chain.hashes[-1] in memo and (len(chain.hashes) == 1 or chain.hashes[-2] in memo):
            return None
        wake = asyncio.Event()
        self.background.spawn(self._learn(prepared, wake))
        return wake.set

    async def _learn(self, prepared: Prepared, wake: asyncio.Event) -> None:
        rt = prepared.runtime
        await _woken(wake)
        if self.background.full:
            return  # background work is behind: learn from a later turn instead
        try:
            learned = await self.background.run(self._history_job, rt, prepared.chain, prepared.body, prepared.rendered, prepared.ctx.keys)
        except Exception as e:  # noqa: BLE001 - only the next turn's shortcut is lost
            log.warning("learning a %s chat history failed: %r", rt.config.name, e)
            return
        self._remember_history(rt, learned)

    @staticmethod
    def _history_job(
        rt: ModelRuntime, chain: Chain | None, body: dict[str, Any], prompt: Rendered | None, keys: list[int]
    ) -> list[tuple[int, Entry]]:
        tok, memo = rt.tokenizer, rt.history
        if chain is None or tok is None or memo is None:
            return []
        prompt = prompt or _rendered_now(tok, body, "chat")
        if prompt is None:
            return []
        return learn_entries(tok, memo, chain, body, prompt.text, prompt.add_special, keys, rt.config.block_size)

    @staticmethod
    def _remember_history(rt: ModelRuntime, learned: list[tuple[int, Entry]]) -> None:
        if rt.history is not None:
            for key, entry in learned:
                rt.history.put(key, entry)

    async def _tokens_and_keys(
        self,
        rt: ModelRuntime,
        body: dict[str, Any],
        kind: str,
        raw_len: int,
        lora: dict[str, Any] | None,
        salt: str | None,
        rendered: Rendered | None = None,
    ) -> tuple[list[int], list[int], list[int]]:
        if rt.guard.mode == "remote" or rt.tokenizer is None:
            prompts = await self._remote_prompts(rt, body, kind)
            first = prompts[0] if prompts else []
            keys = await self._offload(self._inline(raw_len, first), self._hash, rt, first, lora, salt)
            return first, [len(p) for p in prompts], keys
        try:
            prompt = body.get("prompt") if kind == "completion" else None
            # A shape hint only: completion_ids validates every id, inline or not.
            ids = prompt if isinstance(prompt, list) and prompt and type(prompt[0]) is int else None
            inline = self._inline(raw_len, ids) or (rendered is not None and rendered.uncached_chars <= INLINE_UNCACHED_CHARS)
            first, lengths, keys = await self._offload(inline, self._local, rt, body, kind, lora, salt, rendered)
        except (TokenizeError, RouterError):
            raise
        except Exception as e:  # noqa: BLE001 - a tokenizer crash must not fail the request
            log.warning("local tokenization of %s failed (%r); asking a backend", rt.config.name, e)
            metrics.child(metrics.TOKENIZER_FALLBACKS, rt.config.name, "local_error").inc()
            prompts = await self._remote_prompts(rt, body, kind)
            first = prompts[0] if prompts else []
            return first, [len(p) for p in prompts], rt.hash_cache.hash_int64(first, lora=lora, cache_salt=salt)
        if rt.guard.should_check():
            self.background.spawn(self._parity_check(rt, body, kind, first))
        return first, lengths, keys

    def _inline(self, raw_len: int, token_ids: list[int] | None) -> bool:
        """Whether tokenizing and hashing this request runs on the event loop.

        Small bodies do, and so do prompts already given as token ids (up to
        :data:`INLINE_ID_TOKENS`): for those "tokenizing" is a C-speed type check and
        hashing mostly hits the hash cache, well under a millisecond. Under load the
        thread hop is what costs: the job waits for a pool thread and the GIL (held by
        the other tokenizer thread and the KV-event thread), then for the loop to pick
        up the result. On the Mooncake bench (~3k-token id prompts, ~30 req/s on 2
        cores) it was ~20 ms of the router's overhead, for ~2 ms of work.
        """
        if raw_len <= self.settings.inline_tokenize_bytes:
            return True
        return token_ids is not None and len(token_ids) <= INLINE_ID_TOKENS

    async def _offload(self, inline: bool, fn: Any, *args: Any) -> Any:
        """Run ``fn`` inline when it is cheap (see :meth:`_inline`) and in the tokenizer
        pool otherwise, so long prompts never block the event loop."""
        if inline:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def _local(
        self,
        rt: ModelRuntime,
        body: dict[str, Any],
        kind: str,
        lora: dict[str, Any] | None,
        salt: str | None,
        rendered: Rendered | None = None,
    ) -> tuple[list[int], list[int], list[int]]:
        tok = rt.tokenizer
        assert tok is not None
        t0 = time.perf_counter()
        try:
            if rendered is not None:  # one text, no truncation: see PromptTokenizer.prompt_text
                # The sampled full-tokenization check costs a whole cold tokenization: never
                # on the event loop, where this may run (see INLINE_UNCACHED_CHARS).
                first = rendered.ids or tok.text_ids(rendered.text, rendered.add_special, check=False)
                if tok.wants_check():
                    self.background.submit(tok.check_prompt, rendered.text, first, rendered.add_special)
                lengths = [len(first)]
            elif kind == "chat":
                first = tok.chat_ids(body)
                lengths = [len(first)]
            else:
                prompts = tok.completion_ids(body)
                first = prompts[0] if prompts else []
                lengths = [len(p) for p in prompts]
        except UnsupportedPrompt:
            raise
        except TokenizeError as e:
            raise BadRequest(str(e)) from e
        t1 = time.perf_counter()
        keys = rt.hash_cache.hash_int64(first, lora=lora, cache_salt=salt)
        name = rt.config.name
        metrics.child(metrics.TOKENIZE_SECONDS, name).observe(t1 - t0)
        metrics.child(metrics.HASH_SECONDS, name).observe(time.perf_counter() - t1)
        return first, lengths, keys

    @staticmethod
    def _hash(rt: ModelRuntime, ids: list[int], lora: dict[str, Any] | None, salt: str | None) -> list[int]:
        t0 = time.perf_counter()
        keys = rt.hash_cache.hash_int64(ids, lora=lora, cache_salt=salt)
        metrics.child(metrics.HASH_SECONDS, rt.config.name).observe(time.perf_counter() - t0)
        return keys

    async def _remote_prompts(self, rt: ModelRuntime, body: dict[str, Any], kind: str) -> list[list[int]]:
        name = next((n for n in rt.backends if self.pool.get(n).routable), None)
        if name is None:
            raise NoHealthyBackend(f"no healthy backend for model {rt.config.name!r} to tokenize with")
        backend = self.pool.get(name)
        t0 = time.perf_counter()
        try:
            if kind == "chat":
                prompts = [await rt.remote.chat_ids(backend.url, body, backend.client)]
            else:
                prompts = await rt.remote.completion_ids(backend.url, body, backend.client)
        except TokenizeError as e:
            raise BadRequest(str(e)) from e
        except RemoteTokenizeError as e:
            log.warning("remote tokenization at %s failed: %s", name, e)
            raise UpstreamError(f"remote tokenization at backend {name} failed", backend=name) from e
        metrics.child(metrics.TOKENIZE_SECONDS, rt.config.name).observe(time.perf_counter() - t0)
        return prompts

    async def _parity_check(self, rt: ModelRuntime, body: dict[str, Any], kind: str, local_first: list[int]) -> None:
        name = next((n for n in rt.backends if self.pool.get(n).routable), None)
        if name is None:
            return
        backend = self.pool.get(name)
        try:
            if kind == "chat":
                await rt.guard.check_chat(local_first, body, rt.remote, backend.url, backend.client)
            else:
                remote = await rt.remote.completion_ids(body=body, base_url=backend.url, client=backend.client)
                rt.guard.record(local_first, remote[0] if remote else [])
        except Exception as e:  # noqa: BLE001 - a failed sample check is only logged
            log.debug("parity check against %s failed: %r", name, e)

    @staticmethod
    def _check_length(rt: ModelRuntime, body: dict[str, Any], lengths: list[int]) -> None:
        error = _length_error(rt, body, lengths)
        if error is not None:
            raise PromptTooLong(error)

    def _events_connected(self, rt: ModelRuntime) -> bool:
        stats = self.stream_stats()
        return any(st.connected for w, st in stats.items() if w.backend in rt.backends)

    def _candidates(self, rt: ModelRuntime, hits: dict[Worker, dict[str, int]]) -> list[Candidate]:
        best: dict[str, tuple[int, float, int]] = {}
        tiers = rt.tier_weights
        for worker, media in hits.items():
            matched = sum(media.values())
            weighted = sum(n * tiers.get(m.upper(), tiers["STORAGE"]) for m, n in media.items())
            prev = best.get(worker.backend)
            if prev is None or (matched, weighted) > prev[:2]:
                best[worker.backend] = (matched, weighted, worker.dp_rank)
        out = []
        for name in rt.backends:
            matched, weighted, rank = best.get(name, (0, 0.0, 0))
            out.append(Candidate(name, self.pool.get(name).routable, self.loads.get(name), matched, weighted, 0, rank))
        return out

    def commit(self, prepared: Prepared, backend: str) -> None:
        """The request is being sent to ``backend``: let the policy learn, count the decision."""
        rt, ctx, decision = prepared.runtime, prepared.ctx, prepared.decision
        name = rt.config.name
        prepared.backend = backend
        if backend != decision.backend:
            # A retry after the chosen backend failed before answering.
            rt.policy.commit(ctx, Decision(backend, "fallback", decision.order))
            metrics.child(metrics.DECISIONS, name, rt.policy.name, "fallback").inc()
            return
        rt.policy.commit(ctx, decision)
        metrics.child(metrics.DECISIONS, name, rt.policy.name, decision.reason).inc()
        chosen = next(c for c in prepared.candidates if c.backend == backend)
        metrics.child(metrics.MATCHED_BLOCKS, name).observe(chosen.matched_blocks)
        if ctx.num_tokens:
            cached = chosen.predicted_cached_tokens(ctx.num_tokens, ctx.block_size)
            metrics.child(metrics.PREDICTED_HIT_RATIO, name).observe(cached / ctx.num_tokens)
        if ctx.keys and rt.has_events and all(c.matched_blocks == 0 for c in prepared.candidates):
            metrics.child(metrics.ZERO_BLOCK_REQUESTS, name).inc()

    def prefill_tokens(self, prepared: Prepared) -> dict[str, int]:
        """Uncached prompt tokens per backend: the prefill work each would queue there
        (blocks the router itself just sent there count as cached: see kv_aware)."""
        n, bs = prepared.ctx.num_tokens, prepared.ctx.block_size
        return {c.backend: _uncached(n, c, bs) for c in prepared.candidates}

    def pick_any(self, body: dict[str, Any]) -> tuple[ModelRuntime, list[str]]:
        """Backends for pass-through endpoints (embeddings, tokenize): least loaded first."""
        rt, _ = self.runtime_for(body)
        names = [n for n in rt.backends if self.pool.get(n).routable]
        if not names:
            raise NoHealthyBackend(f"no healthy backend for model {rt.config.name!r}")
        names.sort(key=lambda n: self.loads.get(n).effective_in_flight())
        return rt, names


def _uncached(n: int, c: Candidate, bs: int) -> int:
    """Tokens of an ``n``-token prompt that ``c`` would prefill: all but its hit blocks,
    capped like vLLM, which always recomputes the last token."""
    cap = (n - 1) // bs if n > 0 else 0
    return n - min(max(c.matched_blocks, c.speculative_blocks), cap) * bs


def _length_error(rt: ModelRuntime, body: dict[str, Any], lengths: list[int]) -> str | None:
    """vLLM's message when the longest prompt plus ``max_tokens`` exceeds ``max_model_len``."""
    limit = rt.max_model_len
    if limit is None or not lengths:
        return None
    longest = max(lengths)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    requested = longest + (max_tokens if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) else 0)
    if longest < limit and requested <= limit:
        return None
    return (f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{requested} tokens ({longest} in the prompt, {requested - longest} for the completion). "
            "Please reduce the length of the prompt or the completion.")


def _render(tok: PromptTokenizer, body: dict[str, Any], kind: str) -> tuple[str, bool] | None:
    """The prompt text of a single-text request (None: not one, or not for this router)."""
    try:
        return tok.prompt_text(body, kind)
    except UnsupportedPrompt:
        return None
    except TokenizeError as e:
        raise BadRequest(str(e)) from e


def _rendered_now(tok: PromptTokenizer, body: dict[str, Any], kind: str) -> Rendered | None:
    """The prompt of a request routed before it was rendered (background thread)."""
    got = tok.prompt_text(body, kind)
    return Rendered(got[0], got[1], len(got[0])) if got is not None else None


async def _woken(wake: asyncio.Event) -> None:
    """Wait for ``wake``, at most :data:`SETTLE_DELAY_S`."""
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(wake.wait(), SETTLE_DELAY_S)


def _make_index(spec: str, namespace: str) -> Index:
    if spec == "memory":
        return MemoryIndex()
    from indexer.redis_index import RedisIndex

    return RedisIndex(spec, namespace=namespace)


async def _warn_if_unfilled(index: Index, config: Config) -> None:
    """A router reading a Redis index that ``kvrouter indexer`` fills: say at start when
    the namespace holds none of a model's blocks. The indexer may not have started yet, or
    it writes another ``index_namespace``; in the second case every lookup would miss
    without a word, so the warning names the key to compare."""
    models = getattr(index, "models", None)
    if models is None:
        return
    try:
        written = await asyncio.to_thread(models)
    except Exception as e:  # noqa: BLE001 - Redis may come up after the router; lookups then fall back
        log.warning("index_namespace %r: cannot read the Redis index at start: %r", config.index_namespace, e)
        return
    missing = [m.name for m in config.models if m.name not in written]
    if missing:
        log.warning("index_namespace %r holds no blocks of %s yet: check that kvrouter indexer runs with the same "
                    "config (its --namespace, if given, must equal index_namespace)", config.index_namespace,
                    ", ".join(missing))


def _validate_fields(body: dict[str, Any], kind: str) -> None:
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' is required and must be a non-empty list", code="missing_messages")
    elif "prompt" not in body or body["prompt"] is None:
        raise BadRequest("'prompt' is required", code="missing_prompt")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean")
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise BadRequest(f"'{key}' must be a non-negative integer")


def _session_key(body: dict[str, Any], headers: Any, header: str) -> str | None:
    key = headers.get(header)
    if key:
        return key
    user = body.get("user")
    return user if isinstance(user, str) and user else None


# -- HTTP layer ---------------------------------------------------------------------


async def _read_body(request: Request, limit: int) -> bytes:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise BodyTooLarge(f"request body of {length} bytes is over the {limit}-byte limit")
    if length is not None:
        body = await request.body()
    else:
        chunks = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge(f"request body is over the {limit}-byte limit")
            chunks.append(chunk)
        body = b"".join(chunks)
    if len(body) > limit:
        raise BodyTooLarge(f"request body of {len(body)} bytes is over the {limit}-byte limit")
    return body


def _parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = _decoder.decode(raw)
    except UnicodeDecodeError as e:
        raise BadRequest(f"request body is not valid UTF-8: {e}", code="invalid_encoding") from None
    except msgspec.DecodeError as e:
        raise BadRequest(f"request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise BadRequest("request body is nested too deeply", code="invalid_json") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object", code="invalid_json")
    return body


def _json(obj: Any, status: int = 200) -> Response:
    return Response(_encoder.encode(obj), status_code=status, media_type="application/json")


def create_app(config: Config, index: Index | None = None) -> Endpoints:
    router = Router(config, index)
    settings = config.router
    access = Access(settings)
    if access.admin_same_as_client:
        log.warning("router.admin_api_key equals router.api_key: every client can call /debug/*")
    expose_reason = settings.expose_decision_headers
    pass_authorization = settings.forward_client_authorization

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="kvrouter", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.router = router
    endpoints = Endpoints(app)

    def route(path: str, method: str) -> Any:
        """Endpoints called straight from :class:`router.dispatch.Endpoints`; FastAPI keeps
        the lifespan and answers whatever is not ours."""

        def register(endpoint: Any) -> Any:
            endpoints.add(method, path, endpoint)
            return endpoint

        return register

    async def read_json(request: Request) -> tuple[bytes, dict[str, Any], float]:
        """The body, parsed, and when it was fully received (the overhead clock starts there:
        a slow client's upload is not the router's time)."""
        t0 = time.perf_counter()
        raw = await _read_body(request, settings.max_body_bytes)
        received = time.perf_counter()
        metrics.BODY_SECONDS.observe(received - t0)
        return raw, _parse_json(raw), received

    def upstream_headers(request: Request) -> tuple[dict[str, str], str | None]:
        """What the engines get of the request's headers, and the client's Authorization
        when it is passed on (only to backends without a key of their own)."""
        headers = request.headers
        return forwarded_headers(headers), headers.get("authorization") if pass_authorization else None

    async def openai(request: Request, kind: str, path: str) -> Response:
        access.client(request.headers)
        forwarded, client_auth = upstream_headers(request)
        raw, body, started = await read_json(request)
        prepared = await router.prepare(body, len(raw), kind, request.headers, defer=True)
        chosen = prepared.decision.backend
        prefill = router.prefill_tokens(prepared)
        # Taken before the next await so the next decision already sees this request.
        ticket = router.loads.acquire(chosen, prepared.ctx.keys, prefill[chosen])
        router.commit(prepared, chosen)
        if prepared.deferred is not None:
            on_done: Any = router.settle_later(prepared, ticket).wake.set
        else:
            on_done = router.learn_later(prepared)
        return ProxyResponse(
            pool=router.pool,
            loads=router.loads,
            order=prepared.decision.order,
            method="POST",
            path=path,
            body=raw,
            headers=forwarded,
            stream=body.get("stream") is True,
            keys=prepared.ctx.keys,
            prefill_tokens=prefill,
            model=prepared.runtime.config.name,
            policy=prepared.runtime.policy.name,
            started=started,
            retries=settings.retries,
            reason=prepared.decision.reason if expose_reason else None,
            client_authorization=client_auth,
            ticket=ticket,
            on_fallback=lambda backend: router.commit(prepared, backend),
            on_done=on_done,
        )

    @route("/v1/chat/completions", "POST")
    async def chat_completions(request: Request) -> Response:
        return await openai(request, "chat", "/v1/chat/completions")

    @route("/v1/completions", "POST")
    async def completions(request: Request) -> Response:
        return await openai(request, "completion", "/v1/completions")

    async def passthrough(request: Request, path: str) -> Response:
        access.client(request.headers)
        forwarded, client_auth = upstream_headers(request)
        raw, body, started = await read_json(request)
        rt, order = router.pick_any(body)
        return ProxyResponse(
            pool=router.pool,
            loads=router.loads,
            order=order,
            method="POST",
            path=path,
            body=raw,
            headers=forwarded,
            stream=False,
            keys=[],
            prefill_tokens={},
            model=rt.config.name,
            policy="passthrough",
            started=started,
            retries=settings.retries,
            client_authorization=client_auth,
        )

    @route("/v1/embeddings", "POST")
    async def embeddings(request: Request) -> Response:
        return await passthrough(request, "/v1/embeddings")

    @route("/tokenize", "POST")
    async def tokenize(request: Request) -> Response:
        return await passthrough(request, "/tokenize")

    @route("/detokenize", "POST")
    async def detokenize(request: Request) -> Response:
        return await passthrough(request, "/detokenize")

    @route("/v1/models", "GET")
    async def models(request: Request) -> Response:
        access.client(request.headers)
        data = []
        for rt in router.models.values():
            data.append({"id": rt.config.name, "object": "model", "created": 0, "owned_by": "kvrouter", "root": rt.config.name, "parent": None, "max_model_len": rt.max_model_len})
            for a in rt.config.lora_adapters:
                data.append({"id": a.name, "object": "model", "created": 0, "owned_by": "kvrouter", "root": a.path, "parent": rt.config.name, "max_model_len": rt.max_model_len})
        return _json({"object": "list", "data": data})

    @route("/health", "GET")
    async def health(_: Request) -> Response:
        if router.can_route():
            return _json({"status": "ok"})
        return _json({"status": "unavailable", "reason": "a model has no healthy backend"}, 503)

    @route("/metrics", "GET")
    async def prometheus(_: Request) -> Response:
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    @route("/debug/route", "POST")
    async def debug_route(request: Request) -> Response:
        access.admin(request.headers)
        raw, body, _ = await read_json(request)
        kind = "chat" if "messages" in body else "completion"
        prepared = await router.prepare(body, len(raw), kind, request.headers)
        ctx, decision = prepared.ctx, prepared.decision
        answer: dict[str, Any] = {
            "backend": decision.backend,
            "policy": prepared.runtime.policy.name,
            "reason": decision.reason,
            "model": prepared.runtime.config.name,
            "num_tokens": ctx.num_tokens,
            "block_size": ctx.block_size,
            "num_blocks": len(ctx.keys),
            "order": decision.order,
            "events_connected": ctx.events_connected,
            "detail": decision.detail,
            "candidates": [
                {
                    "backend": c.backend,
                    "healthy": c.healthy,
                    "matched_blocks": c.matched_blocks,
                    "predicted_cached_tokens": c.predicted_cached_tokens(ctx.num_tokens, ctx.block_size),
                    "speculative_blocks": c.speculative_blocks,
                    "weighted_blocks": c.weighted_blocks,
                    "dp_rank": c.best_rank,
                    "load": c.load.snapshot(),
                    "score": c.score,
                }
                for c in prepared.candidates
            ],
        }
        if request.query_params.get("include_tokens", "").lower() in ("1", "true", "yes"):
            answer["token_ids"] = prepared.token_ids
        return _json(answer)

    @route("/debug/index", "GET")
    async def debug_index(request: Request) -> Response:
        """Every block key the index holds per worker (``?model=``, default the first): the
        chaos suite's comparison with the engines' true caches. A full copy: small fleets only."""
        access.admin(request.headers)
        model = request.query_params.get("model") or next(iter(router.models))
        if model not in router.models:
            raise UnknownModel(f"The model `{model}` does not exist.")
        held = await asyncio.to_thread(router.index.worker_keys, model)
        workers = [{"backend": w.backend, "dp_rank": w.dp_rank, "keys": sorted(keys)} for w, keys in sorted(held.items())]
        return _json({"model": model, "workers": workers})

    @route("/debug/backends", "GET")
    async def debug_backends(request: Request) -> Response:
        access.admin(request.headers)
        stats = router.stream_stats()
        out = []
        for name, b in router.pool.backends.items():
            entry: dict[str, Any] = b.describe()
            entry["models"] = [rt.config.name for rt in router.models.values() if name in rt.backends]
            entry["load"] = router.loads.get(name).snapshot()
            streams = [{"dp_rank": w.dp_rank, **dataclasses.asdict(st)} for w, st in sorted(stats.items()) if w.backend == name]
            entry["event_streams"] = streams
            entry["connected"] = bool(streams) and all(s["connected"] for s in streams)
            entry["last_seq"] = streams[0]["last_seq"] if streams else None
            for k in ("gaps", "replays", "blocks"):
                entry[k] = sum(s[k] for s in streams)
            entry["rehash_mode"] = any(s["rehash_mode"] for s in streams)
            out.append(entry)
        return _json({"backends": out})

    return endpoints
