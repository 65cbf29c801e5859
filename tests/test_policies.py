"""Routing policies, the kv_aware cost, the router's prefix memory and load tickets.

These run the real policy objects on real :class:`BackendLoad` state (no fakes: a
policy's whole input is this data). End-to-end routing through the router process is
in test_router_e2e.py.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from kvconfig import KvAwareWeights
from router.fleet.load import BackendLoad, LoadTracker
from router.fleet.scrape import parse_vllm_metrics
from router.policies.approx_index import STRIDE, ApproxPrefixIndex
from router.policies.base import UNROUTABLE, Candidate, RequestCtx
from router.policies.kv_aware import KvAware
from router.policies.least_loaded import LeastLoaded
from router.policies.power_of_two import PowerOfTwo
from router.policies.prefix_approx import PrefixApprox
from router.policies.random import RandomPolicy
from router.policies.round_robin import RoundRobin
from router.policies.session import SessionAffinity
from router.tuning import KvAwareTuning

BS = 16


def ctx(n_tokens: int = 64, keys: list[int] | None = None, session: str | None = None, events: bool = True) -> RequestCtx:
    keys = keys if keys is not None else list(range(1, n_tokens // BS + 1))
    return RequestCtx("m", n_tokens, BS, keys, session, events)


def fleet(n: int = 4, unhealthy: tuple[int, ...] = ()) -> list[Candidate]:
    return [Candidate(f"b{i}", i not in unhealthy, BackendLoad(f"b{i}")) for i in range(n)]


def test_round_robin_cycles_and_skips_unhealthy() -> None:
    p = RoundRobin()
    picks = []
    for _ in range(6):
        cands = fleet(3, unhealthy=(1,))
        d = p.choose(ctx(), cands)
        p.commit(ctx(), d)
        picks.append(d.backend)
        assert cands[1].score == UNROUTABLE
    assert set(picks) == {"b0", "b2"}
    assert "b1" not in picks


def test_random_spreads_over_healthy_backends() -> None:
    p = RandomPolicy(random.Random(1))
    seen = Counter(p.choose(ctx(), fleet(4, unhealthy=(3,))).backend for _ in range(400))
    assert set(seen) == {"b0", "b1", "b2"}
    assert min(seen.values()) > 80


def test_least_loaded_picks_fewest_in_flight_tokens() -> None:
    cands = fleet(3)
    cands[0].load.prefill_tokens = 500
    cands[1].load.prefill_tokens = 10
    cands[2].load.block_refs = {k: 1 for k in range(20)}  # 320 tokens of running KV
    assert LeastLoaded().choose(ctx(), cands).backend == "b1"


def test_power_of_two_never_picks_the_more_loaded_of_its_pair() -> None:
    p = PowerOfTwo(random.Random(3))
    for _ in range(100):
        cands = fleet(2)
        cands[0].load.in_flight = 5
        assert p.choose(ctx(), cands).backend == "b1"


def test_session_is_sticky_and_moves_only_the_lost_backends_sessions() -> None:
    p = SessionAffinity()
    before = {s: p.choose(ctx(session=s), fleet(4)).backend for s in (f"user-{i}" for i in range(200))}
    assert len(set(before.values())) == 4
    after = {s: p.choose(ctx(session=s), fleet(4, unhealthy=(2,))).backend for s in before}
    for s, b in before.items():
        if b != "b2":
            assert after[s] == b
        else:
            assert after[s] != "b2"
    assert p.choose(ctx(session=None), fleet(4)).reason == "no_session_key"


def test_approx_index_matches_leading_blocks_until_ttl() -> None:
    now = [0.0]
    idx = ApproxPrefixIndex(ttl_s=10.0, max_blocks=100, clock=lambda: now[0])
    idx.insert([1, 2, 3, 4], "a")
    idx.insert([1, 2, 9], "b")
    # "a" sent all of [1, 2, 3, 4]; "b" left it inside a stride, where only its first key
    # is stored: rounded down (see the module docstring).
    assert idx.match([1, 2, 3, 4, 5]) == {"a": 4, "b": 1}
    assert idx.match([1, 2, 9, 7]) == {"a": 1, "b": 3}
    assert idx.match([5, 1]) == {}
    now[0] = 11.0
    assert idx.match([1, 2, 3]) == {}


def test_a_prompt_under_one_block_is_routed_and_remembered_as_nothing() -> None:
    """No full block, no keys: kv_aware still decides and its commit stores nothing (a fold
    once made this an IndexError, a 500 for every short prompt)."""
    idx = ApproxPrefixIndex(ttl_s=10.0, max_blocks=100)
    idx.insert([], "a")
    assert len(idx) == 0 and idx.match([]) == {}


def test_approx_index_is_bounded() -> None:
    idx = ApproxPrefixIndex(ttl_s=100.0, max_blocks=10)
    idx.insert(list(range(1, 500)), "a")
    assert len(idx) == 10


def test_prefix_approx_follows_its_own_decisions() -> None:
    p = PrefixApprox(ApproxPrefixIndex(60.0, 10_000))
    c = ctx(160)
    first = p.choose(c, fleet(4))
    p.commit(c, first)
    again = p.choose(ctx(176, keys=c.keys + [99]), fleet(4))
    assert again.backend == first.backend
    assert again.reason == "approx_hit"


def test_prefix_approx_load_guard_moves_overloaded_hits() -> None:
    p = PrefixApprox(ApproxPrefixIndex(60.0, 10_000), KvAwareTuning(imbalance_ratio=1.25, imbalance_slack=2))
    c = ctx(160)
    p.commit(c, p.choose(c, fleet(2)))
    chosen = p.choose(c, fleet(2)).backend
    cands = fleet(2)
    next(x for x in cands if x.backend == chosen).load.in_flight = 10
    d = p.choose(c, cands)
    assert d.reason == "load_guard" and d.backend != chosen


def kv_aware(weights: KvAwareWeights, max_blocks: int, rng: random.Random | None = None,
             tuning: KvAwareTuning | None = None) -> KvAware:
    """kv_aware with a prefix memory of its own (a lone router process)."""
    tuning = tuning or KvAwareTuning()
    return KvAware(weights, ApproxPrefixIndex(tuning.speculative_ttl_s, max_blocks), tuning, rng)


def kv(**knobs: float) -> KvAware:
    """kv_aware with config weights and lab tuning, each knob where it belongs."""
    tuned = {k: v for k, v in knobs.items() if k in KvAwareTuning.model_fields}
    weights = {k: v for k, v in knobs.items() if k not in tuned}
    return kv_aware(KvAwareWeights(**weights), 100_000, random.Random(7), KvAwareTuning(**tuned))


def test_kv_aware_cost_matches_the_documented_formula() -> None:
    n = 100  # 7 blocks (6 full + a partial)
    cands = fleet(2)
    cands[0].matched_blocks, cands[0].weighted_blocks = 4, 3.0  # 2 GPU + 2 CPU at 0.5
    cands[0].load.prefill_tokens = 32
    cands[0].load.block_refs = {k: 1 for k in range(10)}
    kv(prefill=2.0, decode=0.5).choose(ctx(n, keys=[1, 2, 3, 4, 5, 6]), cands)
    hit = 3.0
    expected0 = 2.0 * ((n - hit * BS) + 32) / BS + 0.5 * (10 + 7 - 4)
    expected1 = 2.0 * n / BS + 0.5 * 7
    assert cands[0].score == pytest.approx(expected0)
    assert cands[1].score == pytest.approx(expected1)


def test_kv_aware_context_term_charges_each_request_its_whole_prompt() -> None:
    n = 100  # 7 blocks
    cands = fleet(2)
    cands[0].load.context_blocks = 40  # e.g. 10 requests sharing a 4-block prefix: 4 unique, 40 read per step
    kv(prefill=1.0, decode=0.0, context=0.5).choose(ctx(n, keys=[1, 2, 3, 4, 5, 6]), cands)
    assert cands[0].score == pytest.approx(n / BS + 0.5 * (40 + 7))
    assert cands[1].score == pytest.approx(n / BS + 0.5 * 7)


def test_kv_aware_caps_the_hit_like_vllm() -> None:
    # A fully cached 64-token prompt: vLLM recomputes the last block (cached = 48).
    cands = fleet(1)
    cands[0].matched_blocks = cands[0].weighted_blocks = 4
    kv().choose(ctx(64), cands)
    assert cands[0].score == pytest.approx((64 - 48) / BS + (0 + 4 - 4))
    assert cands[0].predicted_cached_tokens(64, BS) == 48


def test_kv_aware_prefers_the_cache_and_says_why() -> None:
    cands = fleet(4)
    cands[2].matched_blocks, cands[2].weighted_blocks = 10, 10.0
    d = kv().choose(ctx(200), cands)
    assert (d.backend, d.reason) == ("b2", "cache_hit")


def test_kv_aware_reasons_without_hits() -> None:
    assert kv().choose(ctx(200, events=False), fleet(4)).reason == "no_events"
    assert kv().choose(ctx(200, events=True), fleet(4)).reason == "no_hit"


def test_kv_aware_ties_spread_unrelated_prompts_and_agree_across_processes() -> None:
    """Ties break by the first block key: prompts of different prefixes spread over every
    backend, and two independent deciders (two workers, two replicas) put the same new
    prefix on the same backend."""
    p = kv_aware(KvAwareWeights(), 1000)
    picks = Counter(p.choose(ctx(64, keys=[k, k + 1, k + 2, k + 3]), fleet(4)).backend for k in range(0, 800, 4))
    assert len(picks) == 4 and min(picks.values()) >= 25, picks
    for k in range(0, 400, 4):
        a = kv_aware(KvAwareWeights(), 1000, random.Random(1)).choose(ctx(64, keys=[k, 7, 8, 9]), fleet(4))
        b = kv_aware(KvAwareWeights(), 1000, random.Random(2)).choose(ctx(64, keys=[k, 5, 6]), fleet(4))
        assert a.backend == b.backend, k


def test_kv_aware_load_outweighs_a_small_hit() -> None:
    cands = fleet(2)
    cands[0].matched_blocks = cands[0].weighted_blocks = 1
    cands[0].load.prefill_tokens = 20_000
    d = kv().choose(ctx(200), cands)
    assert (d.backend, d.reason) == ("b1", "load_balance")


def test_speculative_insertion_makes_a_burst_follow_the_first_request() -> None:
    p = kv()
    n = 4096 + 32
    prefix = list(range(1, 257))
    first_ctx = ctx(n, keys=prefix + [10_001, 10_002])
    cands = fleet(4)
    first = p.choose(first_ctx, cands)
    p.commit(first_ctx, first)
    loads = {c.backend: c.load for c in cands}
    tracker_like = loads[first.backend]
    tracker_like.in_flight += 1
    tracker_like.prefill_tokens += n  # the first request is still prefilling
    for i in range(40):
        c = ctx(n, keys=prefix + [20_000 + 2 * i, 20_001 + 2 * i])
        cands = [Candidate(name, True, load) for name, load in loads.items()]
        d = p.choose(c, cands)
        assert d.backend == first.backend, (i, d, [x.score for x in cands])
        assert d.reason == "speculative_hit"
        p.commit(c, d)
        loads[d.backend].in_flight += 1
        loads[d.backend].prefill_tokens += 32


def test_a_followers_cost_is_the_same_before_and_after_events_index_a_prefix_mid_prefill() -> None:
    """vLLM publishes BlockStored for each chunk it computes, before the request's first
    token: a follower sharing the prefix must not be charged the first request's whole
    prefill once the index shows those blocks (it was, when the credit was speculative
    blocks minus indexed ones), or it is sent away from the cache it would share."""
    p = kv()
    tracker = LoadTracker(["b0", "b1"])
    prefix = list(range(1, 257))  # 4096 tokens
    n = 4096 + 32
    first = ctx(n, keys=prefix + [10_001, 10_002])
    p.commit(first, p.choose(first, [Candidate(x, True, tracker.get(x)) for x in ("b0", "b1")]))
    chosen = next(iter(p._speculative_hits(first)))
    other = "b1" if chosen == "b0" else "b0"
    ticket = tracker.acquire(chosen, first.keys, n)  # nothing cached: it prefills all of it
    follower = ctx(n, keys=prefix + [20_001, 20_002])

    def costs(indexed: int) -> tuple[float, float]:
        cands = [Candidate(x, True, tracker.get(x)) for x in (chosen, other)]
        cands[0].matched_blocks = indexed
        cands[0].weighted_blocks = float(indexed)
        d = p.choose(follower, cands)
        assert d.backend == chosen, (indexed, d)
        return cands[0].score, cands[1].score

    before = costs(0)
    for indexed in (64, 200, 256):  # the engine's events for the chunks computed so far
        assert costs(indexed) == pytest.approx(before)
    assert tracker.get(chosen).shared_prefill_blocks(follower.keys, BS) == 256
    ticket.first_token()
    assert tracker.get(chosen).shared_prefill_blocks(follower.keys, BS) == 0
    ticket.release()


def test_shared_prefill_blocks_counts_only_the_uncached_part_once() -> None:
    tracker = LoadTracker(["a"])
    keys = list(range(1, 11))
    t1 = tracker.acquire("a", keys[:8], 4 * BS)  # blocks 0-3 were cached; it prefills 4-7
    t2 = tracker.acquire("a", keys[:6] + [99], 5 * BS)  # prefills 2-6, shares 2-5 with keys
    t3 = tracker.acquire("a", [500, 501, 502], 3 * BS)  # unrelated
    load = tracker.get("a")
    assert load.shared_prefill_blocks(keys, BS) == 6  # blocks 2-7
    assert load.shared_prefill_blocks(keys[:3], BS) == 1  # block 2 (t2's)
    assert load.shared_prefill_blocks([7, 8], BS) == 0
    for t in (t1, t2, t3):
        t.release()
    assert load.shared_prefill_blocks(keys, BS) == 0 and not load.prefilling


def test_a_prefix_shared_by_everything_does_not_take_the_fleet() -> None:
    """Every request shares only the first block (Mooncake): the backend holding it saves one
    block, and the prefill queued there soon outweighs that, so requests spread."""
    p = kv()
    tracker = LoadTracker([f"b{i}" for i in range(4)])
    picks: Counter[str] = Counter()
    tickets = []
    for i in range(200):
        keys = [7, 1000 + i, 2000 + i, 3000 + i]
        cands = [Candidate(b, True, tracker.get(b)) for b in tracker.backends]
        cands[0].matched_blocks = cands[0].weighted_blocks = 1
        q = ctx(4 * BS, keys=keys)
        d = p.choose(q, cands)
        p.commit(q, d)
        picks[d.backend] += 1
        tickets.append(tracker.acquire(d.backend, keys, 4 * BS))
        if len(tickets) > 12:  # a dozen requests prefilling at a time
            tickets.pop(0).release()
    assert len(picks) == 4 and max(picks.values()) < 0.4 * 200, picks


def test_a_long_cached_prefix_stays_on_a_busy_backend() -> None:
    cands = fleet(2)
    cands[0].matched_blocks = cands[0].weighted_blocks = 250
    cands[0].load.in_flight = 50
    d = kv().choose(ctx(4096), cands)
    assert d.backend == "b0" and d.reason == "cache_hit"


def test_softmax_temperature_samples_near_equal_backends() -> None:
    p = kv(temperature=1.0)
    picks = Counter(p.choose(ctx(64), fleet(3)).backend for _ in range(300))
    assert len(picks) == 3


def test_ticket_release_is_idempotent_and_returns_load_to_zero() -> None:
    tracker = LoadTracker(["a"])
    shared = list(range(1, 33))  # a prefix both requests hold once
    t1 = tracker.acquire("a", shared + [100], 100)
    t2 = tracker.acquire("a", shared + [200, 201], 50)
    load = tracker.get("a")
    assert (load.in_flight, load.prefill_tokens, load.active_blocks) == (2, 150, 32 + 1 + 2)
    t1.first_token()
    assert (load.prefill_tokens, load.decode_seqs) == (50, 1)
    assert load.context_blocks == 33 + 34  # per request: the shared prefix counts twice
    t1.release()
    t1.release()
    t2.release()
    assert tracker.idle() and load.context_blocks == 0


def test_ticket_settle_replaces_the_estimate_in_every_phase() -> None:
    tracker = LoadTracker(["a"])
    load = tracker.get("a")
    other = tracker.acquire("a", [1, 2], 32)
    t = tracker.acquire("a", [1], 400)  # a deferred request: block 0 and a length estimate
    assert (load.prefill_tokens, load.active_blocks, load.context_blocks) == (432, 2, 3)
    t.settle([1, 7, 8, 9], 70)
    assert (load.prefill_tokens, load.active_blocks, load.context_blocks) == (102, 5, 6)
    t.first_token()
    t.settle([1, 7, 8, 9], 64)  # after the first token only the keys matter
    assert (load.prefill_tokens, load.decode_seqs, load.active_blocks) == (32, 1, 5)
    t.release()
    t.settle([1, 2, 3], 10)  # released: nothing to correct
    other.release()
    assert tracker.idle()


def test_parse_vllm_metrics_sums_engines_and_averages_usage() -> None:
    text = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 1.0
"""
    assert parse_vllm_metrics(text) == {
        "vllm:num_requests_running": 5.0,
        "vllm:num_requests_waiting": 4.0,
        "vllm:kv_cache_usage_perc": 0.375,
    }


