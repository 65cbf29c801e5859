"""Live KV-event ingestion: one ZMQ SUB per engine (and DP rank) feeding an :class:`Index`.

Every stream is a sequence of batches numbered 0, 1, 2, ... by the engine's publisher
(``docs/vllm-facts.md`` §3). The index is only right if it applied *every* batch of the
current publisher incarnation in order, so each stream is tracked like this:

* ``seq == expected``: apply and advance.
* ``seq > expected`` (PUB dropped messages): ask the engine's replay socket for
  everything from ``expected - 1`` on. The first message of the answer is the *anchor*:
  the batch we applied last. Its bytes must equal what we applied; otherwise the engine
  restarted under us. Live messages that arrive meanwhile are buffered and merged with
  the replay by seq, so batches are applied exactly once and in order.
* A hole inside what the replay shows the engine holds (between the lowest and highest
  seq it sent) was lost in transit: the engine's ROUTER drops messages sent while its
  pipe is at the send high-water mark (ZMQ's default, 1,000, in vLLM), so a long replay
  arrives with holes and often without its end marker. It is asked again from the hole,
  as long as each replay applies something (``MAX_STALLED_REPLAYS`` in a row may not).
* A hole the replay cannot fill (the engine's buffer moved past it) means history is
  gone: the worker's entries are cleared, the loss is counted, and the stream continues
  from the next batch it holds. Applying a suffix of history to an empty worker only
  ever gives a *subset* of the engine's cache, so the index may miss blocks but never
  claims blocks the engine does not hold.
* ``seq < expected`` that is not a duplicate of a batch already applied (replays and
  live copies overlap) may mean a new publisher process, but only the engine can say so:
  an anchored replay asks it. When it no longer holds the batch applied last (or holds
  other bytes under its seq) the worker is cleared and the stream re-synchronised from
  seq 0 by replay; when it still holds it, the message was not the engine's.

Sequence numbers are not authenticated (ZMQ has no peer identity here), so a seq that
does not follow is *suspect* until the engine corroborates it, and a suspect seq never
clears the worker on its own. It is counted (``kvrouter_kv_event_suspect_seqs_total``, by
reason), logged at most every :data:`WARN_EVERY_S`, and dropped:

* ``backwards``: the seq went back but the engine's replay still holds what was applied;
* ``jump``: the seq is more than :data:`MAX_SEQ_JUMP` past the next one expected, further
  than any replay buffer reaches, and the engine's replay does not show it moved past
  what was applied (an engine whose history really is gone shows that in its replay);
* ``ahead``: a hole up to the seq stays unfilled over :data:`MAX_STALLED_REPLAYS` replays
  whose answers never reach it: the engine never published it.

Where the engine cannot be asked (no replay endpoint, or its replay does not answer), a
suspect seq is taken only once :data:`CORROBORATING_BATCHES` batches in a row continue
from it with nothing arriving at the expected seq in between: a restarted engine does that
within a few batches, and a forger has to outrun the real engine's stream to do it.
* ``AllBlocksCleared`` clears the worker (the index does that when it applies the batch).

When a stream connects and nothing is known about it yet, a replay from seq 0 loads
whatever history the engine still buffers, so a restarted router starts warm.

One stream cannot hold the others back, and cannot grow the index without bound:

* each stream applies at most :data:`TURN_BYTES` of payload per turn of the loop before
  every other ready stream gets its turn (a flood queued on one socket used to be drained
  a thousand messages at a time);
* the index holds at most its caps' keys per worker and medium (:class:`indexer.index.KeyCaps`:
  twice the engine's capacity), and a worker stores into at most :data:`MAX_MEDIA_PER_WORKER`
  tiers. A stored event longer than the cap is cut to its first ``cap`` blocks (the head of
  its chain: hits are a prefix) before it is verified, so its cost is bounded by the cap too. Keys dropped either way are counted
  (``kvrouter_kv_event_keys_capped_total``) and the worker's passing over and back under
  its cap is logged once each way.

An idle engine publishes nothing, so silence is not death, and a message lost at the end
of a burst would otherwise stay unnoticed until the next burst. Two mechanisms cover this:

* a *tail probe*: after ``tail_probe_s`` of silence on a connected stream, an anchored
  replay asks for anything newer than the last applied batch (the engine answers with
  the anchor and the end marker when nothing is new; a restarted engine is detected);
* *death* is a transport fact, not a silence: a stream whose TCP connection has been down
  for ``dead_grace_s`` (seen through a ZMQ socket monitor) is purged, and so is a worker
  the router declares dead through :meth:`FleetSubscriber.mark_dead` (its health checks
  failed). A purged worker that comes back is re-synchronised from seq 0.

ZMQ reconnects by itself with exponential backoff (``RECONNECT_IVL`` doubling up to
``RECONNECT_IVL_MAX``); when a connection comes back, an anchored replay checks whether it
is the same publisher before trusting the next seq.

Everything runs on one background thread that owns every socket; other threads talk to
it through a command queue, so routing never waits on ingestion. Malformed messages are
counted (``kvrouter_kv_events_malformed_total``), logged and skipped, and so is a batch
that decodes but that the hash verifier cannot process or the index refuses (a
``ValueError``: it would be refused again after a re-sync, which replays it); nothing a
peer sends can stop the thread. Other index failures (Redis unreachable) re-synchronise
the worker.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import msgspec
import zmq
from prometheus_client import CollectorRegistry, Counter, Gauge
from zmq.utils.monitor import recv_monitor_message

from indexer.events import (
    AllBlocksCleared,
    BlockStored,
    EventBatch,
    EventDecodeError,
    build_replay_request,
    decode_batch,
    parse_pub_frames,
    parse_replay_reply,
)
from indexer.breaker import Outage, Throttle
from indexer.heap import trim
from indexer.index import DEFAULT_MEDIUM, Index, KeyCaps, Worker

if TYPE_CHECKING:
    from indexer.verify import HashVerifier

__all__ = ["FleetSubscriber", "StreamSpec", "StreamStats", "bound_batch", "specs_from_config", "offset_endpoint"]

log = logging.getLogger(__name__)

_NEVER = float("inf")
MAX_EVENT_BYTES = 16 << 20
"""Largest event batch applied; a larger one is skipped as malformed. vLLM's batches are
kilobytes (a 100k-token prompt stores ~6k blocks, ~0.5 MB with its token ids): only a
forged publisher sends more, and the index would hold whatever it said."""
MAX_MESSAGE_BYTES = 256 << 20
"""ZMQ's own bound (``ZMQ_MAXMSGSIZE``): past it the connection is dropped before the
message is read, so no single message can take more memory than this."""
TURN_BYTES = 256 << 10
"""Payload bytes one stream applies per turn of the subscriber's loop before the other
streams get theirs (at least one message): ~29,000 bare keys, some 15 ms of index work
and ~50 ms with hash verification, so a stream flooded with batches delays the others
by about that much per turn, while a real engine's batches (kilobytes) are applied whole
and at once when no other stream is busy."""
MAX_BATCH_BLOCKS = 1 << 17
"""Most stored blocks one batch may bring; the blocks past it are dropped and counted like
keys past the cap. vLLM publishes one batch per engine step, and a step computes at most
``max_num_batched_tokens`` tokens: 131,072 blocks is 2M tokens at block size 16, more than
any step. A forged 16 MiB batch (1.8M bare keys) would otherwise hold the ingest thread,
and every other stream, for seconds while it is verified and stored whole."""
MAX_MEDIA_PER_WORKER = 4
"""Tiers one worker may store into between two clears: GPU, CPU and two more (a connector's
storage tiers). Each tier has its own cap, so forged tier names would multiply it; a store
naming a fifth tier is dropped and counted like keys past the cap."""
WARN_EVERY_S = 10.0
"""A stream's malformed messages are logged at most this often (each one is counted)."""
_RECENT_MAX = 4096
"""Applied batches remembered (seq -> hash of payload) to tell duplicates from restarts."""
MAX_SEQ_JUMP = 1 << 20
"""A seq further than this past the next one expected is no drop that a replay could fill:
vLLM's replay buffer holds 10,000 batches by default, and an engine publishes a batch per
scheduler step, so a million is hours of a busy engine's stream. Such a jump is suspect
until corroborated (see the module docstring)."""
CORROBORATING_BATCHES = 3
"""Batches in a row, continuing from a suspect seq, that make it believed when the engine's
replay cannot be asked: a real restart or jump keeps publishing from its new seq."""
MAX_STALLED_REPLAYS = 3
"""Replays in a row that may apply nothing before a hole inside the engine's answer is
declared lost: one that applies something proves the engine still answers, so a 10,000-batch
history at a 1,000-message high-water mark is fetched in a few rounds, but an engine that
never sends the hole cannot keep the subscriber asking forever."""
TRIM_AFTER_MSGS = 1000
"""A replay that held at least this many batches (~1 MB), or any re-sync from seq 0, ends
with the freed heap pages given back to the OS (:mod:`indexer.heap`: without it the
process keeps each burst's high-water mark resident). Probes and short gap replays, the
frequent ones, do not pay for a trim (a few ms of the allocator's locks)."""


