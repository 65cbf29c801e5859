"""Capacity at a latency SLO: the load sweep's points, and the one number each policy earns from them.

Operators buy a KV-aware router because the same engines then serve more traffic inside a
latency target. A bench at one fixed load cannot show that: at 80% of round_robin's measured
capacity round_robin is stable by construction, so no policy can win by much there. The
sweep replays the workload at several loads, fixed before the run (multiples of round_robin's
measured capacity, or of ``--rate-scale``), and each policy's **capacity at SLO** is the
highest offered request rate whose client TTFT p90 stays within the SLO.

Everything here is plain data in, plain data out, so the figures can be recomputed from
``results.json``'s ``sweep`` alone, by this module or by a check outside the repository.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

BASELINE = "round_robin"

SWEEP_KEYS = ("policy", "target_load", "offered_req_per_s", "throughput_req_per_s", "ttft_p50_ms", "ttft_p90_ms",
              "ttft_p99_ms", "engine_ttft_p90_ms", "cached_ratio", "errors")
"""The keys of every ``results.json`` ``sweep`` entry, and no others: checks outside the repository read them."""


class SweepError(ValueError):
    """A ``--sweep`` or SLO the bench cannot run: said in one line, before anything starts."""


def parse_loads(text: str) -> list[float]:
    """``"0.8,1.2,2"`` -> ``[0.8, 1.2, 2.0]``: at least two loads, each > 0, strictly increasing.

    Increasing, because capacity is read off the curve from left to right and the last
    point is the lower bound of a policy that never crossed the SLO; a shuffled list would
    most likely be a typo, so it is refused rather than sorted."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    try:
        loads = [float(x) for x in items]
    except ValueError:
        raise SweepError(f"--sweep wants comma-separated numbers such as 0.8,1.2,2, got {text!r}") from None
    if len(loads) < 2:
        raise SweepError(f"--sweep wants at least two loads to find where the SLO is crossed, got {text!r}")
    if any(not math.isfinite(x) or x <= 0 for x in loads):
        raise SweepError(f"--sweep loads must be finite and > 0, got {text!r}")
    if any(b <= a for a, b in zip(loads, loads[1:])):
        raise SweepError(f"--sweep loads must be strictly increasing, got {text!r}")
    return loads


def check_slo(slo_ms: float | None, sweep: list[float] | None) -> None:
    """The SLO and the sweep come together: a sweep needs the target it is measured against, and
    an SLO means nothing at one load (a single run has no capacity to report)."""
    if sweep is None and slo_ms is not None:
        raise SweepError("--slo-ttft-p90-ms is the target of a load sweep: give --sweep too")
    if sweep is not None and slo_ms is None:
        raise SweepError("--sweep needs --slo-ttft-p90-ms, the TTFT p90 target fixed before the run")
    if slo_ms is not None and (not math.isfinite(slo_ms) or slo_ms <= 0):
        raise SweepError(f"--slo-ttft-p90-ms must be a finite number of ms > 0, got {slo_ms}")


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


def sweep_point(run: dict[str, Any], target_load: float, offered_req_per_s: float) -> dict[str, Any]:
    """One ``sweep`` entry from one results.json run (a policy at one load, its repeats folded).

    Times are engine milliseconds, as every other figure of the bench; ``offered_req_per_s``
    is the workload's arrival rate at this load, the same for every policy, and
    ``throughput_req_per_s`` what the policy completed per second of its replay."""
    return {
        "policy": run["policy"],
        "target_load": target_load,
        "offered_req_per_s": round(offered_req_per_s, 4),
        "throughput_req_per_s": round(run["requests_per_s"], 4),
        "ttft_p50_ms": _ms(run["ttft_s"]["p50"]),
        "ttft_p90_ms": _ms(run["ttft_s"]["p90"]),
        "ttft_p99_ms": _ms(run["ttft_s"]["p99"]),
        "engine_ttft_p90_ms": _ms((run.get("engine_ttft_s") or {}).get("p90")),
        "cached_ratio": run["cached_ratio"],
        "errors": run["errors"],
    }


@dataclass(frozen=True, slots=True)
class Capacity:
    """A policy's capacity at the SLO: ``req_per_s``, and whether it is only a lower bound
    (the policy met the SLO at the sweep's highest load, so its real capacity lies beyond)."""

    req_per_s: float
    lower_bound: bool


