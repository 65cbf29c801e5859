"""KV events on the wire: a ZMQ PUB socket and the replay ROUTER, as vLLM's ZmqEventPublisher.

One message per scheduler step that produced events: ``[topic, seq (8-byte big-endian,
from 0), payload]``, the payload encoded for ``vllm_version`` by
:func:`indexer.events.encode_batch`, so the bytes are what that vLLM would send. Hashes
go out as the low 64 bits (unsigned int) of the digest, or as the full digest bytes
with ``int_hashes=False`` (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``). Events carry
their record's ``medium`` (``"GPU"``, or ``"CPU"`` for the offload tier), and, like the real block manager of 0.22+, a per-block ``extra_keys``
list, ``group_idx=0`` and ``kv_cache_spec_kind="full_attention"`` (older versions'
encoders drop fields they did not have).

The replay socket keeps the last ``buffer_steps`` messages; a DEALER sending
``[b"", start_seq]`` gets every buffered message with ``seq >= start_seq`` and then the
end marker, framed per version (VLLM_FACTS §3).
"""

from __future__ import annotations

import logging
import time
from collections import deque

import zmq
import zmq.asyncio

from indexer.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventDecodeError,
    build_pub_frames,
    build_replay_end,
    build_replay_reply,
    encode_batch,
    parse_replay_request,
)
from indexer.hashing import to_int64
from loadtest.sim.block_manager import CacheRecord, ClearedRecord, RemovedRecord, StoredRecord
from loadtest.sim.faults import Faults

log = logging.getLogger(__name__)


def to_batch(records: list[CacheRecord], ts: float, block_size: int, int_hashes: bool, dp_rank: int = 0) -> EventBatch:
    """The wire events of one step's cache records (vLLM's field values)."""
    conv = to_int64 if int_hashes else bytes
    events: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
    for rec in records:
        if isinstance(rec, StoredRecord):
            events.append(
                BlockStored(
                    block_hashes=[conv(h) for h in rec.block_hashes],
                    parent_block_hash=None if rec.parent is None else conv(rec.parent),
                    token_ids=rec.token_ids,
                    block_size=block_size,
                    lora_id=rec.lora_id,
                    medium=rec.medium,
                    lora_name=rec.lora_name,
                    extra_keys=rec.extra_keys,
                    group_idx=0,
                    kv_cache_spec_kind="full_attention",
                )
            )
        elif isinstance(rec, RemovedRecord):
            events.append(BlockRemoved(block_hashes=[conv(rec.block_hash)], medium=rec.medium, group_idx=0))
        elif isinstance(rec, ClearedRecord):
            events.append(AllBlocksCleared())
    return EventBatch(ts=ts, events=events, data_parallel_rank=dp_rank)


class EventPublisher:
    """PUB + replay ROUTER of one engine. ``publish`` never blocks (PUB drops at the HWM)."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        pub_endpoint: str,
        replay_endpoint: str | None,
        *,
        topic: bytes,
        vllm_version: str,
        block_size: int,
        int_hashes: bool = True,
        dp_rank: int = 0,
        buffer_steps: int = 10_000,
        faults: Faults | None = None,
    ) -> None:
        self.topic = topic
        self.vllm_version = vllm_version
        self.block_size = block_size
        self.int_hashes = int_hashes
        self.dp_rank = dp_rank
        self.faults = faults or Faults()
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.dropped = 0
        # A plain (blocking-API) socket: a PUB send never blocks, and publishing from the
        # step loop must not allocate a future per message.
        self.pub = zmq.Context.instance().socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, 100_000)
        self.pub.bind(pub_endpoint)
        self.replay: zmq.asyncio.Socket | None = None
        if replay_endpoint:
            self.replay = ctx.socket(zmq.ROUTER)
            self.replay.setsockopt(zmq.LINGER, 0)
            self.replay.bind(replay_endpoint)

    def publish(self, records: list[CacheRecord], ts: float | None = None) -> int:
        """Encode and send one step's records as one message; returns its seq."""
        batch = to_batch(records, time.time() if ts is None else ts, self.block_size, self.int_hashes, self.dp_rank)
        payload = encode_batch(batch, self.vllm_version)
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, payload))
        if self.faults.drop_event():
            self.dropped += 1
        else:
            try:
                self.pub.send_multipart(build_pub_frames(self.topic, seq, payload), flags=zmq.NOBLOCK)
            except zmq.Again:
                self.dropped += 1
        return seq

    async def serve_replay(self) -> None:
        """Answer replay requests until cancelled; malformed requests are logged and ignored."""
        sock = self.replay
        if sock is None:
            return
        while True:
            frames = await sock.recv_multipart()
            identity, rest = frames[0], frames[1:]
            try:
                start = parse_replay_request(rest)
            except EventDecodeError as e:
                log.warning("ignoring malformed replay request: %s", e)
                continue
            for seq, payload in list(self.buffer):
                if seq >= start:
                    await sock.send_multipart([identity, *build_replay_reply(seq, payload, self.topic, self.vllm_version)])
            await sock.send_multipart([identity, *build_replay_end(self.vllm_version)])

    def close(self) -> None:
        self.pub.close(0)
        if self.replay is not None:
            self.replay.close(0)
