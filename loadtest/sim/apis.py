"""``/v1/responses`` and ``/v1/messages`` of ``vllm serve`` for one simulated engine.

Both render their prompt as a chat, as vLLM does, and generate like ``/v1/chat/completions``
(:mod:`loadtest.sim.http`), so they fill and hit the engine's prefix cache alike.

**Responses** (vLLM's ``OpenAIServingResponses``). The prompt is built as
``construct_input_messages`` builds it: ``instructions`` as the system message, then the
previous response's input messages and output, then ``input``. Responses are stored per
engine, as vLLM stores them with ``VLLM_ENABLE_RESPONSES_API_STORE=1`` (``store: false``
keeps one out), in this engine's memory only: another engine answers a
``previous_response_id`` it does not hold with 404 ``Response with id '...' not found.``, and
a restarted engine has lost them all. Unlike vLLM's store, which never forgets, this one
keeps the last :data:`MAX_STORED` (a long bench would otherwise grow without bound).
``GET /v1/responses/{id}`` answers the stored response; ``POST /v1/responses/{id}/cancel``
answers 400, as vLLM does for a response that is not running in the background (the
simulator serves none). A stream is vLLM's: ``event: <type>`` and ``data: <json>`` events from
``response.created`` to ``response.completed``, and no ``[DONE]``.

**Messages** (vLLM's ``AnthropicServingMessages``): ``system`` and the messages' text blocks
become the chat (other blocks and ``tools`` are refused: the simulator renders text); the
answer is Anthropic's message, a stream Anthropic's events (``message_start`` ...
``message_stop``) then ``data: [DONE]``, and an error of the handler Anthropic's
``{"type": "error", "error": {...}}`` (a body that is not JSON stays OpenAI-shaped, as vLLM's
request validation answers it).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from loadtest.sim.engine import FINISHED, EngineDead, SimRequest
from loadtest.sim.fields import ApiError, bool_field, error_response, int_field

if TYPE_CHECKING:
    from loadtest.sim.fleet import Instance

MAX_STORED = 10_000
"""Responses one simulated engine keeps (the oldest goes first)."""
_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError"}
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}
_json = msgspec.json.Encoder()


@dataclass(frozen=True, slots=True)
class Sampling:
    """The sampling fields of a request, checked."""

    max_tokens: int | None
    min_tokens: int
    ignore_eos: bool
    cache_salt: str | None
    seed: int | None


@dataclass(frozen=True, slots=True)
class Generating:
    """What every generating endpoint of one engine shares (made by :func:`loadtest.sim.http.create_app`)."""

    body: Callable[[Request], Awaitable[dict[str, Any]]]
    check_model: Callable[[dict[str, Any]], None]
    sampling: Callable[[dict[str, Any], int | None], Sampling]
    chat_ids: Callable[[dict[str, Any]], list[int]]
    """The prompt ids of a chat completions body (blocking: run it in a thread)."""
    admit: Callable[[list[list[int]], Sampling], Awaitable[tuple[list[SimRequest], asyncio.Queue[tuple[int, Any]]]]]


@dataclass(slots=True)
class Stored:
    response: dict[str, Any]
    messages: list[dict[str, Any]]
    """Its input messages (vLLM's ``msg_store``): with its output, the next turn's history."""


class ResponseStore:
    """This engine's stored responses; emptied when the engine restarts (a new engine object)."""

    def __init__(self, inst: Instance) -> None:
        self.inst = inst
        self.engine: Any = None
        self.items: OrderedDict[str, Stored] = OrderedDict()

    def _live(self) -> OrderedDict[str, Stored]:
        if self.engine is not self.inst.engine:
            self.items.clear()
            self.engine = self.inst.engine
        return self.items

    def get(self, response_id: str) -> Stored | None:
        return self._live().get(response_id)

    def put(self, response_id: str, stored: Stored) -> None:
        items = self._live()
        items[response_id] = stored
        while len(items) > MAX_STORED:
            items.popitem(last=False)


def _not_found(response_id: str) -> ApiError:
    return ApiError(404, f"Response with id '{response_id}' not found.", "response_id")


def _event(kind: bytes, data: dict[str, Any]) -> bytes:
    return b"event: " + kind + b"\ndata: " + _json.encode(data) + b"\n\n"


async def _batches(sink: asyncio.Queue[tuple[int, Any]]) -> AsyncIterator[list[int]]:
    """One request's output tokens as they come, those already waiting together."""
    while True:
        _, item = await sink.get()
        batch: list[int] = []
        while True:
            if isinstance(item, EngineDead):
                raise item
            if item is FINISHED:
                if batch:
                    yield batch
                return
            batch.append(item)
            if sink.empty():
                break
            _, item = sink.get_nowait()
        yield batch


def _text_parts(content: Any, part_types: tuple[str, ...], where: str) -> str | list[dict[str, str]]:
    """A message's content as chat content: a string, or text parts (one part: its text)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where} content must be a string or a list of content parts", where)
    parts = []
    for p in content:
        if not isinstance(p, dict) or p.get("type") not in part_types or not isinstance(p.get("text"), str):
            raise ApiError(400, f"the simulator serves text content only ({'/'.join(part_types)} parts)", where)
        if p["text"]:
            parts.append({"type": "text", "text": p["text"]})
    return parts[0]["text"] if len(parts) == 1 else parts


def input_messages(body: dict[str, Any], previous: Stored | None) -> list[dict[str, Any]]:
    """vLLM's ``construct_input_messages``: instructions, the previous turn's messages and output, the input."""
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise ApiError(400, "instructions must be a string", "instructions")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if previous is not None:
        messages.extend(previous.messages)
        for item in previous.response["output"]:
            if item.get("type") == "message":
                messages.extend({"role": "assistant", "content": c["text"]} for c in item["content"])
    given = body.get("input")
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif isinstance(given, list) and given:
        for m in given:
            if not isinstance(m, dict) or m.get("role") not in ("user", "system", "developer", "assistant"):
                raise ApiError(400, "the simulator serves input messages with a role and text content", "input")
            messages.append({"role": m["role"], "content": _text_parts(m.get("content"), ("input_text", "output_text", "text"), "input")})
    else:
        raise ApiError(400, "input must be a string or a non-empty list of messages", "input")
    return messages


def anthropic_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """vLLM's ``_convert_anthropic_to_openai_request``, for text: the chat messages."""
    if body.get("tools"):
        raise ApiError(400, "the simulator serves no tools on /v1/messages", "tools")
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if isinstance(system, list):
        system = "".join(b["text"] for b in system if isinstance(b, dict) and b.get("type") == "text" and b.get("text"))
    elif system is not None and not isinstance(system, str):
        raise ApiError(400, "system must be a string or a list of text blocks", "system")
    if system:
        messages.append({"role": "system", "content": system})
    given = body.get("messages")
    if not isinstance(given, list) or not given:
        raise ApiError(400, "messages must be a non-empty list", "messages")
    for m in given:
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise ApiError(400, "each message needs a role, user or assistant", "messages")
        content = _text_parts(m.get("content"), ("text",), "messages")
        if content or isinstance(m.get("content"), str):
            messages.append({"role": m["role"], "content": content})
    return messages


def add_api_routes(app: FastAPI, inst: Instance, g: Generating) -> None:
    """``/v1/responses`` (create, retrieve, cancel) and ``/v1/messages`` on one engine's app."""
    store = ResponseStore(inst)
    pieces = inst.generator.pieces

    def response_object(rid: str, created: int, body: dict[str, Any], req: SimRequest | None,
                        output: list[dict[str, Any]]) -> dict[str, Any]:
        status = "in_progress" if req is None else "incomplete" if req.planned.finish_reason == "length" else "completed"
        usage = None if req is None else {
            "input_tokens": req.prompt_len, "input_tokens_details": {"cached_tokens": req.num_cached_tokens},
            "output_tokens": req.num_output, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": req.prompt_len + req.num_output}
        return {
            "id": rid, "created_at": created,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.get("instructions"), "metadata": body.get("metadata"), "model": inst.model_name,
            "object": "response", "output": output, "parallel_tool_calls": True, "temperature": body.get("temperature"),
            "tool_choice": "auto", "tools": [], "top_p": body.get("top_p"), "background": False,
            "max_output_tokens": body.get("max_output_tokens"), "previous_response_id": body.get("previous_response_id"),
            "reasoning": None, "service_tier": "auto", "status": status, "text": None, "truncation": "disabled",
            "usage": usage, "user": None,
        }

    def message_item(item_id: str, text: str, done: bool) -> dict[str, Any]:
        content = [{"annotations": [], "text": text, "type": "output_text", "logprobs": None}] if done else []
        return {"id": item_id, "content": content, "role": "assistant", "status": "completed" if done else "in_progress",
                "type": "message"}

    async def generate(body: dict[str, Any], messages: list[dict[str, Any]], max_tokens: int | None) -> tuple[
            SimRequest, asyncio.Queue[tuple[int, Any]]]:
        s = g.sampling(body, max_tokens)
        ids = await asyncio.to_thread(g.chat_ids, {"messages": messages})
        reqs, sink = await g.admit([ids], s)
        return reqs[0], sink

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        body = await g.body(request)
        g.check_model(body)
        if inst.faults.inject_error():
            return error_response(500, "injected fault: internal server error")
        stream = bool_field(body, "stream", False)
        keep = bool_field(body, "store", True)
        if bool_field(body, "background", False):
            raise ApiError(400, "the simulator serves no background responses", "background")
        previous_id = body.get("previous_response_id")
        previous = None
        if previous_id is not None:
            if not isinstance(previous_id, str):
                raise ApiError(400, "previous_response_id must be a string", "previous_response_id")
            previous = store.get(previous_id)
            if previous is None:
                raise _not_found(previous_id)
        messages = input_messages(body, previous)
        rid = body.get("request_id") if isinstance(body.get("request_id"), str) else f"resp_{uuid.uuid4().hex}"
        created = int(time.time())
        req, sink = await generate(body, messages, int_field(body, "max_output_tokens", None, 1))
        item_id = f"msg_{uuid.uuid4().hex}"

        def finish() -> dict[str, Any]:
            text = inst.generator.text(req.planned.token_ids)
            response = response_object(rid, created, body, req, [message_item(item_id, text, True)])
            if keep:
                store.put(rid, Stored(response, messages))
            return response

        if not stream:
            try:
                async for _ in _batches(sink):
                    pass
            except EngineDead:
                return error_response(500, "engine died")
            finally:
                inst.engine.abort(req)
            return JSONResponse(finish())

        async def events() -> AsyncIterator[bytes]:
            seq = 0

            def event(kind: str, data: dict[str, Any]) -> bytes:
                nonlocal seq
                out = _event(kind.encode(), {**data, "sequence_number": seq, "type": kind})
                seq += 1
                return out

            try:
                opening = response_object(rid, created, body, None, [])
                yield event("response.created", {"response": opening}) + event("response.in_progress", {"response": opening})
                where = {"item_id": item_id, "output_index": 0}
                yield event("response.output_item.added", {"item": message_item(item_id, "", False), "output_index": 0}) + \
                    event("response.content_part.added", {"content_index": 0, **where, "part": {
                        "annotations": [], "text": "", "type": "output_text", "logprobs": []}})
                async for batch in _batches(sink):
                    out = [event("response.output_text.delta", {"content_index": 0, "delta": text, **where, "logprobs": []})
                           for t in batch if (text := pieces.get(t, ""))]
                    if out:
                        yield b"".join(out)
                response = finish()
                item = response["output"][0]
                text = item["content"][0]["text"]
                yield (event("response.output_text.done", {"content_index": 0, **where, "logprobs": [], "text": text})
                       + event("response.content_part.done", {"content_index": 0, **where, "part": item["content"][0]})
                       + event("response.output_item.done", {"item": item, "output_index": 0})
                       + event("response.completed", {"response": response}))
            finally:
                inst.engine.abort(req)

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str, stream: bool = False) -> Response:
        stored = store.get(response_id)
        if stored is None:
            raise _not_found(response_id)
        if stream:
            raise ApiError(400, f"Unknown response_id: {response_id}", "response_id")
        return JSONResponse(stored.response)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str) -> Response:
        if store.get(response_id) is None:
            raise _not_found(response_id)
        raise ApiError(400, "Cannot cancel a synchronous response.", "response_id")

    def anthropic_error(e: ApiError) -> JSONResponse:
        error = {"type": _ERROR_TYPES.get(e.status, "Error"), "message": e.message}
        return JSONResponse({"type": "error", "error": error}, status_code=e.status)

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        body = await g.body(request)
        max_tokens = int_field(body, "max_tokens", None, 1)
        if max_tokens is None:
            raise ApiError(400, "max_tokens is required", "max_tokens")
        stream = bool_field(body, "stream", False)
        try:
            g.check_model(body)
            if inst.faults.inject_error():
                raise ApiError(500, "injected fault: internal server error")
            req, sink = await generate(body, anthropic_messages(body), max_tokens)
        except ApiError as e:
            return anthropic_error(e)
        rid = f"chatcmpl-{uuid.uuid4().hex}"

        def usage() -> dict[str, int]:
            return {"input_tokens": req.prompt_len, "output_tokens": req.num_output}

        if not stream:
            try:
                async for _ in _batches(sink):
                    pass
            except EngineDead:
                return anthropic_error(ApiError(500, "engine died"))
            finally:
                inst.engine.abort(req)
            text = inst.generator.text(req.planned.token_ids)
            return JSONResponse({"id": rid, "type": "message", "role": "assistant",
                                 "content": [{"type": "text", "text": text}] if text else [], "model": inst.model_name,
                                 "stop_reason": _STOP_REASONS[req.planned.finish_reason], "usage": usage()})

        async def events() -> AsyncIterator[bytes]:
            try:
                yield _event(b"message_start", {"type": "message_start", "message": {
                    "id": rid, "type": "message", "role": "assistant", "content": [], "model": inst.model_name,
                    "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": req.prompt_len, "output_tokens": 0}}})
                started = False
                async for batch in _batches(sink):
                    out = []
                    for t in batch:
                        text = pieces.get(t, "")
                        if not text:
                            continue
                        if not started:
                            started = True
                            out.append(_event(b"content_block_start", {"type": "content_block_start", "index": 0,
                                                                       "content_block": {"type": "text", "text": ""}}))
                        out.append(_event(b"content_block_delta", {"type": "content_block_delta", "index": 0,
                                                                   "delta": {"type": "text_delta", "text": text}}))
                    if out:
                        yield b"".join(out)
                end = [_event(b"content_block_stop", {"type": "content_block_stop", "index": 0})] if started else []
                yield b"".join([*end, _event(b"message_delta", {
                    "type": "message_delta", "delta": {"stop_reason": _STOP_REASONS[req.planned.finish_reason]},
                    "usage": usage()}), _event(b"message_stop", {"type": "message_stop"}), b"data: [DONE]\n\n"])
            finally:
                inst.engine.abort(req)

        return StreamingResponse(events(), media_type="text/event-stream")