@dataclass(frozen=True)
class StreamSpec:
    """One engine publisher to follow: which worker its events describe and where it is."""

    model: str
    worker: Worker
    endpoint: str
    replay_endpoint: str | None
    topic: str = ""
    vllm_version: str = "0.33.0"


@dataclass
class StreamStats:
    """What the router shows in ``/debug/backends`` for one event stream.

    ``last_seq`` is the last batch applied (``None`` before the first). ``gaps`` counts
    detected holes, ``replays`` replay requests made for gaps and re-syncs, ``refills``
    replays asking again for batches a replay's answer lost in transit, ``lost`` holes
    no replay could fill, ``restarts`` publisher restarts, ``purges`` clears because the
    worker was dead or removed. ``rehash_mode`` is true while the index holds
    router-computed hashes for this worker because the engine's did not verify.
    ``capped`` counts stored keys the caps dropped (past the worker's cap, or naming one
    tier too many); ``over_cap`` is true from the batch that passed the cap until a batch
    stores without dropping anything (or the worker is cleared). ``capacity`` is the
    engine's KV-cache capacity per tier in keys, as the router's scrape read it (the cap is
    twice that; a tier not listed has the default bound). ``suspect_seqs`` counts
    messages whose seq did not follow and that the engine did not corroborate, held back
    unapplied (see the module docstring).
    """

    connected: bool = False
    last_seq: int | None = None
    gaps: int = 0
    replays: int = 0
    refills: int = 0
    probes: int = 0
    lost: int = 0
    restarts: int = 0
    purges: int = 0
    malformed: int = 0
    index_errors: int = 0
    index_resets: int = 0
    batches: int = 0
    events: int = 0
    blocks: int = 0
    verify_match: int = 0
    verify_mismatch: int = 0
    verify_unverifiable: int = 0
    verify_skipped: int = 0
    rehash_mode: bool = False
    rehash_reason: str | None = None
    capped: int = 0
    over_cap: bool = False
    capacity: dict[str, int] = field(default_factory=dict)
    suspect_seqs: int = 0
    dead: bool = False
    last_event_age_s: float | None = None


def offset_endpoint(endpoint: str, rank: int) -> str:
    """``endpoint`` with its TCP port moved by ``rank``, as vLLM does for DP rank ``rank``."""
    if rank == 0:
        return endpoint
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"data-parallel ranks need tcp:// endpoints (port + rank), got {endpoint!r}")
    host, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"endpoint has no port: {endpoint!r}")
    return f"{host}:{int(port) + rank}"


def _check_connectable(endpoint: str, what: str) -> str:
    if endpoint.startswith("tcp://") and ("*" in endpoint or endpoint.startswith("tcp://0.0.0.0")):
        raise ValueError(
            f"{what} {endpoint!r} is the engine's bind address; the router connects, so give the "
            "engine's host (e.g. tcp://10.0.0.5:5557)"
        )
    return endpoint