def meets_slo(point: dict[str, Any], slo_ms: float) -> bool:
    """Whether a sweep point's client TTFT p90 is within the SLO, with no request lost.

    A failed request never got its first token, later than any SLO; a point that lost
    requests has not served its load within the target, whatever the p90 of the answered
    ones says. Read from the ``sweep`` keys alone, so a check outside can apply the same rule."""
    p90 = point["ttft_p90_ms"]
    return p90 is not None and p90 <= slo_ms and not point["errors"]


def capacity(points: list[dict[str, Any]], slo_ms: float) -> Capacity:
    """One policy's capacity at ``slo_ms`` from its sweep points (any order: they are taken by offered rate).

    The highest offered rate that meets the SLO, moved towards the next point by linear
    interpolation of TTFT p90 between the two (the crossing lies between them). The highest
    such point, not the one before the first crossing: noise on a shared machine adds latency
    and rarely removes it, so a point over the SLO below one within it is more likely a spike
    than the policy's limit (medians of repeats make both rarer). Meeting the SLO at the last
    point gives that rate as a lower bound; meeting it nowhere gives 0.
    """
    return crossing(sorted(points, key=lambda p: p["offered_req_per_s"]), slo_ms)


def crossing(points: list[dict[str, Any]], slo_ms: float, rate: str = "offered_req_per_s") -> Capacity:
    """:func:`capacity` over points already in load order, reading each point's rate from ``rate``.

    Separate from the sort because a Locust ramp's points are in user-count order while the
    rate it reads (the req/s the users achieved) may fall once the fleet saturates. When the
    point after the last one within the SLO fails by lost requests with a p90 still within
    the SLO, there is no latency crossing to interpolate, so the meeting point's rate stands.
    """
    ok = [i for i, p in enumerate(points) if meets_slo(p, slo_ms)]
    if not ok:
        return Capacity(0.0, False)
    i = ok[-1]
    lo = points[i]
    if i == len(points) - 1:
        return Capacity(lo[rate], True)
    hi = points[i + 1]
    if hi["ttft_p90_ms"] is None or hi["ttft_p90_ms"] <= slo_ms:
        return Capacity(lo[rate], False)
    frac = (slo_ms - lo["ttft_p90_ms"]) / (hi["ttft_p90_ms"] - lo["ttft_p90_ms"])
    return Capacity(lo[rate] + frac * (hi[rate] - lo[rate]), False)


def capacity_at_slo(sweep: list[dict[str, Any]], slo_ms: float, baseline: str = BASELINE) -> dict[str, Any]:
    """``results.json``'s ``capacity_at_slo``: the SLO, then per policy (in sweep order)
    ``{"req_per_s", "lower_bound", "vs_round_robin"}``.

    ``vs_round_robin`` is the policy's capacity over ``baseline``'s; None when the baseline
    did not run or served nothing within the SLO (no ratio to speak of)."""
    by: dict[str, list[dict[str, Any]]] = {}
    for p in sweep:
        by.setdefault(p["policy"], []).append(p)
    caps = {policy: capacity(points, slo_ms) for policy, points in by.items()}
    base = caps.get(baseline)
    out: dict[str, Any] = {"slo_ttft_p90_ms": slo_ms}
    for policy, c in caps.items():
        ratio = c.req_per_s / base.req_per_s if base is not None and base.req_per_s > 0 else None
        out[policy] = {"req_per_s": round(c.req_per_s, 4), "lower_bound": c.lower_bound,
                       "vs_round_robin": None if ratio is None else round(ratio, 4)}
    return out


def policies_of(cap: dict[str, Any]) -> list[str]:
    """The policies of a ``capacity_at_slo`` object, in sweep order (every key but the SLO)."""
    return [k for k in cap if k != "slo_ttft_p90_ms"]


def rate_text(c: dict[str, Any]) -> str:
    """A capacity as a reader should take it: ``≥ 12.3`` when it is a lower bound, ``0`` when the
    policy met the SLO at no load."""
    return f"{'≥ ' if c['lower_bound'] else ''}{c['req_per_s']:,.2f}" if c["req_per_s"] else "0"


