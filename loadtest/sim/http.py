"""The HTTP surface of ``vllm serve`` (0.33) for one simulated engine.

Token ids come from :mod:`router.prompt.tokenize` (the renderer the router uses, checked
against vLLM's own), so ``/tokenize`` and the render endpoints answer what vLLM would.
Errors are OpenAI-shaped like vLLM's: ``{"error": {"message", "type", "param", "code"}}``,
400 for bad JSON or fields, for token ids out of vocabulary and for prompts over
``max_model_len``, 404 for an unknown model; an unknown path or method is answered in
the same shape (vLLM's ``http_exception_handler``).
``usage.prompt_tokens_details.cached_tokens`` is the request's prefix hit as the
block manager computed it at admission (never the whole prompt), GPU blocks plus those
loaded from the CPU offload tier, i.e. what vLLM reports with
``--enable-prompt-tokens-details`` (its ``num_cached_tokens`` counts connector hits).

Besides vLLM's endpoints: ``GET /debug/cache`` (the 64-bit hashes of every block
cached on the GPU, and in ``cpu_block_hashes_int64`` those the CPU offload tier
holds, each sorted: ground truth for index tests) and ``GET``/``POST /debug/fault``
(:mod:`loadtest.sim.faults`). With ``--debug-state``, ``GET /debug/state`` (what the engine
has received) and ``POST /debug/state`` (its exact state and predicted TTFT for a prompt:
:mod:`loadtest.sim.state`), the bench-only side channel of the oracle policy.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from indexer.hashing import to_int64
from loadtest.sim.apis import Generating, Sampling, add_api_routes
from loadtest.sim.engine import FINISHED, STATE_LOCK, EngineDead, SimRequest
from loadtest.sim.fields import ApiError, error_body, error_response
from loadtest.sim.fields import bool_field as _bool_field
from loadtest.sim.fields import int_field as _int_field
from loadtest.sim.fields import read_body as _body
from loadtest.sim.faults import FaultUpdate
from loadtest.sim.state import (
    KNOWN_PROMPTS,
    Prompt,
    PromptHashes,
    StateAhead,
    StateAsk,
    StateEngine,
    StatePrompt,
    snapshot,
)
from router.prompt.prompt_fields import TokenizeError

if TYPE_CHECKING:
    from loadtest.sim.fleet import Instance


_json = msgspec.json.Encoder()
_state_decoder = msgspec.json.Decoder(StateAsk)
"""Typed: the side channel's token-id lists are checked in C, not one Python isinstance per id
(that check cost more than the forward run on long prompts)."""


def _usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _sim_timing(req: SimRequest) -> dict[str, Any]:
    """The simulator's own extra on the usage chunk: the first prompt's TTFT in engine seconds.

    vLLM reports TTFT only as a histogram, whose coarse buckets (1.0, 2.5, 5.0 s...) make a
    p90 read off it land anywhere in a bucket; with this the bench gets every request's
    exact engine TTFT. Clients ignore unknown fields; a real vLLM simply has none.
    """
    if req.first_token_at is None:
        return {}
    return {"kvrouter_sim": {"engine_ttft_s": round(req.first_token_at - req.arrival, 6)}}


def create_app(inst: Instance) -> FastAPI:
    app = FastAPI(title="kvrouter sim", docs_url=None, redoc_url=None, openapi_url=None)
    model = inst.model_name
    max_model_len = inst.config.max_model_len

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param)

    @app.exception_handler(TokenizeError)
    async def _tok_error(_: Request, exc: TokenizeError) -> JSONResponse:
        return error_response(400, str(exc))

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse({"error": {"message": str(exc.detail), "type": HTTPStatus(exc.status_code).phrase, "param": None,
                                       "code": exc.status_code}}, status_code=exc.status_code, headers=exc.headers)

    @app.middleware("http")
    async def _pause(request: Request, call_next: Any) -> Response:
        if not request.url.path.startswith("/debug/fault"):
            pause = inst.faults.pause_left()
            if pause > 0:
                await asyncio.sleep(pause)
        return await call_next(request)

    def check_model(body: dict[str, Any]) -> None:
        name = body.get("model")
        if name is not None and name != model:
            raise ApiError(404, f"The model `{name}` does not exist.", "model")

    def check_length(n: int, max_tokens: int | None) -> int:
        if n == 0:
            raise ApiError(400, "The decoder prompt cannot be empty", "prompt")
        if n > max_model_len:
            raise ApiError(
                400,
                f"This model's maximum context length is {max_model_len} tokens. However, your request has "
                f"{n} input tokens. Please reduce the length of the input messages.",
            )
        if max_tokens is None:
            return max(1, max_model_len - n)
        if n + max_tokens > max_model_len:
            raise ApiError(
                400,
                f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum "
                f"context length is {max_model_len} tokens and your request has {n} input tokens "
                f"({max_tokens} > {max_model_len} - {n}).",
                "max_tokens",
            )
        return max_tokens

    max_token_id = inst.tokenizer.max_token_id

    def check_vocab(ids: list[int], param: str) -> list[int]:
        """vLLM's renderer refuses ids past the vocabulary (``Token id N is out of vocabulary``)."""
        if ids and (min(ids) < 0 or max(ids) > max_token_id):
            bad = min(ids) if min(ids) < 0 else max(ids)
            raise ApiError(400, f"Token id {bad} is out of vocabulary", param)
        return ids

    def prompts_of(body: dict[str, Any], chat: bool) -> list[list[int]]:
        if chat:
            if not isinstance(body.get("messages"), list) or not body["messages"]:
                raise ApiError(400, "messages must be a non-empty list", "messages")
            return [inst.tokenizer.chat_ids(body)]
        if "prompt" not in body or body["prompt"] is None:
            raise ApiError(400, "prompt is required", "prompt")
        try:
            return [check_vocab(ids, "prompt") for ids in inst.tokenizer.completion_ids(body)]
        except (TypeError, ValueError) as e:
            if isinstance(e, TokenizeError):
                raise
            raise ApiError(400, f"invalid prompt: {e}", "prompt") from e

    # -- plain endpoints ----------------------------------------------------------------

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": model, "object": "model", "created": int(inst.started), "owned_by": "vllm",
            "root": inst.tokenizer_path, "parent": None, "max_model_len": max_model_len,
            "permission": [],
        }
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(inst.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await _body(request)
        check_model(body)
        chat = "messages" in body
        ids = prompts_of(body, chat)
        if not chat and len(ids) != 1:
            raise ApiError(400, "tokenize takes a single prompt", "prompt")
        return {"count": len(ids[0]), "max_model_len": max_model_len, "tokens": ids[0], "token_strs": None}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        body = await _body(request)
        check_model(body)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise ApiError(400, "tokens must be a list of integers", "tokens")
        return {"prompt": inst.tokenizer.decode(check_vocab(tokens, "tokens"))}

    def render_one(body: dict[str, Any], ids: list[int]) -> dict[str, Any]:
        max_tokens = _int_field(body, "max_tokens", None, 1)
        check_length(len(ids), max_tokens)
        return {
            "request_id": f"{uuid.uuid4().hex}",
            "token_ids": ids,
            "features": None,
            "sampling_params": {"max_tokens": max_tokens, "min_tokens": _int_field(body, "min_tokens", 0, 0)},
            "model": body.get("model") or model,
            "stream": bool(body.get("stream", False)),
            "stream_options": body.get("stream_options"),
            "cache_salt": body.get("cache_salt"),
            "priority": body.get("priority", 0),
            "kv_transfer_params": None,
        }

    @app.post("/v1/chat/completions/render")
    async def render_chat(request: Request) -> dict[str, Any]:
        body = await _body(request)
        check_model(body)
        return render_one(body, prompts_of(body, True)[0])

    @app.post("/v1/completions/render")
    async def render_completions(request: Request) -> list[dict[str, Any]]:
        body = await _body(request)
        check_model(body)
        return [render_one(body, ids) for ids in prompts_of(body, False)]

    @app.get("/debug/cache")
    async def debug_cache() -> dict[str, Any]:
        bm = inst.engine.bm
        return {
            "block_hashes_int64": sorted(to_int64(h) for h in bm.pool.cached_hashes()),
            "cpu_block_hashes_int64": sorted(to_int64(h) for h in bm.cpu.cached_hashes()) if bm.cpu else [],
            "duplicate_blocks": bm.pool.num_duplicates(),
        }

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        if not inst.engine.reset_prefix_cache():
            return error_response(503, "cannot reset the prefix cache while requests hold KV blocks")
        return Response(status_code=200)

    @app.get("/debug/fault")
    async def get_fault() -> dict[str, Any]:
        return {**inst.faults.state(), "up": inst.up, "seq": inst.publisher.seq if inst.publisher else None}

    @app.post("/debug/fault")
    async def post_fault(request: Request) -> dict[str, Any]:
        body = await _body(request)
        try:
            update = FaultUpdate.model_validate(body)
        except ValidationError as e:
            raise ApiError(400, f"bad fault: {e.errors(include_url=False)}") from e
        inst.faults.apply(update)
        if "down_s" in body:
            inst.schedule_kill(update.down_s)
        return inst.faults.state()

    # -- the oracle's side channel (bench only) -------------------------------------------

    if inst.settings.debug_state:
        hashes = PromptHashes(inst.hasher)

        def state_prompt(spec: StatePrompt) -> Prompt:
            """The prompt's ids, else the body's prompt or messages tokenized; sampling fields from
            the body. Remembered by its ``id`` when it has one (later asks name it in ``ahead``)."""
            req = spec.request
            chat = (spec.kind or ("chat" if "messages" in req else "completion")) == "chat"
            ids = spec.token_ids if spec.token_ids is not None else prompts_of(req, chat)[0]
            if not ids:
                raise ApiError(400, "empty prompt", "token_ids")
            max_tokens = _int_field(req, "max_completion_tokens", None, 1) if chat else None
            if max_tokens is None:
                max_tokens = _int_field(req, "max_tokens", None if chat else 16, 1)
            room = max(1, max_model_len - len(ids))
            limit = room if max_tokens is None else max(1, min(max_tokens, room))
            min_tokens = min(_int_field(req, "min_tokens", 0, 0) or 0, limit)
            n_out = inst.generator.planned_length(ids, limit, min_tokens, _bool_field(req, "ignore_eos", False))
            salt = req.get("cache_salt")
            prompt = Prompt(len(ids), hashes.of(ids, salt if isinstance(salt, str) else None), n_out)
            if spec.id is not None:
                KNOWN_PROMPTS.remember(spec.id, prompt)
            return prompt

        def ahead_prompts(ahead: list[StateAhead], received: int) -> list[Prompt]:
            """The prompts in transit to an engine that has received ``received`` requests. One named
            by an id this process no longer remembers (it restarted, or the id is too old) is
            skipped and counted."""
            out = []
            for x in ahead:
                if x.n <= received:
                    continue
                prompt = state_prompt(x.prompt) if x.prompt is not None else KNOWN_PROMPTS.get(x.id)
                if prompt is None:
                    inst.metrics.state_unknown_ahead.inc()
                    continue
                out.append(prompt)
            return out

        def answer_state(raw: bytes) -> tuple[int, bytes]:
            """:class:`StateAsk`: the state of every listed engine of this process at one instant
            (``engines`` left out: this one, with the top-level ``ahead``). ``ahead`` are the
            client's k-th requests to that engine, for those it may not have received yet, each
            as a prompt or as the ``id`` of a prompt asked about before. Answers
            ``{"engines": [...]}`` in the same order, null for an engine that is down; a bad
            question gets a 400 in vLLM's error shape. Called from the side channel's own thread
            (:mod:`loadtest.sim.state_server`) and from ``POST /debug/state`` on the engine's port."""
            try:
                ask = _state_decoder.decode(raw)
                t0 = time.perf_counter()
                with STATE_LOCK:
                    asks = ask.engines if ask.engines is not None else [StateEngine(inst.spec.index, ask.ahead)]
                    prompt = state_prompt(ask.prompt)
                    answers: list[dict[str, Any] | None] = []
                    for a in asks:
                        peer = inst.peers.get(a.index)
                        if peer is None or not peer.up:
                            answers.append(None)
                            continue
                        engine = peer.engine
                        answers.append(snapshot(engine, prompt, ahead_prompts(a.ahead, engine.received)))
                inst.metrics.state_seconds.observe(time.perf_counter() - t0)
                return 200, _json.encode({"engines": answers})
            except msgspec.ValidationError as e:
                return 400, error_body(400, f"bad side-channel question: {e}")
            except msgspec.DecodeError as e:
                return 400, error_body(400, f"JSON decode error: {e}")
            except ApiError as e:
                return e.status, error_body(e.status, e.message, e.param)
            except TokenizeError as e:
                return 400, error_body(400, str(e))

        app.state.answer_state = answer_state

        @app.get("/debug/state")
        async def state_info() -> dict[str, Any]:
            return {"side_channel": "kvrouter-sim", "received": inst.engine.received,
                    "block_size": inst.config.block_size, "process": inst.process_id, "index": inst.spec.index,
                    "state_url": inst.state_url, "world_clock": inst.settings.world_clock}

        @app.post("/debug/state")
        async def state(request: Request) -> Response:
            status, body = answer_state(await request.body())
            return Response(body, status_code=status, media_type="application/json")

    # -- generation ---------------------------------------------------------------------

    def sampling(body: dict[str, Any], max_tokens: int | None) -> Sampling:
        """The body's sampling fields every generating endpoint reads, checked as vLLM does."""
        min_tokens = _int_field(body, "min_tokens", 0, 0) or 0
        if max_tokens is not None and min_tokens > max_tokens:
            raise ApiError(400, f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}.", "min_tokens")
        ignore_eos = _bool_field(body, "ignore_eos", False)
        cache_salt = body.get("cache_salt")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ApiError(400, "Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt")
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ApiError(400, "seed must be an integer", "seed")
        if seed is None and body.get("temperature") != 0:
            seed = inst.sampling_rng.getrandbits(64)
        return Sampling(max_tokens, min_tokens, ignore_eos, cache_salt, seed)

    async def admit(prompts: list[list[int]], s: Sampling) -> tuple[list[SimRequest], asyncio.Queue[tuple[int, Any]]]:
        """One request per prompt, added to the engine; their tokens come through the queue."""
        if inst.faults.extra_latency_s > 0:
            await asyncio.sleep(inst.faults.extra_latency_s)
        engine = inst.engine
        sink: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        reqs: list[SimRequest] = []
        for i, ids in enumerate(prompts):
            limit = check_length(len(ids), s.max_tokens)
            planned = inst.generator.plan(ids, limit, min(s.min_tokens, limit), s.ignore_eos, s.seed)
            reqs.append(engine.make_request(ids, planned, sink, index=i, cache_salt=s.cache_salt))
        for r in reqs:
            engine.add(r)
        return reqs, sink

    add_api_routes(app, inst, Generating(_body, check_model, sampling, lambda body: prompts_of(body, True)[0], admit))

    async def generate(request: Request, chat: bool) -> Response:
        body = await _body(request)
        check_model(body)
        if inst.faults.inject_error():
            return error_response(500, "injected fault: internal server error")
        stream = _bool_field(body, "stream", False)
        include_usage = stream and isinstance(body.get("stream_options"), dict) and bool(
            body["stream_options"].get("include_usage")
        )
        if _int_field(body, "n", 1, 1) != 1:
            raise ApiError(400, "the simulator serves n=1 only", "n")
        max_tokens = _int_field(body, "max_completion_tokens", None, 1) if chat else None
        if max_tokens is None:
            max_tokens = _int_field(body, "max_tokens", None if chat else 16, 1)
        s = sampling(body, max_tokens)
        if chat or isinstance(body.get("prompt"), str):
            # Off the event loop: it runs every engine of this process (steps, streams,
            # events), and rendering plus tokenizing a long text prompt holds it for tens of
            # milliseconds (HF tokenizers release the GIL). Token-id prompts stay inline.
            prompts = await asyncio.to_thread(prompts_of, body, chat)
        else:
            prompts = prompts_of(body, chat)
        reqs, sink = await admit(prompts, s)
        engine = inst.engine
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        if stream:
            gen = _stream(inst, engine, reqs, sink, rid, created, chat, include_usage)
            return StreamingResponse(gen, media_type="text/event-stream")
        try:
            await _drain(reqs, sink)
        except EngineDead:
            return error_response(500, "engine died")
        finally:
            for r in reqs:
                engine.abort(r)
        return JSONResponse(_full_response(inst, reqs, rid, created, chat))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, True)

    return app


