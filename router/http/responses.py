"""Which engine made each ``/v1/responses`` response, so that a follow-up reaches it.

vLLM keeps stored responses in the memory of the API server that made them:
``OpenAIServingResponses`` (``vllm/entrypoints/openai/responses/serving.py``) holds
``response_store`` and ``msg_store``, plain dicts filled when the engine runs with
``VLLM_ENABLE_RESPONSES_API_STORE=1`` and the request's ``store`` is true (the default).
``create_responses`` looks ``previous_response_id`` up there and answers any id it lacks
with 404, ``Response with id '...' not found.`` (``_make_not_found_error``); so do
``retrieve_responses`` (``GET /v1/responses/{id}``) and ``cancel_responses`` (``POST
/v1/responses/{id}/cancel``). A follow-up sent to another engine fails. The engine that made
the response also holds the follow-up's prefix in its KV cache: its prompt is the previous
one's messages, then the previous output, then the new input.

:class:`ResponseMemory` remembers the model and backend of the most recent
:data:`MAX_REMEMBERED` responses; :class:`ResponseIds` reads each id off the answer as the
proxy relays it (a non-streamed body, or the ``response.created`` event that opens a stream,
read in passing: nothing is held back), and :meth:`ResponseMemory.route` puts the remembered
backend first. An id this process does not remember (another worker of ``serve --workers N``
or another replica routed it, it was evicted, the router restarted) or whose engine is not
routable goes least loaded first and then to each other engine in turn while they answer
404: the engines' stores are the truth, this memory saves the search. Each way has its
reason (``kvrouter_passthrough_decisions``, the access log's ``reason``).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import msgspec

MAX_REMEMBERED = 32_768
"""Responses remembered per router process (about 8 MiB); the oldest is forgotten first.
An id older than that is found by searching (see the module docstring)."""
MAX_ID_LEN = 256
"""Longer ids are not remembered (a client may choose its ``request_id``, vLLM's response id)."""
LOOK_BYTES = 64 * 1024
"""How far into a stream its ``response.created`` event is looked for (vLLM sends it first)."""

LEAST_LOADED = "least_loaded"
RESPONSE_ENGINE = "response_engine"
"""Sent first to the backend that made the response it names."""
RESPONSE_UNKNOWN = "response_unknown"
"""This process does not remember the response it names: searched for, least loaded first."""
RESPONSE_ENGINE_DOWN = "response_engine_down"
"""The backend that made it is not routable now (down, ejected, removed): searched for."""


class _Response(msgspec.Struct):
    id: str = ""


class _Created(msgspec.Struct):
    type: str = ""
    response: _Response | None = None


_response = msgspec.json.Decoder(_Response)
_created = msgspec.json.Decoder(_Created)


@dataclass(frozen=True, slots=True)
class Route:
    """Where a request that hashes no prompt goes: backends, best first, and why."""

    order: list[str]
    reason: str
    search: bool = False
    """A 404 moves it to the next backend: the first may not hold the response it names."""


class ResponseMemory:
    """Response id -> (model, backend) that made it, least recently used forgotten first."""

    def __init__(self, capacity: int = MAX_REMEMBERED) -> None:
        self.capacity = capacity
        self._where: OrderedDict[str, tuple[str, str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._where)

    def remember(self, response_id: str, model: str, backend: str) -> None:
        if not response_id or len(response_id) > MAX_ID_LEN:
            return
        where = self._where
        where[response_id] = (model, backend)
        where.move_to_end(response_id)
        if len(where) > self.capacity:
            where.popitem(last=False)

    def where(self, response_id: str) -> tuple[str, str] | None:
        """The (model, backend) that made ``response_id``, if remembered (and now the most recent)."""
        found = self._where.get(response_id)
        if found is not None:
            self._where.move_to_end(response_id)
        return found

    def route(self, response_id: str | None, least_loaded: list[str]) -> Route:
        """The order for a request naming ``response_id`` (None: it names none) among the
        routable backends ``least_loaded``, least loaded first. A remembered, routable backend
        is tried alone but for retries on failure: any other engine would answer 404."""
        if response_id is None:
            return Route(least_loaded, LEAST_LOADED)
        found = self.where(response_id)
        if found is None:
            return Route(least_loaded, RESPONSE_UNKNOWN, search=True)
        backend = found[1]
        if backend not in least_loaded:
            return Route(least_loaded, RESPONSE_ENGINE_DOWN, search=True)
        return Route([backend, *(n for n in least_loaded if n != backend)], RESPONSE_ENGINE)


class ResponseIds:
    """One request's answer, read as the proxy relays it: the id of the response it created
    (remembered on the backend that answered), and where ``named`` was found when it was
    searched for. Only a 200 answer counts; ``store`` false: vLLM keeps nothing to find."""

    __slots__ = ("memory", "model", "named", "store", "looking", "_seen")

    def __init__(self, memory: ResponseMemory, model: str, named: str | None = None, store: bool = True) -> None:
        self.memory = memory
        self.model = model
        self.named = named
        self.store = store
        self.looking = True
        """Whether a stream's events are still worth reading (the proxy skips the call once not)."""
        self._seen = 0

    def whole(self, backend: str, status: int, body: bytes) -> None:
        """A non-streamed answer: vLLM's response object, or with ``GET`` the stored one."""
        if status != 200:
            return
        self._found(backend)
        if self.store:
            try:
                self.memory.remember(_response.decode(body).id, self.model, backend)
            except (msgspec.DecodeError, msgspec.ValidationError):
                pass

    def events(self, backend: str, events: bytes) -> None:
        """Whole events of a 200 stream, until ``response.created`` or :data:`LOOK_BYTES`."""
        if self._seen == 0:
            self._found(backend)
        self._seen += len(events)
        response_id = created_id(events) if self.store else None
        if response_id is not None:
            self.memory.remember(response_id, self.model, backend)
        if response_id is not None or self._seen >= LOOK_BYTES or not self.store:
            self.looking = False

    def _found(self, backend: str) -> None:
        if self.named is not None:
            self.memory.remember(self.named, self.model, backend)
            self.named = None


def created_id(events: bytes) -> str | None:
    """The response id of the ``response.created`` event among whole SSE ``events``, if any."""
    for event in events.split(b"\n\n"):
        name = b""
        data: list[bytes] = []
        for line in event.splitlines():
            if line.startswith(b"event:"):
                name = line[6:].strip()
            elif line.startswith(b"data:"):
                data.append(line[5:])
        if not data or name not in (b"", b"response.created"):
            continue
        try:
            created = _created.decode(b"\n".join(data))
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue
        if created.type == "response.created" and created.response is not None and created.response.id:
            return created.response.id
    return None
