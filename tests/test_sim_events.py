"""The simulator's KV events: frames the indexer decodes, replay over DEALER, and an index they keep exact."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import zmq

from indexer.events import (
    BlockRemoved,
    BlockStored,
    build_replay_request,
    decode_batch,
    parse_pub_frames,
    parse_replay_reply,
)
from indexer.hashing import BlockHasher, to_int64
from support import indexed_sim, random_conversations, sub_socket

MODEL = "qwen3"


def _collect(sock: zmq.Socket, idle_ms: int = 1000) -> list[tuple[bytes, int, bytes]]:
    out = []
    while sock.poll(idle_ms):
        out.append(parse_pub_frames(sock.recv_multipart()))
    return out


def _complete(base: str, ids: list[int], max_tokens: int = 20) -> dict:
    body = {"model": MODEL, "prompt": ids, "max_tokens": max_tokens, "ignore_eos": True}
    r = httpx.post(base + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("version", ["0.33.0", "0.22.0", "0.11.0"])
def test_published_frames_decode_and_chain_like_vllm(sim_fleet, version: str) -> None:
    sim = sim_fleet("--speedup", "20", "--vllm-version", version, "--hash-seed", "0", "--kv-topic", "kv@sim")
    sub = sub_socket(sim.kv())
    prompt = list(range(500, 500 + 40))
    _complete(sim.http(), prompt, max_tokens=20)
    msgs = _collect(sub)
    sub.close()
    assert [seq for _, seq, _ in msgs] == list(range(len(msgs)))
    assert all(topic == b"kv@sim" for topic, _, _ in msgs)
    stored = [e for _, _, p in msgs for e in decode_batch(p).events if isinstance(e, BlockStored)]
    generated_block = stored[-1].token_ids
    assert generated_block[:8] == prompt[32:]
    expected = BlockHasher("sha256", 16, "0", version).hash_blocks(prompt + generated_block[8:])
    assert [h for e in stored for h in e.block_hashes] == [to_int64(d) for d in expected]
    assert stored[0].parent_block_hash is None and stored[1].parent_block_hash == stored[0].block_hashes[-1]
    assert stored[0].token_ids == prompt[:32] and stored[0].medium == "GPU" and stored[0].block_size == 16
    if version >= "0.22":
        assert stored[0].extra_keys == [None, None] and stored[0].group_idx == 0
        assert stored[0].kv_cache_spec_kind == "full_attention"
    cache = httpx.get(sim.http() + "/debug/cache").json()["block_hashes_int64"]
    assert cache == sorted(to_int64(d) for d in expected)


def test_bytes_hashes_and_replay_over_dealer(sim_fleet) -> None:
    sim = sim_fleet("--speedup", "20", "--bytes-block-hashes", "--vllm-version", "0.28.0", "--hash-seed", "0")
    sub = sub_socket(sim.kv())
    for i in range(3):
        _complete(sim.http(), list(range(1000 * i, 1000 * i + 50)), max_tokens=3)
    live = _collect(sub)
    sub.close()
    assert len(live) >= 3
    first = decode_batch(live[0][2]).events[0]
    assert isinstance(first, BlockStored) and all(isinstance(h, bytes) and len(h) == 32 for h in first.block_hashes)
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(sim.replay())
    dealer.send_multipart(build_replay_request(1))
    replayed = []
    while dealer.poll(5000):
        reply = parse_replay_reply(dealer.recv_multipart())
        if reply is None:
            break
        replayed.append(reply)
    dealer.close()
    assert replayed == [(seq, payload) for _, seq, payload in live[1:]]


def test_index_fed_by_events_equals_engine_caches_after_10_simulated_minutes(sim_fleet) -> None:
    """Random multi-turn traffic with heavy eviction on 2 engines, 10 engine-minutes at 10x speedup.

    No prompt repeats exactly: vLLM recomputes the last block of a fully cached prompt
    into a *second* block with the same hash (and publishes it again), and an index with
    set semantics loses such a hash when either copy is evicted. The engine reports
    those copies as ``duplicate_blocks``; this test keeps them at 0.
    """
    speedup, instances = 10.0, 2
    sim = sim_fleet("--speedup", str(speedup), "--num-blocks", "300", "--mean-output-tokens", "24",
                    "--hash-seed", "0", instances=instances)
    with indexed_sim(sim, MODEL) as (index, workers, monitor):
        asyncio.run(random_conversations(sim, MODEL, 600 / speedup, seed=7, max_tokens=48, mean_gap_s=0.125))
        removed = sum(
            isinstance(e, BlockRemoved) for _, _, p in _collect(monitor, idle_ms=200) for e in decode_batch(p).events
        )
        time.sleep(1.0)
        for i, worker in enumerate(workers):
            cache = httpx.get(sim.http(i) + "/debug/cache").json()
            assert cache["duplicate_blocks"] == 0, "workload must not create duplicate blocks (see docstring)"
            held = set(cache["block_hashes_int64"])
            assert index.block_counts(MODEL).get(worker, 0) == len(held)
            assert all(asyncio.run(index.lookup(MODEL, [k])).get(worker) for k in held)
        assert removed > 100, "the workload must evict"