def headline(cap: dict[str, Any], best: str = "kv_aware", base: str = BASELINE) -> str | None:
    """The demo's one sentence: ``best``'s capacity at the SLO against ``base``'s (None when
    either did not run). A lower bound says "at least"; a baseline that met the SLO at no
    load has no ratio, and the sentence says so instead of dividing by zero; a baseline that
    never crossed the SLO makes the ratio a guess, and the sentence says that too."""
    if best not in cap or base not in cap:
        return None
    b, a = cap[best], cap[base]
    x = f"at least {b['req_per_s']:.2f}" if b["lower_bound"] else f"{b['req_per_s']:.2f}"
    y = f"at least {a['req_per_s']:.2f}" if a["lower_bound"] else f"{a['req_per_s']:.2f}"
    if a["req_per_s"] <= 0:
        ratio = f"{base} meets the SLO at no load of the sweep"
    elif a["lower_bound"]:
        ratio = f"{b['req_per_s'] / a['req_per_s']:.2f}×, though the sweep never loaded {base} past the SLO"
    else:
        ratio = f"{'at least ' if b['lower_bound'] else ''}{b['req_per_s'] / a['req_per_s']:.2f}×"
    return f"{best} serves {x} req/s within TTFT p90 ≤ {cap['slo_ttft_p90_ms']:g} ms; {base} serves {y} ({ratio})"


# -- a Locust step ramp ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Step:
    """One step of a ramp: ``users`` for ``[start_s, end_s)``, and what the requests that finished
    in its settled part (after the first quarter) saw. ``errors`` and ``ttft_p90_ms`` are read as
    in a sweep point (:func:`meets_slo`); ``req_per_s`` is the rate the users achieved."""

    step: int
    users: int
    start_s: float
    end_s: float
    requests: int
    errors: int
    req_per_s: float
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _quantile(xs: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default), of sorted ``xs``."""
    if not xs:
        return None
    k = (len(xs) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


@dataclass
class StepRamp:
    """A step load that adds ``step_users`` users every ``step_s`` seconds until a step's TTFT p90
    crosses the SLO (or a request fails), or ``max_users`` have run a step.

    A fixed user count measures a policy at one load, most often one where routing cannot
    matter; a ramp finds where each policy stops meeting the target, the number operators
    compare. Driven by Locust's ``LoadTestShape.tick`` (:mod:`loadtest.locust_step`) with
    finished requests fed to :meth:`observe`; plain code, so it is tested without Locust.
    The first quarter of each step is left out of its figures: the users just added are still
    starting their sessions, and the fleet is still filling to the new load. Before the first
    step, ``warmup_s`` at the first step's users is never judged: a cold fleet's first requests
    pay for connection set-up and empty caches, which no load causes (on a 2-engine fleet they
    put the first step's TTFT p90 at 5x the next one's).
    """

    slo_ms: float
    step_users: int
    step_s: float
    max_users: int
    warmup_s: float = 0.0
    on_step: Callable[[Step], None] | None = None
    steps: list[Step] = field(default_factory=list)
    _seen: list[tuple[float, float | None]] = field(default_factory=list)
    done: bool = False

    SETTLE = 0.25

    def observe(self, t_s: float, ttft_ms: float | None) -> None:
        """A request finished ``t_s`` seconds into the ramp; ``ttft_ms`` None when it failed."""
        self._seen.append((t_s, ttft_ms))

    def users_at(self, t_s: float) -> int | None:
        """The user count to run at ``t_s``; None once the ramp is over. Closes every step that
        ended before ``t_s`` first, so a late tick still judges each step on its own window."""
        while not self.done and self.warmup_s + (len(self.steps) + 1) * self.step_s <= t_s:
            step = self._close(len(self.steps))
            self.steps.append(step)
            if self.on_step is not None:
                self.on_step(step)
            self.done = not meets_slo(asdict(step), self.slo_ms) or step.users >= self.max_users
        if self.done:
            return None
        return self._users(len(self.steps))

    def _users(self, k: int) -> int:
        return min((k + 1) * self.step_users, self.max_users)

    def _close(self, k: int) -> Step:
        start = self.warmup_s + k * self.step_s
        end = start + self.step_s
        settled = start + self.SETTLE * self.step_s
        window = [ttft for t, ttft in self._seen if settled <= t < end]
        self._seen = [(t, ttft) for t, ttft in self._seen if t >= end]
        ok = sorted(x for x in window if x is not None)
        p50, p90 = _quantile(ok, 0.5), _quantile(ok, 0.9)
        return Step(k + 1, self._users(k), start, end, len(window), len(window) - len(ok),
                    round(len(ok) / (end - settled), 4), None if p50 is None else round(p50, 3),
                    None if p90 is None else round(p90, 3))

    def sustained(self) -> Capacity:
        """The req/s the users sustained within the SLO: the step rates around the crossing,
        interpolated as a sweep's (:func:`crossing`); a lower bound when no step crossed."""
        return crossing([asdict(s) for s in self.steps], self.slo_ms, rate="req_per_s")
