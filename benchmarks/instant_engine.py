"""An instant engine: the vLLM HTTP surface a router needs, answered at once, at the least CPU.

The router benches (``bench_throughput.py``, ``bench_router_overhead.py``) measure the
router, so the engine behind it must cost next to nothing: on this 2-core machine the
engine, the load generator and the router share the cores, and every microsecond the
engine spends is one the router does not get. ``kvrouter sim`` simulates scheduling and
KV events and costs several times the router's CPU per request; uvicorn's ASGI cycle
(scope dict, receive/send coroutines) costs about twice this server's (measured with
``wrk``: ``python benchmarks/bench_throughput.py --engine-only``). So this is an asyncio
``Protocol`` on uvloop with httptools' parser (the parser uvicorn uses), answering a fixed
body per path: hand-written because no library serves fixed bytes without a framework's
per-request cycle.

Answers: ``/health`` (empty 200), ``/metrics`` (vLLM's queue gauges at 0), ``/v1/models``
(one model with ``max_model_len``), anything else a fixed non-streamed chat completion.
"""

from __future__ import annotations

import asyncio
import json
import sys

import httptools

MODEL = "qwen3-0.6b"


def _answer(body: bytes) -> bytes:
    return (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)


CHAT = _answer(json.dumps({
    "id": "chatcmpl-instant", "object": "chat.completion", "created": 0, "model": MODEL,
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}).encode())
ANSWERS = {
    b"/health": _answer(b""),
    b"/metrics": _answer(b"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name=\"m\"} 0.0\n"
                         b"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name=\"m\"} 0.0\n"),
    b"/v1/models": _answer(json.dumps({"object": "list", "data": [
        {"id": MODEL, "object": "model", "max_model_len": 40960}]}).encode()),
}


class _Connection(asyncio.Protocol):
    """One keep-alive connection: every complete request gets its path's fixed answer."""

    def __init__(self) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's TCPTransport is not a subclass

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            assert self.transport is not None
            self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url = url

    def on_message_complete(self) -> None:
        assert self.transport is not None
        self.transport.write(ANSWERS.get(self.url.split(b"?", 1)[0], CHAT))
        if not self.parser.should_keep_alive():
            self.transport.close()


def serve(port: int, host: str = "127.0.0.1") -> None:
    """Serve forever on ``host:port`` (blocking)."""
    import uvloop

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(_Connection, host, port, backlog=4096)
        async with server:
            await server.serve_forever()

    uvloop.run(main())


if __name__ == "__main__":
    serve(int(sys.argv[1]))
