"""The oracle's side channel on its own thread and port (``kvrouter sim --debug-state``, bench only).

A question asked on the engine's own port waits in the event loop's queue behind every token
stream of the process: at four times real speed on a busy host that wait reached 100 ms of
wall time, 400 of engine time. The bench's oracle asks one question at a time (each decision
must see the one before it), so the wait capped the oracle's throughput below the loads the
capacity sweep offers, and its requests queued in the router: its client TTFT measured the
side channel, not the placement. Here a question waits only for the engines' state lock
(:data:`loadtest.sim.engine.STATE_LOCK`), held for one step's bookkeeping at a time.

The standard library's threaded HTTP server: a handful of keep-alive connections (one per
router process asking) and one small JSON body each way is all it carries; an asyncio
server would share the loop this exists to avoid.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

log = logging.getLogger(__name__)

PATH = "/debug/state"
SWITCH_INTERVAL_S = 0.0005
MAX_BODY = 64 << 20
"""A question carries one prompt's token ids and a few ids in transit: far below this."""

Answer = Callable[[bytes], tuple[int, bytes]]


class StateServer:
    """Serves ``POST /debug/state`` with ``answer`` on ``host`` and a free port, on daemon threads."""

    def __init__(self, host: str, answer: Answer) -> None:
        # The event loop's thread holds the GIL while it runs, handing it over every switch
        # interval (5 ms by default) to a thread that waits; a question waits for it at each of
        # its reads and writes. 0.5 ms keeps an answer to a few milliseconds on a busy process.
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        handler = type("_StateHandler", (_Handler,), {"answer": staticmethod(answer)})
        self._server = ThreadingHTTPServer((host, 0), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="sim-state", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}{PATH}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: one connection per asking router process
    disable_nagle_algorithm = True  # headers and body go out in two writes: no 40 ms delayed-ACK stall
    answer: Answer

    def do_POST(self) -> None:  # noqa: N802 (the standard library's name)
        if self.path != PATH:
            self._reply(404, b'{"error": {"message": "not found", "type": "NotFoundError", "param": null, "code": 404}}')
            return
        try:
            n = int(self.headers.get("content-length", ""))
        except ValueError:
            n = -1
        if not 0 <= n <= MAX_BODY:
            self._reply(411, b'{"error": {"message": "a Content-Length up to 64 MiB is required", '
                             b'"type": "Error", "param": null, "code": 411}}')
            self.close_connection = True
            return
        self._reply(*type(self).answer(self.rfile.read(n)))

    def _reply(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the standard library's name)
        log.debug("state server: " + format, *args)
