"""The router's HTTP surface: the OpenAI endpoints, /health, /metrics and /debug/*.

Each endpoint checks access, reads the body (:mod:`router.parse`) and hands it to the
request path (:mod:`router.request_path`), which reads top to bottom: plan, look up,
choose, send, settle. ``/debug/route`` runs only its deciding half, which changes
nothing. Errors are raised as :mod:`router.errors` exceptions and answered by
:class:`router.dispatch.Endpoints` (and by :func:`router.errors.error_response` inside
the proxy).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import Response

from indexer.index import Index
from router import metrics
from router.auth import Access
from router.config import Config
from router.core import Router
from router.dispatch import Endpoints
from router.errors import ShuttingDown, UnknownModel
from router.parse import json_response, parse_json, read_body
from router.proxy import ProxyResponse, Upstream, forwarded_headers

log = logging.getLogger(__name__)


def create_app(config: Config, index: Index | None = None) -> Endpoints:
    router = Router(config, index)
    settings = config.router
    access = Access(settings)
    if access.admin_same_as_client:
        log.warning("router.admin_api_key equals router.api_key: every client can call /debug/*")
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
        a slow client's upload is not the router's time). A draining router takes no new
        request (one can still arrive on a connection opened before the drain)."""
        if router.draining:
            raise ShuttingDown("the router is shutting down; send the request to another replica")
        t0 = time.perf_counter()
        raw = await read_body(request, settings.max_body_bytes)
        received = time.perf_counter()
        metrics.BODY_SECONDS.observe(received - t0)
        return raw, parse_json(raw), received

    def upstream_headers(request: Request) -> tuple[dict[str, str], str | None]:
        """What the engines get of the request's headers, and the client's Authorization
        when it is passed on (only to backends without a key of their own)."""
        headers = request.headers
        return forwarded_headers(headers), headers.get("authorization") if pass_authorization else None

    async def openai(request: Request, kind: str, path: str) -> Response:
        access.client(request.headers)
        forwarded, client_auth = upstream_headers(request)
        raw, body, started = await read_json(request)
        decided = await router.path.decide(body, len(raw), kind, request.headers, act=True)
        await router.path.order(decided)
        return router.path.send(decided, path, raw, forwarded, client_auth, started)

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
        return ProxyResponse(router.path.upstreams, Upstream(
            path, raw, forwarded, order, rt.name, "passthrough", started, client_authorization=client_auth))

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
        for rt in router.models:
            data.append({"id": rt.name, "object": "model", "created": 0, "owned_by": "kvrouter", "root": rt.name, "parent": None, "max_model_len": rt.max_model_len})
            for a in rt.config.lora_adapters:
                data.append({"id": a.name, "object": "model", "created": 0, "owned_by": "kvrouter", "root": a.path, "parent": rt.name, "max_model_len": rt.max_model_len})
        return json_response({"object": "list", "data": data})

    @route("/health", "GET")
    async def health(_: Request) -> Response:
        if router.draining:
            return json_response({"status": "draining", "reason": "the router is shutting down"}, 503)
        if router.can_route():
            return json_response({"status": "ok"})
        return json_response({"status": "unavailable", "reason": "a model has no healthy backend"}, 503)

    @route("/metrics", "GET")
    async def prometheus(_: Request) -> Response:
        return Response(await metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @route("/debug/route", "POST")
    async def debug_route(request: Request) -> Response:
        """The decision the request would get, without sending it: only the deciding
        stages run, so nothing changes (no load, policy memory, counters or settles)."""
        access.admin(request.headers)
        raw, body, _ = await read_json(request)
        kind = "chat" if "messages" in body else "completion"
        decided = await router.path.decide(body, len(raw), kind, request.headers)
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
        }
        if request.query_params.get("include_tokens", "").lower() in ("1", "true", "yes"):
            answer["token_ids"] = decided.token_ids
        return json_response(answer)

    @route("/debug/index", "GET")
    async def debug_index(request: Request) -> Response:
        """Every block key the index holds per worker (``?model=``, default the first): the
        chaos suite's comparison with the engines' true caches. A full copy: small fleets only."""
        access.admin(request.headers)
        model = request.query_params.get("model") or next(iter(router.models)).name
        if model not in router.models.runtimes:
            raise UnknownModel(f"The model `{model}` does not exist.")
        held = await asyncio.to_thread(router.index.worker_keys, model)
        workers = [{"backend": w.backend, "dp_rank": w.dp_rank, "keys": sorted(keys)} for w, keys in sorted(held.items())]
        return json_response({"model": model, "workers": workers})

    @route("/debug/backends", "GET")
    async def debug_backends(request: Request) -> Response:
        access.admin(request.headers)
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
            out.append(entry)
        return json_response({"backends": out, **router.sharing()})

    return endpoints