def test_a_data_parallel_backend_counts_its_best_rank() -> None:
    from indexer.index import Worker
    from router.fleet.backends import BackendPool
    from router.choose import candidates
    from router.fleet.load import LoadTracker
    from router.runtime import Models
    from kvconfig import parse_config

    cfg = parse_config({"models": [{"name": "m", "tokenizer": "unused", "backends": [
        {"name": "dp", "url": "http://127.0.0.1:9", "data_parallel_size": 2},
        {"name": "solo", "url": "http://127.0.0.1:10"},
    ]}]})
    pool = BackendPool(cfg)
    hits = {Worker("dp", 0): {"GPU": 3}, Worker("dp", 1): {"GPU": 5, "CPU": 2}, Worker("solo", 0): {"CPU": 4}}
    cands = candidates(Models(cfg)["m"], hits, pool, LoadTracker(list(pool.backends)))
    dp, solo = cands
    assert (dp.matched_blocks, dp.weighted_blocks, dp.best_rank) == (7, 6.0, 1)
    assert (solo.matched_blocks, solo.weighted_blocks) == (4, 2.0)


def stored_positions(n: int) -> set[int]:
    """Where the index keeps an ``n``-key chain: its first key, every ``STRIDE``-th, its last."""
    return {0, n - 1, *range(STRIDE - 1, n, STRIDE)}