def specs_from_config(config: Any) -> list[StreamSpec]:
    """One :class:`StreamSpec` per (backend, DP rank) of every model whose backend has ``kv_events``.

    DP rank ``r`` publishes on the ``kv_events`` port + r and replays on ``kv_replay`` + r.
    Raises ``ValueError`` for an endpoint the router cannot connect to.
    """
    specs: list[StreamSpec] = []
    for model in config.models:
        for backend in model.backends:
            if backend.kv_events is None:
                continue
            events = _check_connectable(backend.kv_events, f"backend {backend.name} kv_events")
            replay = backend.kv_replay and _check_connectable(backend.kv_replay, f"backend {backend.name} kv_replay")
            for rank in range(backend.data_parallel_size):
                specs.append(
                    StreamSpec(
                        model=model.name,
                        worker=Worker(backend.name, rank),
                        endpoint=offset_endpoint(events, rank),
                        replay_endpoint=offset_endpoint(replay, rank) if replay else None,
                        vllm_version=model.vllm_version,
                    )
                )
    return specs


class _Metrics:
    """The subscriber's Prometheus series, labelled by backend and DP rank."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["backend", "dp_rank"]
        self.events = Counter("kvrouter_kv_events", "KV events applied, by type", labels + ["type"], registry=registry)
        self.batches = Counter("kvrouter_kv_event_batches", "KV event batches applied", labels, registry=registry)
        self.malformed = Counter(
            "kvrouter_kv_events_malformed", "KV event messages that could not be decoded (skipped)", labels,
            registry=registry,
        )
        self.gaps = Counter("kvrouter_kv_event_gaps", "Holes detected in a stream's seq", labels, registry=registry)
        self.replays = Counter("kvrouter_kv_event_replays", "Replay requests for gaps and re-syncs", labels, registry=registry)
        self.refills = Counter(
            "kvrouter_kv_event_replay_refills", "Replays asking again for batches a replay's answer lost in transit "
            "(the engine's ROUTER drops past its send high-water mark)", labels, registry=registry,
        )
        self.lost = Counter(
            "kvrouter_kv_event_history_lost", "Holes no replay could fill (worker cleared)", labels, registry=registry
        )
        self.restarts = Counter(
            "kvrouter_kv_event_publisher_restarts", "Engine publisher restarts detected (worker cleared)", labels,
            registry=registry,
        )
        self.purges = Counter(
            "kvrouter_kv_event_worker_purges", "Workers purged from the index (dead or removed)", labels,
            registry=registry,
        )
        self.index_errors = Counter(
            "kvrouter_kv_event_index_errors", "Index writes that failed (worker re-synchronised)", labels,
            registry=registry,
        )
        self.index_resets = Counter(
            "kvrouter_kv_event_index_resets", "Times the index lost its data (Redis restarted empty) and the worker "
            "was rebuilt from the engine's history", labels, registry=registry,
        )
        self.verify = Counter(
            "kvrouter_kv_hash_verify", "Engine block hashes checked against the router's", labels + ["result"],
            registry=registry,
        )
        self.rehash = Gauge(
            "kvrouter_kv_rehash_mode", "1 while the worker is indexed with router-computed hashes", labels,
            registry=registry,
        )
        self.capped = Counter(
            "kvrouter_kv_event_keys_capped", "Stored block keys dropped because the worker held more than its cap "
            "(twice its engine's KV-cache capacity per tier) or stored into too many tiers: forged events, or "
            "lost removals", labels, registry=registry,
        )
        self.suspect_seqs = Counter(
            "kvrouter_kv_event_suspect_seqs", "Messages whose seq did not follow, held back unapplied until the "
            "engine corroborates it (a run of batches taken later counts once; backwards: the engine has not "
            "restarted; jump: beyond any replay buffer; ahead: the engine never published it)", labels + ["reason"],
            registry=registry,
        )
        self.connected = Gauge("kvrouter_kv_stream_connected", "1 while the event stream is connected", labels, registry=registry)
        self.heap_trims = Counter(
            "kvrouter_kv_event_heap_trims", "Heap trims after a large replay, by outcome (released: pages went back "
            "to the OS; none: nothing to give back; unsupported: no malloc_trim in this C library)", ["outcome"],
            registry=registry,
        )


@dataclass
class _Replay:
    """A replay in flight. ``anchor_hash`` is the hash of the payload applied at ``start``
    (``None`` for a re-sync from 0, which has no anchor); ``msgs`` merges the reply with the
    live messages that arrived meanwhile."""

    start: int
    anchor_hash: int | None
    deadline: float
    reason: str
    msgs: dict[int, bytes] = field(default_factory=dict)
    replied_min: int | None = None
    replied_max: int | None = None


class _Stream:
    def __init__(self, spec: StreamSpec, labels: tuple[str, str]) -> None:
        self.spec = spec
        self.labels = labels
        self.stats = StreamStats()
        self.sub: zmq.Socket | None = None
        self.monitor: zmq.Socket | None = None
        self.dealer: zmq.Socket | None = None
        self.expected: int | None = None
        self.recent: OrderedDict[int, int] = OrderedDict()  # O(1) oldest-first eviction: a dict's next(iter()) walks the slots its deletions left
        self.replay: _Replay | None = None
        self.last_msg: float | None = None
        self.last_probe: float = time.monotonic()
        self.was_connected = False
        self.disconnected_since: float | None = None
        self.resync_at: float | None = None
        self.owes_trim = False
        """A large replay ended while a follow-up replay still held its rest: trim after that one."""
        self.stalled = 0
        """Replays in a row that applied nothing (``MAX_STALLED_REPLAYS``)."""
        self.malformed_log = Throttle(WARN_EVERY_S)
        self.media: set[str] = set()
        """Tiers the worker stored into since it was last cleared (:data:`MAX_MEDIA_PER_WORKER`)."""
        self.suspects: dict[int, bytes] = {}
        """A run of consecutive suspect messages not yet corroborated (:data:`CORROBORATING_BATCHES`)."""
        self.suspect_log = Throttle(WARN_EVERY_S)


class FleetSubscriber:
    """Follows every engine's KV-event stream and keeps ``index`` equal to their caches.

    ``verifiers`` (by model name) check the engines' block hashes and may switch a worker
    to re-hash mode (see :mod:`indexer.verify`). Thread-safety: :meth:`start`,
    :meth:`stop`, :meth:`update_specs`, :meth:`mark_dead` and :meth:`stats` may be called
    from any thread; the sockets and the index writes belong to the subscriber thread.
    """

    def __init__(
        self,
        index: Index,
        specs: list[StreamSpec],
        *,
        verifiers: dict[str, HashVerifier] | None = None,
        dead_grace_s: float = 30.0,
        metrics_registry: CollectorRegistry | None = None,
        replay_timeout_s: float = 5.0,
        tail_probe_s: float = 10.0,
        reconnect_ivl_s: float = 0.1,
        reconnect_ivl_max_s: float = 5.0,
        poll_interval_s: float = 0.05,
    ) -> None:
        self._index = index
        self._specs = _unique(specs)
        self._verifiers = dict(verifiers or {})
        self._dead_grace_s = dead_grace_s
        self._replay_timeout_s = replay_timeout_s
        self._tail_probe_s = tail_probe_s
        self._reconnect_ivl_ms = max(1, int(reconnect_ivl_s * 1000))
        self._reconnect_ivl_max_ms = max(self._reconnect_ivl_ms, int(reconnect_ivl_max_s * 1000))
        self._poll_ms = max(1, int(poll_interval_s * 1000))
        self._metrics = _Metrics(metrics_registry if metrics_registry is not None else CollectorRegistry())
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[Worker, _Stream] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._ctx: zmq.Context | None = None
        self._sockets_changed = True
        self._outage = Outage(log)

    # -- public API (any thread) ----------------------------------------------------------

    def start(self) -> None:
        """Connect to every stream and start ingesting on a background thread."""
        if self._thread is not None:
            raise RuntimeError("FleetSubscriber already started")
        self._ctx = zmq.Context()
        self._stopping.clear()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread and close every socket; returns within about ``timeout`` seconds."""
        thread = self._thread
        if thread is None:
            return
        self._stopping.set()
        thread.join(timeout)
        if thread.is_alive():
            log.error("kv-events thread did not stop within %.1fs", timeout)
        self._thread = None
        if self._ctx is not None:
            if thread.is_alive():
                self._ctx.destroy(linger=0)
            else:
                self._ctx.term()
            self._ctx = None

    @property
    def running(self) -> bool:
        """True while the ingest thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def update_specs(self, specs: Iterable[StreamSpec]) -> None:
        """Follow exactly ``specs`` from now on; a worker no longer listed is purged from the index."""
        new = _unique(list(specs))
        if self._thread is None:
            self._specs = new
            return
        self._commands.put(lambda: self._reconcile(new))

    def mark_dead(self, worker: Worker) -> None:
        """The router judged ``worker`` dead (health checks failed past its grace): purge it.

        Its entries leave the index at once; if the engine comes back, the stream is
        re-synchronised from seq 0.
        """
        if self._thread is None:
            return
        self._commands.put(lambda: self._purge_worker(worker, "marked dead"))

    def resync_all(self, why: str) -> None:
        """The index lost entries behind the subscriber's back (its Redis restarted empty):
        clear every worker and rebuild it from its engine's history, as after a failed write."""
        if self._thread is None:
            return
        self._commands.put(lambda: self._resync_every(why))

    def stats(self) -> dict[Worker, StreamStats]:
        """A snapshot of every followed stream's counters and state."""
        now = time.monotonic()
        with self._lock:
            streams = list(self._streams.values())
        counts: dict[str, dict[Worker, int]] = {}
        out: dict[Worker, StreamStats] = {}
        for st in streams:
            model = st.spec.model
            if model not in counts:
                try:
                    counts[model] = dict(self._index.block_counts(model))
                except Exception:
                    log.warning("block_counts(%s) failed", model, exc_info=True)
                    counts[model] = {}
            snap = replace(st.stats)
            snap.blocks = counts[model].get(st.spec.worker, 0)
            snap.capacity = self._index.caps.capacity(st.spec.worker)
            snap.last_event_age_s = None if st.last_msg is None else round(now - st.last_msg, 3)
            out[st.spec.worker] = snap
        return out

    # -- the subscriber thread --------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._reconcile(self._specs)
            poller: zmq.Poller | None = None
            while not self._stopping.is_set():
                self._drain_commands()
                if poller is None or self._sockets_changed:
                    poller = self._poller()
                try:
                    ready = dict(poller.poll(self._poll_ms))
                except zmq.ZMQError as e:
                    log.warning("poll failed: %s", e)
                    ready = {}
                for st in list(self._streams.values()):
                    if st.monitor is not None and st.monitor in ready:
                        self._on_monitor(st)
                    if st.sub is not None and st.sub in ready:
                        self._on_sub(st)
                    if st.dealer is not None and st.dealer in ready:
                        self._on_dealer(st)
                self._tick(time.monotonic())
        except Exception:
            log.exception("kv-events thread crashed")
        finally:
            for st in list(self._streams.values()):
                self._close(st)

    def _poller(self) -> zmq.Poller:
        self._sockets_changed = False
        poller = zmq.Poller()
        for st in self._streams.values():
            for sock in (st.sub, st.monitor, st.dealer):
                if sock is not None:
                    poller.register(sock, zmq.POLLIN)
        return poller

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            cmd()

    def _reconcile(self, specs: list[StreamSpec]) -> None:
        self._specs = specs
        wanted = {s.worker: s for s in specs}
        for worker, st in list(self._streams.items()):
            spec = wanted.get(worker)
            if spec == st.spec:
                continue
            self._purge_worker(worker, "removed from config" if spec is None else "endpoint changed")
            self._close(st)
            with self._lock:
                del self._streams[worker]
            self._zero_gauges(st)
        for worker, spec in wanted.items():
            if worker not in self._streams:
                st = _Stream(spec, (worker.backend, str(worker.dp_rank)))
                self._open(st)
                with self._lock:
                    self._streams[worker] = st

    def _open(self, st: _Stream) -> None:
        assert self._ctx is not None
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RECONNECT_IVL, self._reconnect_ivl_ms)
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, self._reconnect_ivl_max_ms)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sub.setsockopt(zmq.SUBSCRIBE, st.spec.topic.encode())
        st.monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sub.connect(st.spec.endpoint)
        st.sub = sub
        self._sockets_changed = True
        self._metrics.rehash.labels(*st.labels).set(0)
        self._metrics.connected.labels(*st.labels).set(0)

    def _close(self, st: _Stream) -> None:
        self._sockets_changed = True
        if st.sub is not None:
            try:
                st.sub.disable_monitor()
            except zmq.ZMQError:
                pass
            st.sub.close(linger=0)
            st.sub = None
        if st.monitor is not None:
            st.monitor.close(linger=0)
            st.monitor = None
        self._close_dealer(st)

    def _close_dealer(self, st: _Stream) -> None:
        if st.dealer is not None:
            self._sockets_changed = True
            st.dealer.close(linger=0)
            st.dealer = None

    def _zero_gauges(self, st: _Stream) -> None:
        """A removed worker's gauges read 0 (its counters keep their history)."""
        self._metrics.connected.labels(*st.labels).set(0)
        self._metrics.rehash.labels(*st.labels).set(0)

    # -- socket events -------------------------------------------------------------------------

    def _on_monitor(self, st: _Stream) -> None:
        assert st.monitor is not None
        while True:
            try:
                msg = recv_monitor_message(st.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError:
                return
            now = time.monotonic()
            if msg["event"] == zmq.EVENT_CONNECTED:
                reconnect = st.was_connected and not st.stats.connected
                st.stats.connected = st.was_connected = True
                st.disconnected_since = None
                self._metrics.connected.labels(*st.labels).set(1)
                log.info("kv events %s connected to %s", _name(st), st.spec.endpoint)
                if st.replay is None and st.spec.replay_endpoint is not None:
                    if st.expected is None:
                        self._begin_replay(st, "sync")
                    elif reconnect:
                        self._begin_replay(st, "reconnect")
            elif msg["event"] == zmq.EVENT_DISCONNECTED:
                if st.stats.connected:
                    st.disconnected_since = now
                st.stats.connected = False
                self._metrics.connected.labels(*st.labels).set(0)
                log.info("kv events %s disconnected from %s", _name(st), st.spec.endpoint)

    def _on_sub(self, st: _Stream) -> None:
        """One turn: messages up to :data:`TURN_BYTES` of payload (at least one), then the next stream's."""
        assert st.sub is not None
        budget = TURN_BYTES
        for _ in range(1000):
            try:
                frames = st.sub.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            try:
                _topic, seq, payload = parse_pub_frames(frames)
            except EventDecodeError as e:
                self._malformed(st, f"bad frames: {e}")
                continue
            st.last_msg = time.monotonic()
            self._on_live(st, seq, payload)
            budget -= len(payload)
            if budget <= 0:
                return

    def _on_live(self, st: _Stream, seq: int, payload: bytes) -> None:
        if st.stats.dead:
            st.stats.dead = False
            log.info("kv events %s alive again at seq %d", _name(st), seq)
        if st.replay is not None:
            st.replay.msgs.setdefault(seq, payload)
            return
        if st.expected is None:
            if seq == 0 or st.spec.replay_endpoint is None:
                if seq != 0:
                    log.info("kv events %s joined at seq %d without a replay endpoint", _name(st), seq)
                self._apply(st, seq, payload)
            else:
                self._begin_replay(st, "sync", pending={seq: payload})
            return
        if seq == st.expected:
            st.suspects.clear()
            self._apply(st, seq, payload)
        elif seq > st.expected + MAX_SEQ_JUMP and st.spec.replay_endpoint is None:
            self._corroborate(st, seq, payload, "jump")
        elif seq > st.expected:
            self._count(st, "gaps")
            log.info("kv events %s gap: expected seq %d, got %d", _name(st), st.expected, seq)
            if st.spec.replay_endpoint is None:
                self._lose(st, f"seqs {st.expected}..{seq - 1} missed and no replay endpoint")
                self._apply(st, seq, payload)
            else:
                self._begin_replay(st, "gap", pending={seq: payload})
        elif st.recent.get(seq) == hash(payload):
            return
        elif st.spec.replay_endpoint is not None:
            self._begin_replay(st, "backwards", pending={seq: payload})
        else:
            self._corroborate(st, seq, payload, "backwards")

    def _on_dealer(self, st: _Stream) -> None:
        assert st.dealer is not None
        for _ in range(10_000):
            try:
                frames = st.dealer.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            r = st.replay
            if r is None:
                continue
            try:
                item = parse_replay_reply(frames)
            except EventDecodeError as e:
                self._malformed(st, f"bad replay reply: {e}")
                continue
            if item is None:
                self._finish_replay(st, timed_out=False)
                return
            seq, payload = item
            r.msgs[seq] = payload
            r.replied_min = seq if r.replied_min is None else min(r.replied_min, seq)
            r.replied_max = seq if r.replied_max is None else max(r.replied_max, seq)

    def _tick(self, now: float) -> None:
        for st in list(self._streams.values()):
            if st.replay is not None and now >= st.replay.deadline:
                log.warning("kv events %s: replay from %s timed out", _name(st), st.spec.replay_endpoint)
                self._close_dealer(st)
                self._finish_replay(st, timed_out=True)
            if st.resync_at is not None and now >= st.resync_at:
                self._resync(st)
            if (
                st.disconnected_since is not None
                and not st.stats.dead
                and now - st.disconnected_since >= self._dead_grace_s
            ):
                self._purge_worker(st.spec.worker, f"disconnected for {self._dead_grace_s:g}s")
            if (
                st.replay is None
                and st.expected is not None
                and st.stats.connected
                and st.spec.replay_endpoint is not None
                and now - max(st.last_msg or 0.0, st.last_probe) >= self._tail_probe_s
            ):
                st.last_probe = now
                st.stats.probes += 1
                self._begin_replay(st, "probe")

    # -- replay ----------------------------------------------------------------------------------

    def _begin_replay(self, st: _Stream, reason: str, pending: dict[int, bytes] | None = None) -> None:
        """Ask the engine for every batch from ``expected - 1`` (anchored) or from 0 (``sync``)."""
        assert self._ctx is not None and st.spec.replay_endpoint is not None
        if st.expected is None:
            start, anchor = 0, None
        else:
            start = st.expected - 1
            anchor = st.recent.get(start)
        st.replay = _Replay(start, anchor, time.monotonic() + self._replay_timeout_s, reason, dict(pending or {}))
        if reason != "probe":
            self._count(st, "replays")
        if st.dealer is None:
            dealer = self._ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.RCVHWM, 0)
            dealer.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            dealer.connect(st.spec.replay_endpoint)
            st.dealer = dealer
            self._sockets_changed = True
        try:
            st.dealer.send_multipart(build_replay_request(start), zmq.NOBLOCK)
        except zmq.ZMQError as e:
            log.warning("kv events %s: replay request failed: %s", _name(st), e)
            self._close_dealer(st)
            st.replay.deadline = time.monotonic()

    def _finish_replay(self, st: _Stream, *, timed_out: bool) -> None:
        r = st.replay
        assert r is not None
        st.owes_trim = st.owes_trim or r.reason == "sync" or len(r.msgs) >= TRIM_AFTER_MSGS
        self._settle_replay(st, r, timed_out=timed_out)
        if st.owes_trim and st.replay is None:  # a follow-up replay holds the rest: trim once it ends
            st.owes_trim = False
            released = trim()
            self._metrics.heap_trims.labels("unsupported" if released is None else "released" if released else "none").inc()

    def _settle_replay(self, st: _Stream, r: _Replay, *, timed_out: bool) -> None:
        """Apply what a finished replay brought, or ask again for what it could not."""
        st.replay = None
        msgs = r.msgs
        if r.reason == "probe" and timed_out:
            for seq in sorted(msgs):
                self._on_live(st, seq, msgs[seq])
            return
        # Holes below ``held_from`` are history the engine no longer holds. Holes from it up
        # to ``answered`` were lost in transit (the engine held them: its buffer is one run
        # of seqs); holes above it were published after the engine answered, or sent after
        # an end marker the transit lost too. Both are asked again.
        if r.replied_max is not None:
            held_from, answered = r.replied_min, r.replied_max
        elif timed_out:
            held_from = answered = _NEVER
        else:
            answered = r.start - 1
            held_from = answered + 1
        if r.anchor_hash is None and st.expected is not None:
            # The anchor fell out of the recent map (it cannot with a bounded gap): nothing to
            # compare against, so treat the stream as lost and start over.
            self._lose(st, "anchor unknown")
            self._resync_with(st, msgs)
            return
        if r.anchor_hash is not None:
            got = msgs.pop(r.start, None)
            if got is None:
                if timed_out or (r.replied_min is not None and r.replied_min > r.start):
                    # No answer, or the engine's buffer moved past the anchor: whatever is
                    # still missing is counted as lost by the run below.
                    if not self._uncorroborated(st, msgs, timed_out):
                        self._apply_run(st, msgs, st.expected, held_from, answered)
                    return
                self._restart(st, f"engine no longer holds seq {r.start}")
                self._resync_with(st, msgs)
                return
            if hash(got) != r.anchor_hash:
                self._restart(st, f"engine's batch {r.start} differs from the one applied")
                self._resync_with(st, msgs)
                return
            self._uncorroborated(st, msgs, False)
            self._apply_run(st, msgs, st.expected, held_from, answered)
            return
        if r.replied_min is not None:
            start = r.replied_min
        elif timed_out and msgs:
            start = min(msgs)
        else:
            start = 0
        if start > 0:
            log.info("kv events %s: joined at seq %d (earlier history not available)", _name(st), start)
        self._apply_run(st, msgs, start, held_from, answered)

    def _resync_with(self, st: _Stream, msgs: dict[int, bytes]) -> None:
        st.expected = None
        st.recent.clear()
        if st.spec.replay_endpoint is not None and st.stats.connected:
            self._begin_replay(st, "sync", pending=msgs)
        elif msgs:
            self._apply_run(st, msgs, min(msgs), _NEVER, _NEVER)

    def _apply_run(self, st: _Stream, msgs: dict[int, bytes], seq: int | None, held_from: float,
                   answered: float) -> None:
        """Apply ``msgs`` in seq order from ``seq``; seqs already applied are dropped.

        A hole below ``held_from`` is history the engine no longer holds: the worker is
        cleared and application resumes at the next held batch (a suffix of history never
        over-claims). A hole from it on is asked for again by a new replay that keeps the
        rest of ``msgs`` as its pending live messages (a *refill* up to ``answered``, a gap
        above), unless ``MAX_STALLED_REPLAYS`` replays in a row applied nothing.
        """
        if seq is None:
            seq = min(msgs) if msgs else 0
        applied = False
        while msgs:
            payload = msgs.pop(seq, None)
            if payload is not None:
                self._apply(st, seq, payload)
                applied = True
                seq += 1
                continue
            nxt = min(msgs)
            if nxt < seq:
                del msgs[nxt]
                continue
            if nxt - seq > MAX_SEQ_JUMP and not seq < held_from < _NEVER:
                # Not history the engine's answer shows gone: a jump only the engine's own
                # stream, continuing from it, can make believable.
                st.stalled = 0
                self._suspect_run(st, msgs, "jump", corroborate=held_from == _NEVER)
                return
            st.stalled = 0 if applied else st.stalled + 1
            if seq >= held_from and st.spec.replay_endpoint is not None and st.stalled <= MAX_STALLED_REPLAYS:
                self._count(st, "refills" if seq <= answered else "gaps")
                self._begin_replay(st, "gap", pending=msgs)
                return
            st.stalled = 0
            if held_from <= answered < seq < _NEVER:
                # Replays answered, and none reached the hole: the engine never published
                # what lies above it.
                self._suspect_run(st, msgs, "ahead", corroborate=False)
                return
            self._lose(st, f"seqs {seq}..{nxt - 1} are gone from the engine's buffer"
                       if seq < held_from else f"seqs {seq}..{nxt - 1} never came, in {MAX_STALLED_REPLAYS + 1} replays")
            seq = nxt
        st.stalled = 0

    # -- state changes -----------------------------------------------------------------------------

    def _apply(self, st: _Stream, seq: int, payload: bytes) -> None:
        st.expected = seq + 1
        st.stats.last_seq = seq
        st.recent[seq] = hash(payload)
        if len(st.recent) > _RECENT_MAX:
            st.recent.popitem(last=False)
        if len(payload) > MAX_EVENT_BYTES:
            self._malformed(st, f"seq {seq}: {len(payload)} bytes, over the {MAX_EVENT_BYTES}-byte bound")
            return
        try:
            batch = decode_batch(payload)
        except EventDecodeError as e:
            self._malformed(st, f"seq {seq}: {e}")
            return
        batch, dropped = bound_batch(batch, st.media, self._index.caps, st.spec.worker)
        verifier = self._verifiers.get(st.spec.model)
        if verifier is not None:
            try:
                batch = self._verify(st, verifier, batch)
            except Exception as e:  # noqa: BLE001 - one engine's odd batch must not stop every stream
                self._malformed(st, f"seq {seq}: cannot be verified: {e!r}")
                return
        try:
            dropped += self._index.apply(st.spec.model, st.spec.worker, batch)
        except ValueError as e:
            # The index refused the batch's content: it would refuse it again after a
            # re-sync (which replays it), so it is skipped like any malformed batch.
            self._malformed(st, f"seq {seq}: the index refused it: {e}")
            return
        except Exception as e:  # noqa: BLE001 - the index's store is down (Redis): re-sync when it answers
            self._index_failed(st, f"index write failed at seq {seq}; re-synchronising", e)
            st.resync_at = time.monotonic()
            return
        self._outage.answered(st.spec.worker, "kv events %s: the index takes writes again", _name(st))
        self._capped(st, dropped, batch)
        st.stats.batches += 1
        self._metrics.batches.labels(*st.labels).inc()
        for ev in batch.events:
            kind = type(ev).__name__
            st.stats.events += 1
            self._metrics.events.labels(*st.labels, kind).inc()

    def _capped(self, st: _Stream, dropped: int, batch: EventBatch) -> None:
        """Count what the caps dropped; log the worker's passing over its cap, and back under it, once each."""
        s = st.stats
        if dropped:
            s.capped += dropped
            self._metrics.capped.labels(*st.labels).inc(dropped)
            if not s.over_cap:
                s.over_cap = True
                log.warning("kv events %s: more keys than the worker's cap (twice its engine's KV-cache capacity per "
                            "tier) or than %d tiers: dropping the oldest, counted in kvrouter_kv_event_keys_capped_total. "
                            "Its events are forged or its removals were lost; logged again when it is back under",
                            _name(st), MAX_MEDIA_PER_WORKER)
        elif s.over_cap and any(type(ev) is BlockStored for ev in batch.events):
            s.over_cap = False
            log.info("kv events %s: back under its key cap", _name(st))

    def _verify(self, st: _Stream, verifier: HashVerifier, batch: EventBatch) -> EventBatch:
        outcome = verifier.check(st.spec.worker, batch)
        s = st.stats
        s.verify_match += outcome.match
        s.verify_mismatch += outcome.mismatch
        s.verify_unverifiable += outcome.unverifiable
        s.verify_skipped += outcome.skipped
        for result, n in (("match", outcome.match), ("mismatch", outcome.mismatch),
                          ("unverifiable", outcome.unverifiable), ("skipped", outcome.skipped)):
            if n:
                self._metrics.verify.labels(*st.labels, result).inc(n)
        if outcome.mode_changed:
            s.rehash_mode = verifier.rehash_mode(st.spec.worker)
            s.rehash_reason = verifier.diagnosis(st.spec.worker) if s.rehash_mode else None
            self._metrics.rehash.labels(*st.labels).set(1 if s.rehash_mode else 0)
        return outcome.batch

    def _clear(self, st: _Stream) -> bool:
        st.media.clear()
        st.suspects.clear()
        st.stats.over_cap = False
        verifier = self._verifiers.get(st.spec.model)
        if verifier is not None:
            verifier.forget(st.spec.worker)
        try:
            self._index.clear(st.spec.model, st.spec.worker)
            return True
        except Exception as e:  # noqa: BLE001 - as in _apply
            self._index_failed(st, "clearing the index failed", e)
            st.resync_at = time.monotonic() + 1.0
            return False

    def _lose(self, st: _Stream, why: str) -> None:
        self._count(st, "lost")
        log.warning("kv events %s: history lost (%s); worker cleared", _name(st), why)
        self._clear(st)

    def _uncorroborated(self, st: _Stream, msgs: dict[int, bytes], timed_out: bool) -> bool:
        """After an anchored replay that did not show a restart: the live messages it held
        with a seq below the expected one (duplicates aside) were not the engine's or, the
        replay unanswered, are not yet shown to be. True when they made up a run that was
        taken (the stream was re-synchronised: ``msgs`` is stale)."""
        assert st.expected is not None
        back = {seq: msgs.pop(seq) for seq in [s for s in msgs if s < st.expected] if st.recent.get(seq) != hash(msgs[seq])}
        return bool(back) and self._suspect_run(st, back, "backwards", corroborate=timed_out)

    def _suspect_run(self, st: _Stream, msgs: dict[int, bytes], reason: str, *, corroborate: bool) -> bool:
        """Drop ``msgs`` as suspect; with ``corroborate`` (the engine could not be asked) they
        count towards :data:`CORROBORATING_BATCHES`. True when a run was taken."""
        taken = False
        for seq in sorted(msgs):
            if corroborate:
                taken = self._corroborate(st, seq, msgs[seq], reason)
                if taken:
                    break
            else:
                self._suspect(st, seq, reason)
        msgs.clear()
        return taken

    def _corroborate(self, st: _Stream, seq: int, payload: bytes, reason: str) -> bool:
        """Hold a suspect message the engine cannot be asked about; take the run it starts
        once :data:`CORROBORATING_BATCHES` batches continue it (a new publisher, or history
        really gone): the worker is cleared and the stream re-synchronised from the run.
        True when taken."""
        run = st.suspects
        if seq in run:
            return False
        if not run or seq != max(run) + 1:
            run.clear()
            self._suspect(st, seq, reason)
        run[seq] = payload
        if len(run) < CORROBORATING_BATCHES:
            return False
        msgs = dict(run)
        first = min(msgs)
        log.warning("kv events %s: %d batches in a row continued from seq %d (expected %s): taken as the engine's",
                    _name(st), len(msgs), first, st.expected)
        if st.expected is not None and first < st.expected:
            self._restart(st, f"seq went back from {st.expected - 1} to {first}")
        else:
            self._lose(st, f"seq jumped from {st.expected} to {first}")
        self._resync_with(st, msgs)
        return True

    def _suspect(self, st: _Stream, seq: int, reason: str) -> None:
        """Count a suspect seq; log it unless this stream logged one within :data:`WARN_EVERY_S`."""
        st.stats.suspect_seqs += 1
        self._metrics.suspect_seqs.labels(*st.labels, reason).inc()
        more = st.suspect_log.due()
        if more is not None:
            log.warning("kv events %s: suspect seq %d (%s, expected %s) dropped; its events are not the engine's, or not "
                        "yet shown to be%s", _name(st), seq, reason, st.expected, more)

    def _restart(self, st: _Stream, why: str) -> None:
        self._count(st, "restarts")
        log.warning("kv events %s: publisher restarted (%s); worker cleared", _name(st), why)
        self._clear(st)
        st.expected = None
        st.stats.last_seq = None  # the new publisher's seqs start over: nothing of it applied yet
        st.recent.clear()
        st.stalled = 0

    def _resync_every(self, why: str) -> None:
        log.warning("kv events: %s; rebuilding every worker from its engine's history", why)
        now = time.monotonic()
        for st in self._streams.values():
            self._count(st, "index_resets")
            st.resync_at = now

    def _resync(self, st: _Stream) -> None:
        """After an index failure: clear the worker and rebuild it from the engine's history.

        A replay in flight is let finish and the re-sync runs after it: what it applies may
        have gone to an index that has lost the rest."""
        if st.replay is not None:
            st.resync_at = time.monotonic() + 0.5
            return
        st.resync_at = None
        if self._clear(st):
            st.expected = None
            st.recent.clear()
            if st.spec.replay_endpoint is not None and st.stats.connected:
                self._begin_replay(st, "sync")

    def _purge_worker(self, worker: Worker, why: str) -> None:
        st = self._streams.get(worker)
        if st is None:
            return
        log.warning("kv events %s purged from the index: %s", _name(st), why)
        self._count(st, "purges")
        self._clear(st)
        st.stats.dead = True
        st.expected = None
        st.stats.last_seq = None  # /debug/backends must not report a dead incarnation's progress
        st.recent.clear()
        st.replay = None
        self._close_dealer(st)

    def _malformed(self, st: _Stream, why: str) -> None:
        """Count a skipped message; log it unless this stream logged one within
        :data:`WARN_EVERY_S` (a forged publisher once filled the log with 1,539 lines)."""
        self._count(st, "malformed")
        more = st.malformed_log.due()
        if more is not None:
            log.warning("kv events %s: malformed message skipped: %s%s", _name(st), why, more)

    def _index_failed(self, st: _Stream, what: str, e: Exception) -> None:
        """Counted every time; logged once per outage."""
        self._count(st, "index_errors")
        self._outage.failed(st.spec.worker, "kv events %s: %s (%s: %s); logged once until the index takes writes "
                            "again", _name(st), what, type(e).__name__, e)

    def _count(self, st: _Stream, what: str) -> None:
        setattr(st.stats, what, getattr(st.stats, what) + 1)
        getattr(self._metrics, what).labels(*st.labels).inc()


