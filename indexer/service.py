"""``kvrouter indexer --config FILE [--redis URL] [--port P]``: the fleet's KV events into Redis.

The scale-out path (``configs/indexer-redis.yaml``): one indexer process follows every
engine's event stream and writes the shared :class:`RedisIndex`; any number of
stateless router replicas, configured with the same Redis URL as their ``index``, read
it with one round trip per request. Only one process should ingest a given fleet into
a given Redis namespace: two writers would apply every batch twice, which is harmless
for stores and removals but makes their clears (restarts, lost history) race.

Serves ``GET /health`` (200 while the ingest thread runs and Redis answers, else 503
with the reason), ``GET /metrics`` (the subscriber's Prometheus series) and
``GET /debug/streams`` (every stream's :class:`StreamStats`).

``/debug/*`` takes the router's admin key, read from the same config file
(``router.admin_api_key``, or ``KVROUTER_ADMIN_API_KEY``), with the router's rules: with
an admin key it must be sent (``Authorization: Bearer KEY``); with only client keys
(``router.api_key``, ``router.tenants``) it is closed (403); with no key at all it is open, for local use.
``/health`` and ``/metrics`` stay open, as the router's do. The Redis URL is logged and
reported with its password shown as ``***``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict

import redis
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from indexer.index import KeyCaps
from indexer.redis_index import RedisIndex
from kvconfig import RouterSettings, bearer_matches, redact_url
from indexer.subscriber import FleetSubscriber, specs_from_config
from indexer.verify import verifiers_from_config

log = logging.getLogger(__name__)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="fleet config (YAML): models and their backends' kv_events")
    parser.add_argument("--redis", default=None, help="Redis URL to write (default: the config's index, if it is one)")
    parser.add_argument("--host", default="127.0.0.1", help="address for /health and /metrics")
    parser.add_argument("--port", type=int, default=8090, help="port for /health and /metrics")
    parser.add_argument("--namespace", default=None,
                        help="Redis key prefix (default: the namespace parameter of the config's index URL, which the routers read)")
    parser.add_argument("--dead-grace-s", type=float, default=30.0, help="purge a worker disconnected this long")
    parser.add_argument("--no-verify", action="store_true", help="do not check the engines' block hashes")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def _error(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "code": code}}, status_code=status)


def admin_refusal(keys: RouterSettings, authorization: str | None) -> JSONResponse | None:
    """Why a ``/debug/*`` request may not be answered (None: it may), by the router's rules."""
    if keys.admin_api_key is not None:
        if not bearer_matches(authorization, keys.admin_api_key.get_secret_value().encode()):
            return _error(401, "Incorrect admin API key provided.", "invalid_api_key")
    elif keys.api_key is not None or keys.tenants:
        return _error(403, "Admin endpoints are disabled: the config has no admin_api_key.", "admin_disabled")
    return None


REDIS_CHECK_S = 1.0
"""How often the indexer checks that Redis still holds what it wrote (:meth:`RedisIndex.state_lost`)."""


async def _watch_redis(index: RedisIndex, subscriber: FleetSubscriber) -> None:
    """Rebuild every worker when Redis comes back empty; an unreachable Redis is checked again."""
    while True:
        try:
            if await asyncio.to_thread(index.state_lost):
                subscriber.resync_all("Redis lost the index (restarted empty or flushed)")
        except redis.RedisError:
            pass
        await asyncio.sleep(REDIS_CHECK_S)


def create_app(subscriber: FleetSubscriber, index: RedisIndex, registry: CollectorRegistry, redis_url: str,
               keys: RouterSettings | None = None) -> FastAPI:
    """The indexer's small HTTP surface; the lifespan starts and stops ingestion.
    ``keys``: the config's ``router`` section, whose keys guard ``/debug/*``."""
    probe = redis.Redis.from_url(redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
    keys = keys or RouterSettings()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        subscriber.start()
        watch = asyncio.create_task(_watch_redis(index, subscriber))
        try:
            yield
        finally:
            watch.cancel()
            await asyncio.to_thread(subscriber.stop)
            index.close()
            probe.close()

    app = FastAPI(title="kvrouter indexer", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/health")
    async def health() -> JSONResponse:
        if not subscriber.running:
            return JSONResponse({"status": "error", "reason": "ingest thread is not running"}, status_code=503)
        try:
            await asyncio.to_thread(probe.ping)
        except Exception as e:
            return JSONResponse({"status": "error", "reason": f"redis: {e}"}, status_code=503)
        return JSONResponse({"status": "ok", "streams": len(subscriber.stats())})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/debug/streams")
    async def streams(request: Request) -> JSONResponse:
        refusal = admin_refusal(keys, request.headers.get("authorization"))
        if refusal is not None:
            return refusal
        stats = await asyncio.to_thread(subscriber.stats)
        return JSONResponse(
            [{"backend": w.backend, "dp_rank": w.dp_rank, **asdict(s)} for w, s in sorted(stats.items())]
        )

    return app


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from kvconfig import ConfigError, load_config

    try:
        config = load_config(args.config)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    url = args.redis or (config.index_url if config.index != "memory" else None)
    if url is None:
        print(f"{args.config}: give --redis URL (the config's index is 'memory')", file=sys.stderr)
        return 2
    caps = KeyCaps()
    try:
        specs = specs_from_config(config)
        verifiers = {} if args.no_verify else verifiers_from_config(config, caps)
    except ValueError as e:
        print(f"{args.config}: {e}", file=sys.stderr)
        return 2
    if not specs:
        print(f"{args.config}: no backend has kv_events; nothing to ingest", file=sys.stderr)
        return 2
    try:
        redis.Redis.from_url(url, socket_timeout=5.0, socket_connect_timeout=5.0).ping()
    except (redis.RedisError, ValueError) as e:
        print(f"cannot reach Redis at {redact_url(url)}: {e}", file=sys.stderr)
        return 2
    namespace = args.namespace or config.index_namespace
    if namespace != config.index_namespace:
        log.warning("--namespace %r is not the config's namespace %r: routers reading %s will not see "
                    "what this indexer writes", namespace, config.index_namespace, args.config)
    index = RedisIndex(url, namespace=namespace, caps=caps)
    registry = CollectorRegistry()
    subscriber = FleetSubscriber(index, specs, verifiers=verifiers, dead_grace_s=args.dead_grace_s,
                                 metrics_registry=registry)
    log.info("ingesting %d event streams into %s (namespace %s)", len(specs), redact_url(url), namespace)
    uvicorn.run(create_app(subscriber, index, registry, url, config.router), host=args.host, port=args.port,
                log_level=args.log_level, access_log=False)
    return 0
