"""SSE framing of relayed streams: cut at event boundaries, and how each API's streams end.

A failure after a stream started cannot change its status: the router ends the stream
with an error event of its own. For that event to be an event of its own, a stream is
relayed whole events at a time (:class:`EventCut`): bytes that do not yet complete an event
wait for the rest (an engine writes whole events, so they wait only when a read ends inside
one), and when the engine fails, what is left of its half event is dropped instead of being
glued to the error. A stream that ends without its API's last event was cut short: it gets
the error event too, never a silent 200.

The APIs vLLM serves end their streams in two ways, and their clients read errors in two,
hence one :class:`Dialect` each:

- **OpenAI completions and chat** (:data:`OPENAI`): the last event is ``data: [DONE]``, sent
  after every stream, errors included; an error is ``data: {"error": {...}}``.
- **Responses** (:data:`RESPONSES`, ``/v1/responses``): vLLM writes ``event: <type>`` and
  ``data: <json>`` and no ``[DONE]`` (``_convert_stream_to_sse_events`` in its responses
  ``api_router.py``); the stream ends with ``response.completed`` (OpenAI's API also ends
  with ``response.incomplete``, ``response.failed`` or ``error``). The openai SDK raises on
  any event whose data holds an ``error`` object, so the router's error is OpenAI's.
- **Anthropic Messages** (:data:`ANTHROPIC`, ``/v1/messages``): vLLM converts a chat stream
  and ends it with ``message_stop`` then ``data: [DONE]``; an error is ``event: error`` with
  Anthropic's error object, the one event Anthropic's SDKs raise on (they skip unnamed ones).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from router.http.errors import error_body

MAX_HELD_EVENT_BYTES = 16 * 1024 * 1024
"""Most bytes of one unfinished SSE event held back; a longer event is passed on as it
comes (vLLM's largest, a first chunk with prompt logprobs, stays well below)."""
_DONE_LINES = (b"data: [DONE]", b"data:[DONE]")
_RESPONSE_ENDS = frozenset((b"response.completed", b"response.incomplete", b"response.failed", b"error"))
_encode = msgspec.json.Encoder().encode


def _event_end(data: bytes) -> int:
    """Where the last SSE event completed in ``data`` ends (0: none): after an empty line,
    i.e. two line ends in a row, each a CRLF, an LF or a CR. A CR last may be the first
    half of a CRLF; cutting there is still a boundary (a CR alone ends a line)."""
    end = 0
    for sep in (b"\n\n", b"\r\r", b"\n\r", b"\r\r\n", b"\n\r\n"):
        i = data.rfind(sep)
        if i >= 0 and i + len(sep) > end:
            end = i + len(sep)
    return end


def ends_with_done(events: bytes) -> bool | None:
    """Whether the last event of ``events`` (which end at a boundary) is ``[DONE]``; None: only blank lines.

    Reads the last 32 bytes, not the chunk: a line without a line end among them is
    longer than ``data: [DONE]``, unless blank lines pad the end (then it looks further)."""
    tail = events[-32:]
    last = tail.rstrip(b"\r\n")
    if len(last) < 14 and len(tail) < len(events):
        last = events.rstrip(b"\r\n")
    if not last:
        return None
    start = max(last.rfind(b"\n"), last.rfind(b"\r")) + 1
    return last[start:] in _DONE_LINES


def ends_a_response(events: bytes) -> bool | None:
    """Whether the last event of ``events`` ends a Responses stream: its ``event:`` line names
    a last event (``response.completed`` ...), or it is ``[DONE]``. That event carries the
    whole response, so its start is searched for (only on Responses streams)."""
    body = events.rstrip(b"\r\n")
    if not body:
        return None
    last = body[_event_end(body):]
    for line in last.splitlines():
        if line.startswith(b"event:"):
            return line[6:].strip() in _RESPONSE_ENDS
    return last.strip() in _DONE_LINES


def openai_error_event(message: str, code: str) -> bytes:
    return b"data: " + error_body(message, "server_error", code) + b"\n\n"


def anthropic_error_event(message: str, code: str) -> bytes:
    """Anthropic's error event (``code`` goes unsaid: its error object has a type and a message)."""
    return b"event: error\ndata: " + _encode({"type": "error", "error": {"type": "api_error", "message": message}}) + b"\n\n"


@dataclass(frozen=True, slots=True)
class Dialect:
    """How one API's event streams end, and how the router writes its closing error into one."""

    ends: Callable[[bytes], bool | None]
    """Whether the last of some whole events ends the stream (None: they were blank lines)."""
    error_event: Callable[[str, str], bytes]
    """(message, code) -> one whole error event."""


OPENAI = Dialect(ends_with_done, openai_error_event)
RESPONSES = Dialect(ends_a_response, openai_error_event)
ANTHROPIC = Dialect(ends_with_done, anthropic_error_event)


class EventCut:
    """An SSE byte stream cut at event boundaries for relaying (see the module docstring).

    :meth:`feed` returns the bytes that can go to the client: everything up to the last
    event boundary seen, so the client's stream always ends on one unless an event
    outgrew :data:`MAX_HELD_EVENT_BYTES` (``mid_event``). Bytes are never changed,
    reordered or duplicated: concatenated, what :meth:`feed` returned plus ``held`` is
    exactly what was fed. ``done`` tells whether the last complete event ends the stream
    in the ``dialect``'s terms.
    """

    __slots__ = ("held", "held_bytes", "recent", "mid_event", "done", "dialect")

    def __init__(self, dialect: Dialect = OPENAI) -> None:
        self.held: list[bytes] = []
        self.held_bytes = 0
        self.recent = b""
        """The last two bytes fed: a boundary can start in the previous chunk."""
        self.mid_event = False
        self.done = False
        self.dialect = dialect

    def feed(self, chunk: bytes) -> bytes:
        if not chunk:
            return chunk
        if not self.held and chunk.endswith(b"\n\n"):  # whole events, the usual read
            self.recent = chunk[-2:]
            self.mid_event = False
            self._saw(chunk)
            return chunk
        lead = self.recent
        self.recent = (lead + chunk[-2:])[-2:]
        end = _event_end(lead + chunk) - len(lead)
        if end <= 0:
            self.held.append(chunk)
            self.held_bytes += len(chunk)
            if self.held_bytes <= MAX_HELD_EVENT_BYTES:
                return b""
            out = b"".join(self.held)
            self.held, self.held_bytes, self.mid_event = [], 0, True
            return out
        out = b"".join((*self.held, chunk[:end])) if self.held else chunk[:end]
        rest = chunk[end:]
        self.held, self.held_bytes, self.mid_event = ([rest] if rest else []), len(rest), False
        self._saw(out)
        return out

    def _saw(self, events: bytes) -> None:
        ended = self.dialect.ends(events)
        if ended is not None:
            self.done = ended

    @property
    def complete(self) -> bool:
        """The stream may end here: its last event ends it and nothing follows it."""
        return self.done and not self.held and not self.mid_event

    def error_event(self, message: str, code: str = "upstream_error") -> bytes:
        """The router's closing error event; after an oversized half event, a blank line first ends it."""
        event = self.dialect.error_event(message, code)
        return b"\n\n" + event if self.mid_event else event
