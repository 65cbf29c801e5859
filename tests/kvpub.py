"""A vLLM-shaped KV-event publisher for tests: PUB frames, replay ROUTER, and a lossy relay.

:class:`EnginePublisher` speaks exactly what ``ZmqEventPublisher`` speaks: 3-frame PUB
messages ``[topic, seq, payload]`` numbered from 0, and a ROUTER that answers
``[b"", start_seq]`` with every buffered message ``>= start_seq`` then the end marker,
framed like the given vLLM version (the framing helpers of :mod:`indexer.events`). It
binds an XPUB, which is PUB on the wire but also reports subscriptions, so a test can
wait until the subscriber is really listening instead of sleeping.

:class:`LossyRelay` sits between the publisher and the subscriber and drops a seeded
random share of messages, like PUB does when a subscriber's queue is full.
"""

from __future__ import annotations

import random
import threading
from collections import deque

import zmq

from indexer.events import build_pub_frames, build_replay_end, build_replay_reply, parse_replay_request
from support import free_port


def wait_subscription(sock: zmq.Socket, timeout: float) -> None:
    """Block until an XPUB socket reports a subscribe message (``b"\\x01" + topic``)."""
    if not sock.poll(int(timeout * 1000)):
        raise TimeoutError(f"no subscriber within {timeout}s")
    msg = sock.recv()
    if not msg.startswith(b"\x01"):
        raise AssertionError(f"unexpected XPUB message {msg!r}")


class EnginePublisher:
    """One engine's event publisher on loopback, with an optional replay socket."""

    def __init__(
        self,
        *,
        port: int | None = None,
        replay_port: int | None = None,
        replay: bool = True,
        topic: bytes = b"kv-events",
        vllm_version: str = "0.33.0",
        buffer_steps: int = 10_000,
        replay_sndhwm: int | None = None,
    ) -> None:
        self.ctx = zmq.Context()
        self.topic = topic
        self.vllm_version = vllm_version
        self.port = port or free_port()
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, 0)
        self.pub.bind(f"tcp://127.0.0.1:{self.port}")
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.replay_port: int | None = None
        self.replay_requests: list[int] = []
        if replay:
            self.replay_port = replay_port or free_port()
            self._router = self.ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            if replay_sndhwm is not None:  # vLLM leaves ZMQ's default, 1000: a ROUTER drops past it
                self._router.setsockopt(zmq.SNDHWM, replay_sndhwm)
            self._router.bind(f"tcp://127.0.0.1:{self.replay_port}")
            self._thread = threading.Thread(target=self._serve_replay, daemon=True)
            self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def replay_endpoint(self) -> str | None:
        return None if self.replay_port is None else f"tcp://127.0.0.1:{self.replay_port}"

    def wait_subscribed(self, timeout: float = 10.0) -> None:
        wait_subscription(self.pub, timeout)

    def publish(self, payload: bytes, *, send: bool = True) -> int:
        """Buffer ``payload`` under the next seq and send it (``send=False``: buffer only,
        as if PUB dropped it). Returns its seq."""
        with self._lock:
            seq = self.seq
            self.seq += 1
            self.buffer.append((seq, payload))
        if send:
            self.pub.send_multipart(build_pub_frames(self.topic, seq, payload))
        return seq

    def send_raw(self, frames: list[bytes]) -> None:
        self.pub.send_multipart(frames)

    def forget_history(self) -> None:
        """Drop the replay buffer, as if it had rolled over."""
        with self._lock:
            self.buffer.clear()

    def _serve_replay(self) -> None:
        while not self._stop.is_set():
            if not self._router.poll(50):
                continue
            identity, *rest = self._router.recv_multipart()
            start = parse_replay_request(rest)
            self.replay_requests.append(start)
            with self._lock:
                items = [(s, p) for s, p in self.buffer if s >= start]
            for seq, payload in items:
                self._router.send_multipart([identity, *build_replay_reply(seq, payload, self.topic, self.vllm_version)])
            self._router.send_multipart([identity, *build_replay_end(self.vllm_version)])

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            self._router.close(0)
        self.pub.close(0)
        self.ctx.term()


class LossyRelay:
    """Forwards PUB messages from ``upstream`` to its own port, dropping ``drop`` of them."""

    def __init__(self, upstream: str, drop: float, seed: int = 7) -> None:
        self.ctx = zmq.Context()
        self.port = free_port()
        self.rng = random.Random(seed)
        self.drop = drop
        self.dropped: list[int] = []
        self.forwarded = 0
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(upstream)
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(f"tcp://127.0.0.1:{self.port}")
        self.subscribed = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sub, zmq.POLLIN)
        poller.register(self.pub, zmq.POLLIN)
        while not self._stop.is_set():
            for sock, _ in poller.poll(50):
                if sock is self.pub:
                    if self.pub.recv().startswith(b"\x01"):
                        self.subscribed.set()
                    continue
                frames = self.sub.recv_multipart()
                if self.rng.random() < self.drop:
                    self.dropped.append(int.from_bytes(frames[1], "big"))
                else:
                    self.forwarded += 1
                    self.pub.send_multipart(frames)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sub.close(0)
        self.pub.close(0)
        self.ctx.term()