async def _drain(reqs: list[SimRequest], sink: asyncio.Queue[tuple[int, Any]]) -> None:
    left = len(reqs)
    while left:
        _, item = await sink.get()
        if isinstance(item, EngineDead):
            raise item
        if item is FINISHED:
            left -= 1


def _full_response(inst: Instance, reqs: list[SimRequest], rid: str, created: int, chat: bool) -> dict[str, Any]:
    choices = []
    for r in reqs:
        text = inst.generator.text(r.planned.token_ids)
        if chat:
            message = {"role": "assistant", "content": text, "refusal": None, "annotations": None, "audio": None,
                       "function_call": None, "tool_calls": [], "reasoning_content": None}
            choices.append({"index": r.index, "message": message, "logprobs": None,
                            "finish_reason": r.planned.finish_reason, "stop_reason": None})
        else:
            choices.append({"index": r.index, "text": text, "logprobs": None,
                            "finish_reason": r.planned.finish_reason, "stop_reason": None, "prompt_logprobs": None})
    usage = _usage(sum(r.prompt_len for r in reqs), sum(r.num_output for r in reqs), sum(r.num_cached_tokens for r in reqs))
    return {
        "id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
        "model": inst.model_name, "choices": choices, "usage": usage, "system_fingerprint": None,
        "prompt_logprobs": None, "kv_transfer_params": None,
    }