def walked_match(sent: list[tuple[float, list[int], str]], keys: list[int], now: float, ttl_s: float) -> dict[str, int]:
    """What :meth:`ApproxPrefixIndex.match` must answer, from the inserts alone, key by key.

    A backend holds a key while an insert of a chain that has it at a stored position is
    within the TTL. Its match ends after the last key of ``keys`` it holds, as long as it
    held every stored position of ``keys`` before that key (positions between them may have
    been stored only for a shorter chain sent there)."""
    held: dict[int, set[str]] = {}
    for t, chain, backend in sent:
        if t + ttl_s > now:
            for p in stored_positions(len(chain)):
                held.setdefault(chain[p], set()).add(backend)
    stored = stored_positions(len(keys))
    counts: dict[str, int] = {}
    alive: set[str] | None = None
    for i, k in enumerate(keys):
        here = held.get(k, set())
        alive = set(here) if alive is None else alive
        for b in here & alive:
            counts[b] = i + 1
        if i in stored:
            alive &= here
        if not alive:
            break
    return counts


def test_approx_index_binary_search_equals_the_key_by_key_walk() -> None:
    """Chains sent as prefixes of one another, to four backends, expiring as time passes."""
    rng = random.Random(11)
    now = [0.0]
    idx = ApproxPrefixIndex(ttl_s=5.0, max_blocks=1_000_000, clock=lambda: now[0])
    sent: list[tuple[float, list[int], str]] = []
    chains = [[rng.randrange(1 << 62) for _ in range(rng.randrange(1, 60))] for _ in range(30)]
    for step in range(400):
        base = rng.choice(chains)
        keys = base[: rng.randrange(1, len(base) + 1)]
        if rng.random() < 0.5:
            backend = rng.choice("abcd")
            idx.insert(keys, backend)
            sent.append((now[0], keys, backend))
        now[0] += rng.random() * 0.2
        probe = rng.choice(chains)
        assert idx.match(probe) == walked_match(sent, probe, now[0], idx.ttl_s), step