def _unique(specs: list[StreamSpec]) -> list[StreamSpec]:
    seen: dict[Worker, StreamSpec] = {}
    for s in specs:
        if s.worker in seen and seen[s.worker] != s:
            raise ValueError(f"two event streams for worker {s.worker}")
        seen[s.worker] = s
    return list(seen.values())


def bound_batch(batch: EventBatch, media: set[str], caps: KeyCaps, worker: Worker) -> tuple[EventBatch, int]:
    """``batch`` without what the caps would drop anyway, and how many keys that is: stores
    into a tier beyond :data:`MAX_MEDIA_PER_WORKER` (``media``: the tiers ``worker`` stored
    into since it was last cleared, updated here), the blocks of a stored event past its
    first ``cap`` (the index would drop them; cut here, the verifier never walks them), and
    the batch's stored blocks past :data:`MAX_BATCH_BLOCKS`. The batch itself when nothing
    is dropped, the common case."""
    events: list[Any] | None = None
    dropped = 0
    room = MAX_BATCH_BLOCKS
    for i, ev in enumerate(batch.events):
        if type(ev) is AllBlocksCleared:
            media.clear()
        elif type(ev) is BlockStored:  # any KV-cache group: the verifier walks them all
            medium = ev.medium or DEFAULT_MEDIUM
            n = len(ev.block_hashes)
            if medium not in media and len(media) >= MAX_MEDIA_PER_WORKER:
                keep = 0
            else:
                media.add(medium)
                keep = min(n, caps.cap(worker, medium), room)
            room -= keep
            if keep < n:
                dropped += n - keep
                if events is None:
                    events = list(batch.events[:i])
                if keep:
                    events.append(_first_blocks(ev, keep))
                continue
        if events is not None:
            events.append(ev)
    if events is None:
        return batch, 0
    return EventBatch(batch.ts, events, batch.data_parallel_rank), dropped


def _first_blocks(ev: BlockStored, n: int) -> BlockStored:
    """``ev`` cut to its first ``n`` blocks: the head of its chain, still chained to its parent."""
    b = ev.block_size
    tokens = ev.token_ids[: n * b] if len(ev.token_ids) == len(ev.block_hashes) * b else []
    extra = ev.extra_keys[:n] if isinstance(ev.extra_keys, list) else ev.extra_keys
    return msgspec.structs.replace(ev, block_hashes=ev.block_hashes[:n], token_ids=tokens, extra_keys=extra)


def _name(st: _Stream) -> str:
    w = st.spec.worker
    return f"{w.backend}[{w.dp_rank}]"

