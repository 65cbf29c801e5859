"""The router's HTTP surface: the OpenAI endpoints, /health, /metrics and /debug/*.

Each endpoint is one method of :class:`Handlers` (:data:`ROUTES` lists them): it checks
access, reads the body (:mod:`router.parse`) and hands it to the request path
(:mod:`router.request_path`), which reads top to bottom: plan, look up, choose, send, settle. ``/debug/route`` runs only its deciding half, which changes
nothing. Errors are raised as :mod:`router.http.errors` exceptions and answered by
:class:`router.http.dispatch.Endpoints` (and by :func:`router.http.errors.error_response` inside
the proxy).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import re
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import Response

from indexer.index import Index
from router import metrics
from router.http.auth import Access
from kvconfig import Config, KeysFromEnv
from router.core import Router
from router.http import observe
from router.http.dispatch import Endpoints
from router.attempt import Attempts
from router.http.errors import BadRequest, ShuttingDown, UnknownModel
from router.http.responses import LEAST_LOADED, ResponseIds, ResponseMemory, Route
from router.http.sse import ANTHROPIC, OPENAI, RESPONSES, Dialect
from router.parse import json_response, parse_body, read_body
from router.http.proxy import ProxyResponse, Upstream, forwarded_headers
from router.http.tenants import Tenant, Tenants, salted
from router.tuning import Tuning

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer

log = logging.getLogger(__name__)

_RESPONSE_ID = re.compile(r"[A-Za-z0-9_.:~-]{1,256}")
"""What the router passes on as a response id in a path (vLLM's are ``resp_`` and hex digits)."""


def create_app(config: Config, index: Index | None = None, tuning: Tuning | None = None,
               tracer: Tracer | None = None) -> Endpoints:
    """The ASGI app: FastAPI owns start-up and shutdown, :class:`router.http.dispatch.Endpoints`
    calls :class:`Handlers`' methods straight for the routes of :data:`ROUTES`. With a
    ``tracer`` (:func:`router.http.tracing.start`) every request but a probe gets its spans;
    without one nothing of OpenTelemetry is imported."""
    secret = KeysFromEnv().salt_secret
    tenants = Tenants(config.router, secret if secret is not None and secret.get_secret_value() else None)
    router = Router(config, index, tuning)
    handlers = Handlers(router, Access(config.router, tenants))
    if handlers.access.admin_same_as_client:
        log.warning("router.admin_api_key equals router.api_key: every client can call /debug/*")

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="kvrouter", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.router = router
    observer = observe.Observed
    if tracer is not None:
        from router.http.spans import traced

        observer = traced(tracer, {path for _, path in ROUTES})
    endpoints = Endpoints(app, observer)
    for (method, path), name in ROUTES.items():
        endpoints.add(method, path, getattr(handlers, name))
    # Matched by the fallback (a parameter in the path):
    endpoints.add("GET", "/v1/models/{model_id:path}", handlers.model)
    endpoints.add("GET", "/v1/responses/{response_id}", handlers.retrieve_response)
    endpoints.add("POST", "/v1/responses/{response_id}/cancel", handlers.cancel_response)
    return endpoints


ROUTES = {
    ("POST", "/v1/chat/completions"): "chat_completions",
    ("POST", "/v1/completions"): "completions",
    ("POST", "/v1/embeddings"): "embeddings",
    ("POST", "/v1/responses"): "responses",
    ("POST", "/v1/messages"): "messages",
    ("POST", "/tokenize"): "tokenize",
    ("POST", "/detokenize"): "detokenize",
    ("GET", "/v1/models"): "models",
    ("GET", "/health"): "health",
    ("GET", "/livez"): "livez",
    ("GET", "/readyz"): "readyz",
    ("GET", "/metrics"): "prometheus",
    ("POST", "/debug/route"): "debug_route",
    ("GET", "/debug/index"): "debug_index",
    ("GET", "/debug/backends"): "debug_backends",
}
"""Every endpoint of the router: (method, path) -> the :class:`Handlers` method answering it."""


class Handlers:
    """One method per endpoint, each ``Request -> Response``: access, body, the request path."""

    def __init__(self, router: Router, access: Access) -> None:
        self.router = router
        self.access = access
        self.settings = router.settings
        self.stored = ResponseMemory()
        """Where this process's ``/v1/responses`` answers were made (:mod:`router.http.responses`)."""

    async def read_json(self, request: Request) -> tuple[bytes, dict[str, Any], float]:
        """The body, parsed, and when it was fully received (the overhead clock starts there:
        a slow client's upload is not the router's time). A draining router takes no new
        request (one can still arrive on a connection opened before the drain)."""
        if self.router.draining:
            raise ShuttingDown("the router is shutting down; send the request to another replica")
        t0 = time.perf_counter()
        raw = await read_body(request, self.settings.max_body_bytes)
        received = time.perf_counter()
        metrics.BODY_SECONDS.observe(received - t0)
        return raw, await parse_body(raw), received

    def upstream_headers(self, request: Request) -> tuple[dict[str, str], str | None]:
        """What the engines get of the request's headers, and the client's Authorization
        when it is passed on (only to backends without a key of their own)."""
        headers = request.headers
        passed = headers.get("authorization") if self.settings.forward_client_authorization else None
        return forwarded_headers(headers), passed

    def tenant(self, request: Request, prompt_follows: bool = False) -> Tenant | None:
        """Access, and the request's tenant held to its request rate and noted for its
        answer's usage (:mod:`router.http.tenants`); ``prompt_follows``: its prompt tokens are
        taken once counted (:meth:`take_prompt`), and it is admitted then."""
        tenant = self.access.client(request.headers)
        if tenant is not None:
            Tenants.admit(tenant, self.share())
            if (note := observe.current()) is not None:
                note.tenant = tenant
            if not prompt_follows:
                Tenants.admitted(tenant)
        return tenant

    def share(self) -> float:
        """This process's part of a tenant's limits: 1 / the host's router workers."""
        ring = self.router.ring
        return 1.0 / ring.n_workers if ring is not None else 1.0

    def take_prompt(self, tenant: Tenant, tokens: int) -> None:
        Tenants.admit_prompt(tenant, tokens, self.share())
        if (note := observe.current()) is not None:
            note.charged = tokens
        Tenants.admitted(tenant)

    async def openai(self, request: Request, kind: str, path: str) -> Response:
        """The request path, every stage (:mod:`router.request_path`), on the body with its
        tenant's ``cache_salt``: the blocks are hashed as the engine will hash them."""
        tenant = self.tenant(request, prompt_follows=True)
        forwarded, client_auth = self.upstream_headers(request)
        raw, body, started = await self.read_json(request)
        raw = salted(tenant, raw, body)
        path_ = self.router.path
        decided = await path_.decide(body, len(raw), kind, request.headers, act=True, disconnected=request.receive,
                                     tenant=tenant.name if tenant is not None else None)
        try:
            if tenant is not None:
                self.take_prompt(tenant, decided.ctx.num_tokens)
            await path_.order(decided)
            return path_.send(decided, path, raw, forwarded, client_auth, started)
        finally:
            decided.admitted.taken()  # the queue may let the next one through

    async def chat_completions(self, request: Request) -> Response:
        return await self.openai(request, "chat", "/v1/chat/completions")

    async def completions(self, request: Request) -> Response:
        return await self.openai(request, "completion", "/v1/completions")

    async def passthrough(self, request: Request, path: str, streams: Dialect | None = None, salt: bool = False) -> Response:
        """Routed on load alone, least loaded first (no prompt to hash); ``streams``: the
        endpoint streams (``stream: true``) in that dialect; ``salt``: its prompt is cached,
        so it gets its tenant's ``cache_salt``."""
        tenant = self.tenant(request)
        forwarded, client_auth = self.upstream_headers(request)
        raw, body, started = await self.read_json(request)
        if salt:
            raw = salted(tenant, raw, body)
        rt, order = self.router.pick_any(body)
        stream = streams is not None and body.get("stream") is True
        return self.relay(Upstream(path, raw, forwarded, order, rt.name, "passthrough", started, stream=stream,
                                   client_authorization=client_auth, sse=streams or OPENAI),
                          Route(order, LEAST_LOADED), path)

    def relay(self, up: Upstream, route: Route, endpoint: str) -> ProxyResponse:
        """``up`` sent in ``route``'s order, each try counted by its reason (the first try's is
        the route's, a later one's ``fallback``) in ``kvrouter_passthrough_decisions`` and the
        access log. A search (a response not known to be on the first backend) may try every one."""
        upstreams = self.router.path.upstreams
        retries = max(upstreams.retries, len(route.order) - 1) if route.search else upstreams.retries
        up.order, up.not_found_moves = route.order, route.search
        if self.settings.expose_decision_headers:
            up.reason = route.reason
        first, model = route.order[0], up.model

        def count(backend: str) -> None:
            reason = route.reason if backend == first else "fallback"
            if (note := observe.current()) is not None:
                note.reason = reason
            metrics.child(metrics.PASSTHROUGH_DECISIONS, model, endpoint, reason).inc()

        attempts = Attempts(upstreams.pool, upstreams.loads, retries, route.order, model, up.policy, up.started,
                            commit=count)
        return ProxyResponse(upstreams, up, attempts)

    async def responses(self, request: Request) -> Response:
        """``POST /v1/responses``: a follow-up (``previous_response_id``) to the engine that made
        the response it names, anything else least loaded (:mod:`router.http.responses`)."""
        tenant = self.tenant(request)
        forwarded, client_auth = self.upstream_headers(request)
        raw, body, started = await self.read_json(request)
        raw = salted(tenant, raw, body)
        rt, least = self.router.pick_any(body)
        previous = body.get("previous_response_id")
        if previous is not None and not isinstance(previous, str):
            raise BadRequest("'previous_response_id' must be a string", code="invalid_previous_response_id")
        route = self.stored.route(previous, least)
        watch = ResponseIds(self.stored, rt.name, previous if route.search else None, body.get("store") is not False)
        return self.relay(Upstream("/v1/responses", raw, forwarded, route.order, rt.name, "passthrough", started,
                                   stream=body.get("stream") is True, client_authorization=client_auth, sse=RESPONSES,
                                   watch=watch), route, "/v1/responses")

    async def retrieve_response(self, request: Request) -> Response:
        return await self.stored_response(request, "GET", "")

    async def cancel_response(self, request: Request) -> Response:
        return await self.stored_response(request, "POST", "/cancel")

    async def stored_response(self, request: Request, method: str, action: str) -> Response:
        """``GET /v1/responses/{id}`` (its query, ``stream`` and ``starting_after``, passed on)
        and ``POST /v1/responses/{id}/cancel``: to the engine that made the response, which
        alone holds it; one this process does not remember is searched for among every backend."""
        self.tenant(request)
        if self.router.draining:
            raise ShuttingDown("the router is shutting down; send the request to another replica")
        response_id = request.scope["path"].removeprefix("/v1/responses/").removesuffix(action)
        if not _RESPONSE_ID.fullmatch(response_id) or response_id in (".", ".."):
            raise BadRequest(f"{response_id[:100]!r} is not a response id", code="invalid_response_id")
        forwarded, client_auth = self.upstream_headers(request)
        raw = await read_body(request, self.settings.max_body_bytes) if method == "POST" else b""
        started = time.perf_counter()
        known = self.stored.where(response_id)
        router = self.router
        if known is not None and known[0] in router.models.runtimes:
            model, names = known[0], router.models.runtimes[known[0]].backends
        else:
            model, names = "*", list(router.pool.backends)
        route = self.stored.route(response_id, router.least_loaded(names, "a stored response"))
        query = request.scope["query_string"].decode("latin-1")
        stream = request.query_params.get("stream", "").lower() in ("1", "true", "yes", "on")
        path = f"/v1/responses/{response_id}{action}" + (f"?{query}" if query else "")
        return self.relay(Upstream(path, raw, forwarded, route.order, model, "passthrough", started, stream=stream,
                                   client_authorization=client_auth, method=method, sse=RESPONSES,
                                   watch=ResponseIds(self.stored, model, response_id if route.search else None, False)),
                          route, f"/v1/responses/{{id}}{action}")

    async def messages(self, request: Request) -> Response:
        """``POST /v1/messages`` (Anthropic's API), least loaded, as embeddings are. vLLM renders
        its prompt by converting it to a chat request first
        (``AnthropicServingMessages._convert_anthropic_to_openai_request``: system, text, image,
        thinking, tool_use and tool_result blocks, and the tools the template renders). Hashing
        it exactly means reproducing that conversion for each vLLM version and checking it
        against real engines, as chat rendering is; a cheap approximation would predict cache
        hits the engines do not have."""
        return await self.passthrough(request, "/v1/messages", ANTHROPIC, salt=True)

    async def embeddings(self, request: Request) -> Response:
        return await self.passthrough(request, "/v1/embeddings")

    async def tokenize(self, request: Request) -> Response:
        return await self.passthrough(request, "/tokenize")

    async def detokenize(self, request: Request) -> Response:
        return await self.passthrough(request, "/detokenize")

    async def models(self, request: Request) -> Response:
        self.tenant(request)
        return json_response({"object": "list", "data": self._model_entries()})

    def _model_entries(self) -> list[dict[str, Any]]:
        data: list[dict[str, Any]] = []
        for rt in self.router.models:
            data.append({"id": rt.name, "object": "model", "created": 0, "owned_by": "kvrouter", "root": rt.name,
                         "parent": None, "max_model_len": rt.max_model_len})
            for a in rt.config.lora_adapters:
                data.append({"id": a.name, "object": "model", "created": 0, "owned_by": "kvrouter", "root": a.path,
                             "parent": rt.name, "max_model_len": rt.max_model_len})
        return data

    async def model(self, request: Request) -> Response:
        """``GET /v1/models/{id}``: one entry of :meth:`models` (the openai SDK's ``models.retrieve``)."""
        self.tenant(request)
        wanted = request.path_params["model_id"]
        for entry in self._model_entries():
            if entry["id"] == wanted:
                return json_response(entry)
        raise UnknownModel(f"The model `{wanted}` does not exist.")

    async def livez(self, _: Request) -> Response:
        """Liveness: the process and its event loop answer (a Kubernetes liveness probe; never
        503 for the fleet's sake, or a fleet outage would restart every router)."""
        return json_response({"status": "alive"})

    async def readyz(self, request: Request) -> Response:
        """Readiness: started, every model has a healthy backend, not draining (what ``/health`` says)."""
        return await self.health(request)

    async def health(self, _: Request) -> Response:
        if self.router.draining:
            return json_response({"status": "draining", "reason": "the router is shutting down"}, 503)
        if self.router.can_route():
            return json_response({"status": "ok"})
        return json_response({"status": "unavailable", "reason": "a model has no healthy backend"}, 503)

    async def prometheus(self, request: Request) -> Response:
        self.access.admin(request.headers, "/metrics is (scrape it with router.admin_api_key)")
        return Response(await metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    async def debug_route(self, request: Request) -> Response:
        """The decision the request would get, without sending it: only the deciding
        stages run, so nothing changes (no load, policy memory, counters or settles)."""
        self.access.admin(request.headers)
        raw, body, _ = await self.read_json(request)
        kind = "chat" if "messages" in body else "completion"
        decided = await self.router.path.decide(body, len(raw), kind, request.headers)
        ctx, decision = decided.ctx, decided.decision
        answer: dict[str, Any] = {
            "backend": decision.backend,
            "policy": decided.rt.policy.name,
            "reason": decision.reason,
            "model": decided.rt.name,
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
                for c in decided.candidates
            ],
        } | self.router.sharing()
        if request.query_params.get("include_tokens", "").lower() in ("1", "true", "yes"):
            answer["token_ids"] = decided.token_ids
        return json_response(answer)

    async def debug_index(self, request: Request) -> Response:
        """Every block key the index holds per worker (``?model=``, default the first): the
        chaos suite's comparison with the engines' true caches. A full copy: small fleets only."""
        self.access.admin(request.headers)
        router = self.router
        model = request.query_params.get("model") or next(iter(router.models)).name
        if model not in router.models.runtimes:
            raise UnknownModel(f"The model `{model}` does not exist.")
        held = await asyncio.to_thread(router.index.worker_keys, model)
        workers = [{"backend": w.backend, "dp_rank": w.dp_rank, "keys": sorted(keys)} for w, keys in sorted(held.items())]
        return json_response({"model": model, "workers": workers})

    async def debug_backends(self, request: Request) -> Response:
        self.access.admin(request.headers)
        router = self.router
        stats = router.streams.stats()
        out = []
        for name, b in router.pool.backends.items():
            entry: dict[str, Any] = b.describe()
            entry["models"] = [rt.name for rt in router.models if name in rt.backends]
            entry["load"] = router.loads.get(name).snapshot()
            if router.ring is not None:
                entry["load_by_worker"] = router.loads.by_worker(name, router.worker, router.ring.n_workers)
            streams = [{"dp_rank": w.dp_rank, **dataclasses.asdict(st)} for w, st in sorted(stats.items()) if w.backend == name]
            entry["event_streams"] = streams
            entry["connected"] = bool(streams) and all(s["connected"] for s in streams)
            entry["last_seq"] = streams[0]["last_seq"] if streams else None
            for k in ("gaps", "replays", "blocks"):
                entry[k] = sum(s[k] for s in streams)
            entry["rehash_mode"] = any(s["rehash_mode"] for s in streams)
            entry.update(observe.FIDELITY.describe(name))
            out.append(entry)
        return json_response({"backends": out, **router.sharing()})