def test_sparse_approx_index_is_exact_for_extensions_and_never_more_than_a_stride_short() -> None:
    """Against the truth kept by hand (every chain sent, whole): a request that extends a
    chain sent before matches all of it; one that leaves a chain mid-stride loses less than
    a stride; no match ever exceeds the truth."""
    rng = random.Random(5)
    idx = ApproxPrefixIndex(ttl_s=1e9, max_blocks=1_000_000, clock=lambda: 0.0)
    sent: list[tuple[list[int], str]] = []
    bases = [[rng.randrange(1 << 62) for _ in range(300)] for _ in range(4)]
    for step in range(300):
        base = rng.choice(bases)
        cut = rng.randrange(1, 300)
        probe = base[:cut] + [rng.randrange(1 << 62) for _ in range(rng.randrange(0, 40))]
        truth: dict[str, int] = {}
        for chain, backend in sent:
            shared = next((i for i, (x, y) in enumerate(zip(chain, probe)) if x != y), min(len(chain), len(probe)))
            if shared:
                truth[backend] = max(truth.get(backend, 0), shared)
        got = idx.match(probe)
        assert got == walked_match([(0.0, c, b) for c, b in sent], probe, 0.0, idx.ttl_s), step
        for backend, n in truth.items():
            assert n - STRIDE < got.get(backend, 0) <= n, (step, backend, n, got)
            if any(b == backend and len(c) <= len(probe) and probe[: len(c)] == c for c, b in sent):
                assert got[backend] >= max(len(c) for c, b in sent if b == backend and probe[: len(c)] == c)
        backend = rng.choice("ab")
        idx.insert(probe, backend)
        sent.append((probe, backend))


@pytest.mark.parametrize("make", [
    lambda: kv_aware(KvAwareWeights(), 1000),
    lambda: PrefixApprox(ApproxPrefixIndex(60.0, 1000)),
], ids=["kv_aware", "prefix_approx"])
def test_a_policy_with_prefix_memory_forgets_a_backend(make) -> None:
    from router.policies.base import PrefixMemory

    policy = make()
    assert isinstance(policy, PrefixMemory)
    policy.remember([1, 2, 3], "b0")
    policy.remember([7, 8], "b1")
    policy.forget("b0")
    assert not policy.remembers([1, 2, 3])
    assert policy.remembers([7, 8])
