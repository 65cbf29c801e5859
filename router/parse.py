"""Stage 1 of the request path, *parse*: the bounded body, decoded once, the few fields routing reads.

The engine validates the rest of an OpenAI body; the router checks only what it needs
to route and to bound the work it does (``model``, the prompt or messages, ``stream``,
``max_tokens``, ``cache_salt``), so a malformed request is a 400 here, never a 500 deeper
in the path.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import msgspec
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from router.http.errors import BadRequest, BodyTooLarge, ClientClosed

_decoder = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, refused as soon as it is known to pass ``limit`` bytes."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise BodyTooLarge(f"request body of {length} bytes is over the {limit}-byte limit")
    try:
        return await _read(request, length, limit)
    except ClientDisconnect:
        raise ClientClosed("the client closed the connection before its request body was complete") from None


async def _read(request: Request, length: str | None, limit: int) -> bytes:
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


INLINE_DUPLICATE_CHECK_BYTES = 1 << 20
"""Bodies up to this size are checked for repeated keys on the event loop (~3 ms a MiB);
longer ones in a thread, so a huge body cannot stall the loop with it."""


async def parse_body(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object whose top-level keys are all distinct.

    msgspec, like vLLM's parser, keeps the last of a repeated key while the router forwards
    the raw bytes: a client's second ``cache_salt`` would override the first, which a
    gateway in front may have set. A repeated key is therefore a 400."""
    body = parse_json(raw)
    if not may_repeat(raw, body):
        return body
    if len(raw) <= INLINE_DUPLICATE_CHECK_BYTES:
        repeated = repeated_key(raw)
    else:
        repeated = await asyncio.to_thread(repeated_key, raw)
    if repeated is not None:
        raise BadRequest(f"the request body repeats the key {repeated!r}", code="duplicate_key")
    return body


def may_repeat(raw: bytes, body: dict[str, Any]) -> bool:
    """Whether ``raw`` could repeat a top-level key of ``body``. A key without ``/``, a quote,
    a backslash or a control character can be spelled another way only with a ``\\u``
    escape, so without one a repeat shows the key's quoted bytes twice. This byte count
    settles most bodies; only the others pay for the second, slower parse on the request path."""
    if b"\\u" in raw or any(not key.isprintable() or any(c in key for c in '/"\\') for key in body):
        return True
    return any(raw.count(_encoder.encode(key)) > 1 for key in body)


def repeated_key(raw: bytes) -> str | None:
    """The first top-level key ``raw`` (a JSON object) repeats, or None.

    Written with the standard library's parser because msgspec keeps no duplicates to look
    at; its ``object_pairs_hook`` sees every object's pairs, innermost first, so the last
    call is the top level's (the nested objects' repeats are the engine's business)."""
    last: list[tuple[str, Any]] = []

    def pairs(items: list[tuple[str, Any]]) -> None:
        nonlocal last
        last = items

    try:
        json.loads(raw, object_pairs_hook=pairs)
    except (ValueError, RecursionError):
        return None  # msgspec accepted it; never refuse on this parser's stricter view
    seen: set[str] = set()
    for key, _ in last:
        if key in seen:
            return key
        seen.add(key)
    return None


def parse_json(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 that says whether its bytes or its JSON are wrong.

    Bad UTF-8 is told apart by decoding the bytes again once msgspec has refused them: msgspec
    up to 0.22 raised ``UnicodeDecodeError`` for it and 0.23 raises ``DecodeError``, so its
    exception type cannot say which it was; a valid body pays nothing for the check."""
    try:
        body = _decoder.decode(raw)
    except (UnicodeDecodeError, msgspec.DecodeError) as e:
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as bad:
            raise BadRequest(f"request body is not valid UTF-8: {bad}", code="invalid_encoding") from None
        raise BadRequest(f"request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise BadRequest("request body is nested too deeply", code="invalid_json") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object", code="invalid_json")
    return body


MAX_MESSAGES = 16_384
"""The most messages one chat request may carry. Rendering is linear in them with a large
constant (jinja, then the segment scan); a long agent session has hundreds to a few
thousand, and a 200,000-message body was only a way to make the router work."""


def validate_fields(body: dict[str, Any], kind: str) -> str | None:
    """Check the fields routing reads; returns the request's ``cache_salt``."""
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' is required and must be a non-empty list", code="missing_messages")
        if len(messages) > MAX_MESSAGES:
            raise BadRequest(f"'messages' has {len(messages)} entries; the router accepts at most {MAX_MESSAGES}",
                             code="too_many_messages")
    elif "prompt" not in body or body["prompt"] is None:
        raise BadRequest("'prompt' is required", code="missing_prompt")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean")
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise BadRequest(f"'{key}' must be a non-negative integer")
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise BadRequest("'cache_salt' must be a string")
    return salt


def session_key(body: dict[str, Any], headers: Any, header: str) -> str | None:
    """The session a request belongs to: the configured header, else the body's ``user``."""
    key = headers.get(header)
    if key:
        return key
    user = body.get("user")
    return user if isinstance(user, str) and user else None


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(_encoder.encode(obj), status_code=status, media_type="application/json")