async def _stream(
    inst: Instance, engine: Any, reqs: list[SimRequest], sink: asyncio.Queue[tuple[int, Any]],
    rid: str, created: int, chat: bool, include_usage: bool,
) -> AsyncIterator[bytes]:
    """SSE chunks as vLLM sends them: one per token, finish_reason on the last, then usage, then [DONE]."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    head = {"id": rid, "object": obj, "created": created, "model": inst.model_name}
    pieces = inst.generator.pieces
    by_index = {r.index: r for r in reqs}
    sent = dict.fromkeys(by_index, 0)

    def chunk(choice: dict[str, Any]) -> bytes:
        return b"data: " + _json.encode({**head, "choices": [choice]}) + b"\n\n"

    try:
        if chat:
            for r in reqs:
                yield chunk({"index": r.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None})
        left = len(reqs)
        while left:
            out = []
            index, item = await sink.get()
            batch = [(index, item)]
            while not sink.empty():
                batch.append(sink.get_nowait())
            for index, item in batch:
                if isinstance(item, EngineDead):
                    raise item
                if item is FINISHED:
                    left -= 1
                    continue
                planned = by_index[index].planned
                sent[index] += 1
                finish = planned.finish_reason if sent[index] == len(planned.token_ids) else None
                text = pieces.get(item, "")
                if chat:
                    out.append(chunk({"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": finish}))
                else:
                    out.append(chunk({"index": index, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None}))
            if out:
                yield b"".join(out)
        if include_usage:
            usage = _usage(sum(r.prompt_len for r in reqs), sum(r.num_output for r in reqs), sum(r.num_cached_tokens for r in reqs))
            yield b"data: " + _json.encode({**head, "choices": [], "usage": usage, **_sim_timing(reqs[0])}) + b"\n\n"
        yield b"data: [DONE]\n\n"
    finally:
        for r in reqs:
            engine.abort(r)
