"""``kvrouter sim``: run K simulated vLLM engines (HTTP surface + KV events) in one process."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from indexer.hashing import BlockHasher, HashConfigError
from loadtest.sim.block_manager import reuses_uncached_first
from loadtest.sim.engine import EngineConfig
from loadtest.sim.fleet import FleetSettings, instance_specs, run_fleet
from loadtest.sim.latency import LatencyModel


def latency_from_args(args: argparse.Namespace) -> LatencyModel:
    return LatencyModel(
        step_overhead_s=args.step_overhead_ms / 1e3,
        prefill_s_per_token=args.prefill_us_per_token / 1e6,
        decode_s_per_seq=args.decode_us_per_seq / 1e6,
        kv_read_s_per_block=args.kv_read_us_per_block / 1e6,
        cpu_load_s_per_block=args.cpu_load_us_per_block / 1e6,
    )


def configure(p: argparse.ArgumentParser) -> None:
    d = LatencyModel()
    e = EngineConfig()
    p.add_argument("--host", default="127.0.0.1", help="bind address for HTTP and ZMQ (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port of engine 0; engine i uses port+i")
    p.add_argument("--model", required=True, help="served model name")
    p.add_argument("--tokenizer", required=True, help="tokenizer directory or hub id")
    p.add_argument("--kv-events-port", type=int, default=None, help="ZMQ PUB port of engine 0 (omit: no events)")
    p.add_argument("--replay-port", type=int, default=None, help="ZMQ replay ROUTER port of engine 0")
    p.add_argument("--kv-topic", default="", help="topic frame of every event message (vLLM's default: empty)")
    p.add_argument("--replay-buffer-steps", type=int, default=10_000, help="batches kept for replay (vLLM buffer_steps)")
    p.add_argument("--instances", type=int, default=1, help="number of engines (default 1)")
    p.add_argument("--num-blocks", type=int, default=e.num_blocks, help=f"KV blocks per engine incl. the null block (default {e.num_blocks})")
    p.add_argument("--block-size", type=int, default=e.block_size)
    p.add_argument("--cpu-offload-blocks", type=int, default=e.cpu_offload_blocks,
                   help="blocks of a CPU offload tier per engine, like vLLM's native KV offloading "
                        "(write-through, LRU, events with medium CPU; default 0: none)")
    p.add_argument("--hash-algo", default="sha256", choices=["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"])
    p.add_argument("--hash-seed", default=None, help="the engines' PYTHONHASHSEED (default: unset)")
    p.add_argument("--vllm-version", default="0.33.0", help="vLLM version whose hashing and event wire to copy")
    hashes = p.add_mutually_exclusive_group()
    hashes.add_argument("--int-block-hashes", dest="int_hashes", action="store_true", default=None,
                        help="send 64-bit int hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1, the default)")
    hashes.add_argument("--bytes-block-hashes", dest="int_hashes", action="store_false",
                        help="send full digest bytes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)")
    p.add_argument("--speedup", type=float, default=1.0, help="run engine time X times faster than wall time")
    p.add_argument("--max-num-batched-tokens", type=int, default=e.max_num_batched_tokens)
    p.add_argument("--max-num-seqs", type=int, default=e.max_num_seqs)
    p.add_argument("--max-model-len", type=int, default=e.max_model_len)
    p.add_argument("--step-overhead-ms", type=float, default=d.step_overhead_s * 1e3, help="latency model a")
    p.add_argument("--prefill-us-per-token", type=float, default=d.prefill_s_per_token * 1e6, help="latency model b")
    p.add_argument("--decode-us-per-seq", type=float, default=d.decode_s_per_seq * 1e6, help="latency model c")
    p.add_argument("--kv-read-us-per-block", type=float, default=d.kv_read_s_per_block * 1e6, help="latency model d")
    p.add_argument("--cpu-load-us-per-block", type=float, default=d.cpu_load_s_per_block * 1e6,
                   help="latency model e: CPU -> GPU load of one block (default: 2 MiB over ~25 GB/s PCIe)")
    p.add_argument("--mean-output-tokens", type=float, default=128.0, help="mean natural output length")
    p.add_argument("--seed", type=int, default=0, help="seed for sampling and fault injection")
    p.add_argument("--fault-drop-events", type=float, default=0.0, help="fraction of event messages to drop")
    p.add_argument("--fault-error-rate", type=float, default=0.0, help="fraction of requests answered 500")
    p.add_argument("--fault-extra-latency", type=float, default=0.0, help="wall seconds added to each request")
    p.add_argument("--debug-state", action="store_true",
                   help="serve POST /debug/state: each engine's exact state and predicted TTFT for a prompt, the side "
                        "channel of kvrouter bench's oracle policy (a real vLLM has none)")
    p.add_argument("--world-clock", metavar="PATH",
                   help="keep engine time by the world clock in PATH, which the oracle stops while it asks /debug/state "
                        "(kvrouter bench sets it; loadtest/sim/world_clock.py)")
    p.add_argument("--log-level", default="warning")


def _int_hashes(flag: bool | None) -> bool:
    if flag is not None:
        return flag
    return os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1") not in ("0", "false", "False")


def _check(args: argparse.Namespace) -> str | None:
    positive = ("instances", "num_blocks", "block_size", "max_num_batched_tokens", "max_num_seqs", "max_model_len", "speedup")
    for name in positive:
        if getattr(args, name) <= 0:
            return f"--{name.replace('_', '-')} must be positive"
    for name in ("fault_drop_events", "fault_error_rate"):
        if not 0.0 <= getattr(args, name) <= 1.0:
            return f"--{name.replace('_', '-')} must be within [0, 1]"
    if args.num_blocks < 2:
        return "--num-blocks must be at least 2"
    nonnegative = ("cpu_offload_blocks", "step_overhead_ms", "prefill_us_per_token", "decode_us_per_seq",
                   "kv_read_us_per_block", "cpu_load_us_per_block")
    for name in nonnegative:
        if getattr(args, name) < 0:
            return f"--{name.replace('_', '-')} must not be negative"
    return None


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    problem = _check(args)
    if problem:
        print(f"kvrouter sim: {problem}", file=sys.stderr)
        return 2
    try:
        hasher = BlockHasher(args.hash_algo, args.block_size, args.hash_seed, args.vllm_version)
    except HashConfigError as e:
        print(f"kvrouter sim: {e}", file=sys.stderr)
        return 2
    from router.prompt.prompt_fields import TokenizeError
    from router.prompt.tokenize import load_tokenizer

    try:
        tokenizer = load_tokenizer(args.tokenizer)
    except TokenizeError as e:
        print(f"kvrouter sim: {e}", file=sys.stderr)
        return 2
    pool_tokens = (args.num_blocks - 1) * args.block_size
    max_model_len = min(args.max_model_len, pool_tokens)
    if max_model_len < args.max_model_len:
        logging.warning("max_model_len %d does not fit %d blocks; using %d", args.max_model_len, args.num_blocks, max_model_len)
    engine = EngineConfig(
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=max_model_len,
        speedup=args.speedup,
        cpu_offload_blocks=args.cpu_offload_blocks,
        uncached_first=reuses_uncached_first(args.vllm_version),
        latency=latency_from_args(args),
    )
    settings = FleetSettings(
        model_name=args.model,
        tokenizer_path=args.tokenizer,
        vllm_version=args.vllm_version,
        int_hashes=_int_hashes(args.int_hashes),
        kv_topic=args.kv_topic.encode(),
        buffer_steps=args.replay_buffer_steps,
        engine=engine,
        drop_event_fraction=args.fault_drop_events,
        error_rate=args.fault_error_rate,
        extra_latency_s=args.fault_extra_latency,
        seed=args.seed,
        mean_output_tokens=args.mean_output_tokens,
        debug_state=args.debug_state,
        world_clock=args.world_clock,
    )
    zmq_host = "*" if args.host in ("0.0.0.0", "::") else args.host
    specs = instance_specs(args.host, zmq_host, args.port, args.kv_events_port, args.replay_port, args.instances)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await run_fleet(specs, settings, tokenizer, hasher, stop)

    try:
        asyncio.run(main())
    except OSError as e:
        print(f"kvrouter sim: {e}", file=sys.stderr)
        return 1
    return 0
