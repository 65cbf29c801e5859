"""Knobs the lab varies and operators leave alone: ablations and internal sizes.

They are not in the config file (:mod:`kvconfig`, which holds what an operator sets). The
bench and tests set them: in process through ``Router(config, tuning=...)``, and for a
``kvrouter serve`` child through its hidden ``--tuning JSON`` flag. Every default is the
value the benchmarks chose.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class KvAwareTuning(BaseModel):
    """kv_aware's cost and sampling constants (router/policies/kv_aware.py), and the load guard of
    prefix_approx (router/policies/prefix_approx.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    context: float = Field(default=0.0, ge=0.0)
    """Cost per prompt block of every in-flight request (a shared prefix counts once per request):
    decode attention reads each request's whole context every step. Off by default."""
    temperature: float = Field(default=0.0, ge=0.0)
    """0 picks the cheapest backend; above 0, a softmax over normalised costs samples among near-equal ones."""
    imbalance_ratio: float = Field(default=1.25, ge=1.0)
    """prefix_approx's load guard: the backend sent the longest prefix counts as overloaded above this many
    times the least loaded one's requests in flight, plus ``imbalance_slack``."""
    imbalance_slack: int = Field(default=4, ge=0)
    queue_weight: float = Field(default=1.0, ge=0.0)
    """What a block of prefill already queued on a backend costs, relative to one of this prompt's own
    uncached blocks. Below 1 a backend that holds the prompt's prefix keeps it at a longer queue: a
    session moved for its queue also loses its cache for the turns that follow. 1 (the default) until
    held-out runs say otherwise: on Mooncake tuning rows 0.5 came out level."""
    cpu_tier: float = Field(default=0.5, ge=0.0, le=1.0)
    """What a block found in an engine's CPU tier saves, relative to one on the GPU."""
    storage_tier: float = Field(default=0.25, ge=0.0, le=1.0)
    """What a block found in an engine's storage tier saves, relative to one on the GPU."""
    speculative_ttl_s: float = Field(default=2.0, ge=0.0)
    """How long a prefix just sent to a backend counts as cached there, in seconds, before the engine's events
    confirm it (0: off)."""


class Tuning(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    defer_cold_prompts: bool = True
    """Send a prompt whose first block nobody holds before tokenizing all of it (router/prompt/cold.py)."""
    history_memo: bool = True
    """Route a chat whose messages start with ones already tokenized on their remembered keys (router/prompt/history.py)."""
    inline_tokenize_bytes: int = Field(default=2048, ge=0)
    """Bodies, and a prompt's uncached text, up to this many bytes are tokenized at once on the event loop."""
    tokenize_pending_bytes: int = Field(default=64 << 20, ge=0)
    """Most request-body bytes waiting for, or in, the tokenizer pool; a request past it gets a 429
    (``tokenizer_busy``) rather than queueing unbounded work and memory."""
    queue_heavy_fraction: float = Field(default=0.25, gt=0.0, le=1.0)
    """With the admission queue on, a tenant over twice its fair share of recent requests is let through only
    to a backend with nothing queued for prefill, or under this fraction of ``router.queue_busy_tokens`` with
    the request's uncached tokens added (router/admission.py); 1 treats it almost as any other. 0.25 on the
    mixed workload's tuning seed 0 (against 0.5 and 1; 0.1 was no better held out), with one tenant at 10x the
    others' rate; with requests sized against it, 0.125 and 0.5 were no better on tuning seeds 11 and 12 (0.125
    within 4%, with more of the heavy tenant's requests timing out). docs/benchmarks.md has the others' TTFT p90
    against their own alone on held-out seeds."""
    queue_heavy_subset: bool = True
    """With the admission queue on, a heavy tenant's requests go only to its share of a model's backends
    (router/admission.py), so that the rest serve the other tenants free of its prefill. Beside a tenant at 10x
    the others' rate it lowered their TTFT p90 where the fleet was not busy (0.86x on held-out seed 1015, 0.71x
    on 1003) and left it level where the fleet was (0.95x over held-out seeds 1013-1015); the heavy tenant gets
    several times the 429s (docs/benchmarks.md, the router queue). It also gives way while a backend outside its
    share has a backlog (``ModelQueue.gives_way``): within 1.5x on all ten held-out seeds 1003-1012, 1.04x over
    them. False: it goes to any backend with room, and never gives way."""
    client_timeout_s: float = Field(default=30.0, gt=0)
    """Longest a client may take to send a request's head (from its connection's opening, or the previous
    answer), or pause its body; then its connection is closed (router/http/guard.py)."""
    max_connections: int | None = Field(default=None, ge=1)
    """Most client connections a router process keeps (router/http/guard.py); None: what its file
    descriptors allow, the soft limit raised to the hard one at start."""
    hash_cache_blocks: int = Field(default=500_000, ge=16)
    """Blocks whose hashes the prefix hash cache keeps per model (~18 bytes each)."""
    parity_sample_rate: float = Field(default=0.01, ge=0.0, le=1.0)
    """Fraction of requests whose local token ids are compared with an engine's ``/tokenize``."""
    segment_cache_tokens: int = Field(default=8_000_000, ge=0)
    """Token ids the tokenizer's segment cache keeps per tokenizer (router/prompt/segments.py), oldest
    dropped first: ~35 bytes each, ~280 MB when full (kvrouter_tokenizer_segment_cache_tokens shows
    the fill). 0 keeps nothing: every segment is tokenized anew."""
    prefix_ttl_s: float = Field(default=120.0, gt=0)
    """How long prefix_approx assumes an engine still caches a prefix it was sent, in seconds."""
    prefix_max_blocks: int = Field(default=1_000_000, ge=1)
    """Most block keys per model in the router's memory of where it sent each prefix (prefix_approx,
    kv_aware's speculative hits); the oldest go first."""
    breaker_failures: int = Field(default=5, ge=1)
    """Consecutive failures of a backend (5xx, resets, timeouts) that open its circuit breaker (once the
    router's own request to it confirms the backend fails: router/fleet/backends.py)."""
    breaker_cooldown_s: float = Field(default=5.0, gt=0)
    """Seconds an open circuit keeps its backend out, doubling on each re-open up to 60; then one trial
    request decides."""
    connect_timeout_s: float = Field(default=5.0, gt=0)
    """Longest wait for a connection to an engine, in seconds (a refused one fails at once and is retried
    on the next backend)."""
    metrics_scrape_interval_s: float = Field(default=1.0, gt=0)
    """Seconds between reads of each engine's ``/metrics``: requests there beyond the router's own count
    (another router's traffic) add to its load."""
    max_connections_per_backend: int = Field(default=512, ge=1)
    """Most connections open to one engine at once (each request in flight holds one)."""
    subscribe_events: bool | None = None
    """Follow the backends' KV-event streams in this process. Default: yes with the in-memory index, no
    with Redis (the standalone ``kvrouter indexer`` fills it)."""
    kv_aware: KvAwareTuning = KvAwareTuning()
