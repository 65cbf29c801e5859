"""A forged KV-event flood on one engine's stream, a clean engine beside it: what it costs the router.

KV-event sockets are unauthenticated, so whoever reaches one can publish well-formed
batches of made-up block keys. This starts two loopback publishers (``tests/kvpub.py``)
and one ``FleetSubscriber`` over a ``MemoryIndex`` with hash verification on, as the
router runs them; engine-0 floods ``--keys`` made-up keys in batches of ``--per``, and
engine-1 publishes one real block every 50 ms while the flood is applied. Each case runs
in its own process (so that RSS is its own):

* ``capped``: engine-0's capacity known (``--capacity`` blocks, as the router's scrape
  reads it off ``vllm:cache_config_info``), the caps and the per-stream turn budget on;
* ``default``: the same before the capacity is known (the default bound);
* ``uncapped``: the caps, the per-batch block bound and the turn budget off, as the
  subscriber was without them.

Prints per case: keys engine-0 holds, keys dropped, the flood's ingest rate, engine-1's
lag (sent to applied: median and max), and RSS before and after.

    .venv/bin/python benchmarks/bench_flood.py [--keys 5000000] [--per 50000] [--capacity 50000]
    .venv/bin/python benchmarks/bench_flood.py --keys 1800000 --per 1800000   # one 16 MiB batch
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CASES = ("capped", "default", "uncapped")


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
    return 0.0


def run_case(case: str, keys: int, per: int, capacity: int) -> dict[str, float]:
    sys.path.insert(0, str(REPO / "tests"))
    from prometheus_client import CollectorRegistry

    import indexer.subscriber as subscriber
    from indexer.events import BlockStored, EventBatch, encode_batch
    from indexer.hashing import BlockHasher
    from indexer.index import KeyCaps, MemoryIndex, Worker
    from indexer.verify import SETTLE_AFTER, HashVerifier
    from kvpub import EnginePublisher

    w0, w1, model, base = Worker("engine-0"), Worker("engine-1"), "m", 1 << 40
    n = keys // per
    flood = [encode_batch(EventBatch(1.0, [BlockStored(list(range(base + i * per, base + (i + 1) * per)), None, [], 16,
                                                       None, "GPU")], 0), "0.33.0") for i in range(n)]
    caps = KeyCaps(default_blocks=1 << 40) if case == "uncapped" else KeyCaps()
    if case == "capped":
        caps.set_capacity(w0, {"GPU": capacity})
    if case == "uncapped":
        subscriber.TURN_BYTES = subscriber.MAX_BATCH_BLOCKS = 1 << 40
    index = MemoryIndex(caps)
    hasher = BlockHasher("sha256", 16, "0", "0.33.0")
    verifier = HashVerifier(hasher, settle_after=SETTLE_AFTER, caps=caps)
    a, b = EnginePublisher(), EnginePublisher()
    specs = [subscriber.StreamSpec(model, w, p.endpoint, p.replay_endpoint, topic=p.topic.decode())
             for w, p in ((w0, a), (w1, b))]
    sub = subscriber.FleetSubscriber(index, specs, verifiers={model: verifier}, metrics_registry=CollectorRegistry())
    sub.start()
    try:
        a.wait_subscribed()
        b.wait_subscribed()
        rss0 = rss_mb()
        t0 = time.monotonic()
        for payload in flood:
            a.publish(payload)
        lags: list[float] = []
        while sub.stats()[w0].batches < n:
            tokens = list(range(16 * len(lags), 16 * (len(lags) + 1)))
            b.publish(encode_batch(EventBatch(1.0, [BlockStored(hasher.hash_blocks_int64(tokens), None, tokens, 16, None,
                                                                "GPU")], 0), "0.33.0"))
            sent = time.monotonic()
            while index.block_counts(model).get(w1, 0) <= len(lags) and time.monotonic() - sent < 120:
                time.sleep(0.002)
            lags.append(time.monotonic() - sent)
            time.sleep(0.05)
        elapsed = time.monotonic() - t0
        st = sub.stats()[w0]
        lags.sort()
        return {"held": st.blocks, "capped": st.capped, "keys_per_s": keys / elapsed,
                "lag_median_ms": 1000 * lags[len(lags) // 2], "lag_max_ms": 1000 * lags[-1],
                "rss_before_mb": rss0, "rss_after_mb": rss_mb()}
    finally:
        sub.stop()
        a.close()
        b.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--keys", type=int, default=5_000_000)
    p.add_argument("--per", type=int, default=50_000, help="keys per batch (50,000: 450 KB, under MAX_EVENT_BYTES)")
    p.add_argument("--capacity", type=int, default=50_000, help="engine-0's KV-cache capacity in blocks (case capped)")
    p.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case, args.keys, args.per, args.capacity)))
        return
    print(f"{args.keys:,} forged keys in batches of {args.per:,}; engine-0's capacity {args.capacity:,} blocks (capped)")
    print(f"{'case':9} {'held':>10} {'dropped':>10} {'keys/s':>9} {'lag p50':>8} {'lag max':>8} {'RSS MB':>11}")
    for case in CASES:
        out = subprocess.run([sys.executable, __file__, "--case", case, "--keys", str(args.keys), "--per", str(args.per),
                              "--capacity", str(args.capacity)], capture_output=True, text=True, cwd=REPO, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{case:9} {r['held']:>10,} {r['capped']:>10,} {r['keys_per_s']:>9,.0f} {r['lag_median_ms']:>6.0f}ms "
              f"{r['lag_max_ms']:>6.0f}ms {r['rss_before_mb']:>4.0f}->{r['rss_after_mb']:<5.0f}")


if __name__ == "__main__":
    main()
