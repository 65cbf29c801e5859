"""The bench report: ``report.md`` (one table, one row per policy) and matplotlib PNGs.

Inputs are plain data so the report can be rebuilt from a finished run: the
``results.json`` runs, and per policy the request records (send time, backend, TTFT,
prompt and cached tokens) and the engine load samples the bench scraped. All times
are engine seconds (see :mod:`loadtest.replay` on clocks).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest import capacity as cap_
from loadtest.replay import RequestRecord


@dataclass(frozen=True, slots=True)
class LoadSample:
    """One scrape of one engine: engine seconds since the replay started, requests in it."""

    t_s: float
    backend: str
    running: float
    waiting: float


@dataclass(slots=True)
class PolicyTrace:
    """What the plots need from one policy's run."""

    policy: str
    records: list[RequestRecord]
    samples: list[LoadSample]
    time_scale: float


def imbalance(backend_requests: dict[str, int]) -> float | None:
    """max/mean requests per backend (1.0 is perfect balance); None without backends."""
    counts = [v for k, v in backend_requests.items() if k != "-"]
    if not counts or sum(counts) == 0:
        return None
    return max(counts) / (sum(counts) / len(counts))


def _first(*values: float | None) -> float | None:
    return next((v for v in values if v is not None), None)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:,.0f}"


def _f(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


COLUMNS = ("policy", "TTFT p50 ms", "TTFT p90 ms", "TTFT p99 ms", "engine TTFT p90 ms", "e2e p50 ms", "e2e p99 ms",
           "output tok/s",
           "cached ratio", "ideal ratio", "max/mean load", "router overhead ms", "router CPU ms/req", "errors")
ORACLE_COLUMNS = ("of oracle gain", "engine: of oracle gain")
"""Shown when the bench ran the oracle: each policy's TTFT-p90 gain over round_robin as a
fraction of the oracle's, at the client and at the engines (:func:`add_oracle_gains`)."""

ORACLE = "oracle"
BASELINE = "round_robin"


SUMMED = frozenset({"requests", "completed", "errors"})
"""Counts that add up over repeats (the table's ``errors`` column reads "errors/requests" over all runs)."""
SPREAD = {"ttft_p90": ("ttft_s", "p90"), "engine_ttft_p90": ("engine_ttft_s", "p90"),
          "cached_ratio": ("cached_ratio",), "load_imbalance": ("load_imbalance",)}
"""The headline figures whose every repeat ``median_run`` keeps, so a report shows the spread behind a median."""


def median_run(reps: list[dict[str, Any]]) -> dict[str, Any]:
    """One policy's repeats folded into one results.json entry: every number is the median of
    its repeats (nested dicts such as ``ttft_s`` key by key), counts in :data:`SUMMED` are
    summed, and anything else (names, lists) is the first repeat's.

    Medians, not means: on a small shared machine one repeat now and then is slowed by
    something else, and a mean would carry that outlier into the table. ``repeats`` keeps each
    repeat's headline figures (:data:`SPREAD`)."""
    if len(reps) == 1:
        return reps[0]
    out = _median_of(reps)
    for k in SUMMED:
        out[k] = sum(r[k] for r in reps)
    out["repeats"] = {name: [_dig(r, path) for r in reps] for name, path in SPREAD.items()}
    return out


def _median_of(values: list[Any]) -> Any:
    first = values[0]
    if isinstance(first, dict):
        keys = [k for k in first if all(isinstance(v, dict) and k in v for v in values)]
        return {k: _median_of([v[k] for v in values]) for k in keys}
    # A repeat that could not measure a figure (None) is left out of its median.
    nums = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return statistics.median(nums) if nums else first


def _dig(run: dict[str, Any], path: tuple[str, ...]) -> Any:
    v: Any = run
    for k in path:
        v = (v or {}).get(k)
    return v


def add_oracle_gains(runs: list[dict[str, Any]], base: str = BASELINE, oracle: str = ORACLE) -> None:
    """Set each run's ``oracle_gain``: ``{"ttft_p90", "engine_ttft_p90"}``, its TTFT-p90 gain over
    ``base`` as a fraction of ``oracle``'s gain (1.0: as good as the oracle, 0: no better than
    ``base``, below 0: worse). None where either run is missing or the oracle gained nothing."""
    by = {r["policy"]: r for r in runs}
    for r in runs:
        r["oracle_gain"] = {
            "ttft_p90": _gain_fraction(by.get(base), r, by.get(oracle), _client_p90),
            "engine_ttft_p90": _gain_fraction(by.get(base), r, by.get(oracle), _engine_p90),
        }


def _client_p90(r: dict[str, Any]) -> float | None:
    return r["ttft_s"]["p90"]


def _engine_p90(r: dict[str, Any]) -> float | None:
    return (r.get("engine_ttft_s") or {}).get("p90")


def _gain_fraction(base: dict[str, Any] | None, run: dict[str, Any], oracle: dict[str, Any] | None,
                   p90: Any) -> float | None:
    if base is None or oracle is None:
        return None
    b, x, o = p90(base), p90(run), p90(oracle)
    if b is None or x is None or o is None or b - o <= 0:
        return None
    return (b - x) / (b - o)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.0%}"


def _shows_oracle(runs: list[dict[str, Any]]) -> bool:
    return any(r["policy"] == ORACLE for r in runs)


def columns(runs: list[dict[str, Any]]) -> tuple[str, ...]:
    return COLUMNS[:-1] + ORACLE_COLUMNS + COLUMNS[-1:] if _shows_oracle(runs) else COLUMNS


def table_rows(runs: list[dict[str, Any]]) -> list[list[str]]:
    oracle = _shows_oracle(runs)
    rows = []
    for r in runs:
        row = [
            r["policy"], _ms(r["ttft_s"]["p50"]), _ms(r["ttft_s"]["p90"]), _ms(r["ttft_s"]["p99"]),
            _ms(_engine_p90(r)),
            _ms(r["e2e_s"]["p50"]), _ms(r["e2e_s"]["p99"]), _f(r["output_tokens_per_s"], ",.0f"),
            _f(r["cached_ratio"], ".3f"), _f(r.get("ideal_cached_ratio"), ".3f"), _f(r.get("load_imbalance"), ".2f"),
            _f(_first(r.get("router_overhead_ms"), r.get("router_decision_probe_ms")), ".2f"),
            _f((r.get("cpu_ms_per_request") or {}).get("router"), ".2f"),
        ]
        if oracle:
            gain = r.get("oracle_gain") or {}
            row += [_pct(gain.get("ttft_p90")), _pct(gain.get("engine_ttft_p90"))]
        rows.append(row + [f"{r['errors']}/{r['requests']}"])
    return rows


def markdown_table(runs: list[dict[str, Any]]) -> str:
    cols = columns(runs)
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join(["---"] + ["---:"] * (len(cols) - 1)) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(runs)]
    return "\n".join(lines)


def console() -> Any:
    """A rich console for tables: terminal width on a terminal, wide enough for the tables otherwise
    (rich would wrap at 80 columns in a pipe or a log file, eliding the numbers)."""
    from rich.console import Console

    c = Console()
    return c if c.is_terminal else Console(width=200)


def rich_table(runs: list[dict[str, Any]], title: str) -> Any:
    from rich.table import Table

    t = Table(title=title)
    cols = columns(runs)
    t.add_column(cols[0], no_wrap=True, min_width=max((len(r["policy"]) for r in runs), default=0))
    for c in cols[1:]:
        t.add_column(c, justify="right")
    for row in table_rows(runs):
        t.add_row(*row)
    return t


def comparison(runs: list[dict[str, Any]], base: str = "round_robin", best: str = "kv_aware") -> list[str]:
    """Sentences comparing ``best`` with ``base`` (empty when either is missing)."""
    by = {r["policy"]: r for r in runs}
    if base not in by or best not in by:
        return []
    a, b = by[base], by[best]
    out = []
    pa, pb = a["ttft_s"]["p90"], b["ttft_s"]["p90"]
    if pa and pb:
        out.append(f"TTFT p90 at the client: {best} {pb * 1000:,.0f} ms vs {base} {pa * 1000:,.0f} ms, "
                   f"{pa / pb:.2f}x lower.")
    ea, eb = (a.get("engine_ttft_s") or {}).get("p90"), (b.get("engine_ttft_s") or {}).get("p90")
    if ea and eb:
        out.append(f"TTFT p90 at the engines: {best} {eb * 1000:,.0f} ms vs {base} {ea * 1000:,.0f} ms, "
                   f"{ea / eb:.2f}x lower.")
    floor = (b.get("ttft_floor_s") or {}).get("p90")
    if floor and ea and eb:
        out.append(f"TTFT p90 floor (ideal cache, idle engines): {floor * 1000:,.0f} ms, so no router can beat "
                   f"{base}'s engine p90 by more than {ea / floor:.2f}x here; {best} has {ea / eb:.2f}x, "
                   f"{(ea - eb) / (ea - floor):.0%} of the possible gain." if ea > floor else
                   f"TTFT p90 floor (ideal cache, idle engines): {floor * 1000:,.0f} ms.")
    out.append(f"Cached-token ratio: {best} {b['cached_ratio']:.3f} vs {base} {a['cached_ratio']:.3f}"
               f" (ideal {b.get('ideal_cached_ratio') or 0:.3f}).")
    if b.get("load_imbalance") is not None:
        out.append(f"Load imbalance (max/mean requests per backend) under {best}: {b['load_imbalance']:.2f}.")
    return out + oracle_comparison(runs, base, best)


def oracle_comparison(runs: list[dict[str, Any]], base: str = BASELINE, best: str = "kv_aware") -> list[str]:
    """Sentences placing ``best`` and its exact-state ablations between ``base`` and the oracle
    (empty without an oracle run): the split of its gap into information and cost model."""
    by = {r["policy"]: r for r in runs}
    if ORACLE not in by or base not in by or best not in by:
        return []
    o = by[ORACLE]

    def share(policy: str) -> str:
        gain = by[policy].get("oracle_gain") or {}
        return f"{_pct(gain.get('ttft_p90'))} at the client, {_pct(gain.get('engine_ttft_p90'))} at the engines"

    out = [f"Oracle (each engine's exact state, the simulator's own TTFT prediction): TTFT p90 "
           f"{_ms(_client_p90(o))} ms at the client, {_ms(_engine_p90(o))} ms at the engines; {best} has "
           f"{share(best)} of the oracle's TTFT-p90 gain over {base}."]
    ablations = [p for p in (f"{best}+exact_load", f"{best}+exact_cache", f"{best}+exact") if p in by]
    if ablations:
        out.append(f"With exact engine state fed to {best}'s cost: " + "; ".join(f"{p} {share(p)}" for p in ablations)
                   + f". What exact state adds over {best} is what the router cannot know (stale events, unseen load);"
                   f" what {best}+exact still lacks is its cost model's error.")
    return out


def write_markdown(path: Path, meta: dict[str, Any], runs: list[dict[str, Any]], plots: list[str]) -> None:
    lines = [f"# kvrouter bench: {meta['workload']}", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items()]
    lines += ["", markdown_table(runs), ""]
    lines += [f"- {s}" for s in comparison(runs)]
    tenants = [(r["policy"], r["tenants"]) for r in runs if r.get("tenants")]
    if tenants:
        lines += ["", "Tenants (`--mix noisy_tenant=X`: tenant-0 is the noisy one), client TTFT p90 of those served:", ""]
        lines += [f"- {policy}: " + "; ".join(
            f"{name} {_ms(t['ttft_s']['p90'])} ms, {t['completed']:,} of {t['requests']:,} served, {t['rejected_429']:,} got 429"
            for name, t in groups.items()) for policy, groups in tenants]
    reasons = [(r["policy"], r["decision_reasons"]) for r in runs if r.get("decision_reasons")]
    if reasons:
        lines += ["", "Routing decisions by reason (`kvrouter_routing_decisions_total`):", ""]
        lines += [f"- {policy}: " + ", ".join(f"{k} {v:,}" for k, v in counts.items()) for policy, counts in reasons]
    lines += ["", "Times are engine seconds (wall time x the simulator's speedup). The ideal ratio is what one engine",
              "with an infinite cache would reuse across the same prompts; the TTFT floor is each request's TTFT",
              "with that cache on an idle engine (the simulator's latency model, no queueing), the bound no",
              "routing can pass. Router overhead is wall milliseconds,",
              "the mean of the router's `kvrouter_overhead_seconds` (request body received to upstream request sent)",
              "during the run. Engine TTFT is each request's TTFT inside the engine, as the simulator reports it",
              "(for engines that do not, the p90 is interpolated in `vllm:time_to_first_token_seconds`' buckets,",
              "as Prometheus' histogram_quantile does): it holds queueing and prefill but not the",
              "router's and the client's own time, which a busy test machine inflates by the speedup factor.", ""]
    if _shows_oracle(runs):
        lines += ["The oracle sends each request where the simulator's own scheduler and latency model predict the",
                  "earliest first token, from each engine's exact queue, running batch and cache at decision time",
                  "(`kvrouter sim --debug-state`); \"of oracle gain\" is a policy's TTFT-p90 gain over round_robin as a",
                  "fraction of the oracle's. `kv_aware+exact_load`, `+exact_cache` and `+exact` are kv_aware's cost fed",
                  "the engines' exact load, exact cache, or both (router/policies/oracle.py).", ""]
    lines += [f"![{p}]({p})" for p in plots]
    path.write_text("\n".join(lines) + "\n")


# -- capacity at SLO (a load sweep) ---------------------------------------------------------

CAPACITY_COLUMNS = ("policy", "capacity at SLO req/s", "vs round_robin")
SWEEP_COLUMNS = ("policy", "load", "offered req/s", "throughput req/s", "TTFT p50 ms", "TTFT p90 ms", "TTFT p99 ms",
                 "engine TTFT p90 ms", "cached ratio", "errors")


def capacity_rows(cap: dict[str, Any]) -> list[list[str]]:
    """One row per policy of ``capacity_at_slo``: its capacity (``≥`` marks a lower bound) and its ratio to round_robin."""
    return [[p, cap_.rate_text(cap[p]), _f(cap[p]["vs_round_robin"], ".2f") + ("x" * (cap[p]["vs_round_robin"] is not None))]
            for p in cap_.policies_of(cap)]


def sweep_rows(sweep: list[dict[str, Any]], slo_ms: float) -> list[list[str]]:
    """The sweep point by point, grouped by policy; a TTFT p90 over the SLO (or a point that lost requests) is flagged."""
    order = list(dict.fromkeys(p["policy"] for p in sweep))
    rows = []
    for policy in order:
        for p in (x for x in sweep if x["policy"] == policy):
            flag = "" if cap_.meets_slo(p, slo_ms) else " ✗"
            rows.append([policy, f"{p['target_load']:g}x", _f(p["offered_req_per_s"], ",.2f"),
                         _f(p["throughput_req_per_s"], ",.2f"), _f(p["ttft_p50_ms"], ",.0f"),
                         _f(p["ttft_p90_ms"], ",.0f") + flag, _f(p["ttft_p99_ms"], ",.0f"),
                         _f(p["engine_ttft_p90_ms"], ",.0f"), _f(p["cached_ratio"], ".3f"), str(p["errors"])])
    return rows


def _markdown(cols: tuple[str, ...], rows: list[list[str]]) -> list[str]:
    return (["| " + " | ".join(cols) + " |", "|" + "|".join(["---"] + ["---:"] * (len(cols) - 1)) + "|"]
            + ["| " + " | ".join(row) + " |" for row in rows])


def capacity_table(cap: dict[str, Any], title: str) -> Any:
    """The capacity table for the terminal (rich)."""
    from rich.table import Table

    t = Table(title=title)
    for i, c in enumerate(CAPACITY_COLUMNS):
        t.add_column(c, justify="left" if i == 0 else "right", no_wrap=i == 0)
    for row in capacity_rows(cap):
        t.add_row(*row)
    return t


def write_sweep_markdown(path: Path, meta: dict[str, Any], cap: dict[str, Any], sweep: list[dict[str, Any]],
                         runs: list[dict[str, Any]], plots: list[str]) -> None:
    """report.md of a sweep: the capacity table first (the answer), then the points it was read
    from, then each load's full policy table (the figures a single-load bench reports)."""
    slo = cap["slo_ttft_p90_ms"]
    lines = [f"# kvrouter bench: {meta['workload']}, capacity at TTFT p90 ≤ {slo:g} ms", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items()]
    lines += ["", "## Capacity at SLO", ""]
    lines += _markdown(CAPACITY_COLUMNS, capacity_rows(cap))
    lines += ["", "Capacity at SLO is the highest offered request rate whose client TTFT p90 stays within the SLO,",
              "linearly interpolated between the two sweep points around the crossing; `≥` marks a policy that met",
              "the SLO at the sweep's highest load (its capacity lies beyond the sweep), 0 one that met it at none.",
              "A point that lost requests does not meet the SLO. Times are engine milliseconds.", ""]
    lines += [f"![{p}]({p})" for p in plots]
    lines += ["", "## Sweep", ""]
    lines += _markdown(SWEEP_COLUMNS, sweep_rows(sweep, slo))
    lines += ["", "✗: over the SLO, or requests lost.", ""]
    for load in dict.fromkeys(r["target_load"] for r in runs):
        at = [r for r in runs if r["target_load"] == load]
        lines += [f"## At {load:g}x ({at[0]['offered_req_per_s']:,.2f} req/s offered)", "", markdown_table(at), ""]
    path.write_text("\n".join(lines) + "\n")


# -- plots --------------------------------------------------------------------------------


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_ttft_cdf(traces: list[PolicyTrace], path: Path, title: str, floor: list[float] | None = None) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for tr in traces:
        xs = sorted(r.ttft_s * tr.time_scale for r in tr.records if r.ok and r.ttft_s is not None)
        if xs:
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=tr.policy)
    if floor:
        xs = sorted(floor)
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", color="grey", linestyle="--",
                label="floor (ideal cache, idle engine)")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"TTFT CDF: {title}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_backend_load(traces: list[PolicyTrace], path: Path, title: str) -> None:
    plt = _plt()
    fig, axes = plt.subplots(len(traces), 1, figsize=(8, 2.2 * len(traces) + 0.6), sharex=True, squeeze=False)
    for ax, tr in zip(axes[:, 0], traces):
        by: dict[str, list[LoadSample]] = {}
        for s in tr.samples:
            by.setdefault(s.backend, []).append(s)
        if not by:
            # No engine scrape for this run (a peer router): fall back to the requests it sent.
            counts: dict[str, list[tuple[float, int]]] = {}
            for r in sorted(tr.records, key=lambda r: r.sent_s):
                seq = counts.setdefault(r.backend, [])
                seq.append((r.sent_s * tr.time_scale, len(seq) + 1))
            for name, seq in sorted(counts.items()):
                ax.plot([t for t, _ in seq], [n for _, n in seq], label=name, lw=1)
            ax.set_ylabel("requests sent")
        for name, ss in sorted(by.items()):
            ax.plot([s.t_s for s in ss], [s.running + s.waiting for s in ss], label=name, lw=1)
            ax.set_ylabel("running+waiting")
        ax.set_title(tr.policy, fontsize=10, loc="left")
        ax.grid(True, alpha=0.3)
    axes[0, 0].legend(fontsize=7, ncol=4, loc="upper right")
    axes[-1, 0].set_xlabel("time (engine s)")
    fig.suptitle(f"Per-backend load over time: {title}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_cached_ratio(traces: list[PolicyTrace], path: Path, title: str, ideal: float | None) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for tr in traces:
        done = sorted((r for r in tr.records if r.ok and r.e2e_s is not None), key=lambda r: r.sent_s + (r.e2e_s or 0))
        cached = prompt = 0
        xs, ys = [], []
        for r in done:
            cached += r.cached_tokens
            prompt += r.prompt_tokens
            if prompt:
                xs.append((r.sent_s + (r.e2e_s or 0)) * tr.time_scale)
                ys.append(cached / prompt)
        ax.plot(xs, ys, label=tr.policy)
    if ideal is not None:
        ax.axhline(ideal, ls="--", color="grey", label="ideal (infinite cache)")
    ax.set_xlabel("time (engine s)")
    ax.set_ylabel("cumulative cached / prompt tokens")
    ax.set_ylim(0, 1)
    ax.set_title(f"Cached-token ratio over time: {title}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plots(out: Path, traces: list[PolicyTrace], title: str, ideal: float | None, prefix: str = "", *,
                floor: list[float] | None = None) -> list[str]:
    """Write the three PNGs into ``out``; returns their file names."""
    names = [f"{prefix}ttft_cdf.png", f"{prefix}backend_load.png", f"{prefix}cached_ratio.png"]
    plot_ttft_cdf(traces, out / names[0], title, floor)
    plot_backend_load(traces, out / names[1], title)
    plot_cached_ratio(traces, out / names[2], title, ideal)
    return names


def plot_capacity(sweep: list[dict[str, Any]], cap: dict[str, Any], path: Path, title: str, *,
                  load_unit: float | None = None, load_name: str = "load",
                  spread: dict[str, list[tuple[float, float, float]]] | None = None) -> None:
    """``capacity.png``: client TTFT p90 (log axis) against offered req/s, one line per policy,
    the SLO as a horizontal line and each policy's capacity marked where it crosses it.

    The picture routers are compared by: a line that stays under the SLO further to the right
    serves more traffic on the same engines. ``load_unit`` (the req/s of load 1.0) adds the
    load multiples as a top axis; ``spread`` (per policy, ``(offered, min, max)`` ms of the
    repeats) shades what the medians hide."""
    plt = _plt()
    slo = cap["slo_ttft_p90_ms"]
    fig, ax = plt.subplots(figsize=(8, 5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, policy in enumerate(cap_.policies_of(cap)):
        color = colors[i % len(colors)]
        pts = sorted((p for p in sweep if p["policy"] == policy), key=lambda p: p["offered_req_per_s"])
        xs = [p["offered_req_per_s"] for p in pts if p["ttft_p90_ms"] is not None]
        ys = [p["ttft_p90_ms"] for p in pts if p["ttft_p90_ms"] is not None]
        c = cap[policy]
        ax.plot(xs, ys, marker="o", lw=2, color=color, label=f"{policy}: {cap_.rate_text(c)} req/s at SLO")
        lost = [p for p in pts if p["errors"] and p["ttft_p90_ms"] is not None]
        if lost:
            ax.scatter([p["offered_req_per_s"] for p in lost], [p["ttft_p90_ms"] for p in lost], marker="x", s=80,
                       color=color, zorder=3)
        # A point where nothing was answered has no p90: an x on the top edge says it failed outright.
        none = [p["offered_req_per_s"] for p in pts if p["ttft_p90_ms"] is None]
        if none:
            ax.scatter(none, [0.97] * len(none), marker="x", s=80, color=color, zorder=3, clip_on=False,
                       transform=ax.get_xaxis_transform())
        if spread and spread.get(policy):
            band = sorted(spread[policy])
            ax.fill_between([b[0] for b in band], [b[1] for b in band], [b[2] for b in band], color=color, alpha=0.12,
                            lw=0)
        if c["req_per_s"] > 0:
            ax.plot([c["req_per_s"]], [slo], marker="v" if not c["lower_bound"] else ">", ms=10, color=color,
                    markeredgecolor="black", zorder=4)
    ax.axhline(slo, color="crimson", ls="--", lw=1.5, label=f"SLO: TTFT p90 ≤ {slo:g} ms")
    _log_ms_axis(ax)
    ax.set_xlabel("offered load (requests per engine-second)")
    ax.set_ylabel("client TTFT p90 (ms, log scale)")
    ax.set_title(f"Capacity at SLO: {title}")
    ax.grid(True, which="both", alpha=0.3)
    ax.set_xlim(left=0)
    if load_unit:
        top = ax.secondary_xaxis("top", functions=(lambda x: x / load_unit, lambda x: x * load_unit))
        top.set_xlabel(load_name)
    ax.legend(loc="best", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _log_ms_axis(ax: Any) -> None:
    """A log y axis labelled in plain milliseconds (500, 1,000, 2,000), not powers of ten: an SLO is read
    in ms. Call it after plotting: the labels thin out over several decades and fill in under about
    a decade and a half, which would otherwise show two."""
    from matplotlib import ticker

    ax.set_yscale("log")
    ax.autoscale_view()
    lo, hi = ax.get_ylim()
    decades = hi / lo
    subs = (1.0,) if decades > 1000 else (1.0, 2.0, 5.0) if decades > 30 else (1.0, 1.5, 2.0, 3.0, 5.0, 7.0)
    ax.yaxis.set_major_locator(ticker.LogLocator(subs=subs))
    ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:,.0f}" if v >= 1 else f"{v:g}"))
    ax.yaxis.set_minor_formatter(ticker.NullFormatter())


def plot_ramp(steps: dict[str, list[Any]], slo_ms: float, path: Path, title: str) -> None:
    """``ramp.png`` of a Locust step ramp: per policy, each step's TTFT p90 (log axis, the SLO as
    a line) and the req/s its users achieved, against the step's user count, with the req/s
    sustained within the SLO marked on each policy's line."""
    plt = _plt()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (policy, ss) in enumerate(steps.items()):
        color = colors[i % len(colors)]
        sustained = cap_.crossing([s.as_dict() for s in ss], slo_ms, rate="req_per_s")
        c = {"req_per_s": sustained.req_per_s, "lower_bound": sustained.lower_bound}
        answered = [s for s in ss if s.ttft_p90_ms is not None]
        top.plot([s.users for s in answered], [s.ttft_p90_ms for s in answered], marker="o", lw=2, color=color,
                 label=policy)
        failed = [s.users for s in ss if s.ttft_p90_ms is None or s.errors]
        if failed:
            top.scatter(failed, [0.97] * len(failed), marker="x", s=80, color=color, clip_on=False,
                        transform=top.get_xaxis_transform())
        bottom.plot([s.users for s in ss], [s.req_per_s for s in ss], marker="o", lw=2, color=color,
                    label=f"{policy}: {cap_.rate_text(c)} req/s within the SLO")
        if sustained.req_per_s > 0:
            bottom.axhline(sustained.req_per_s, color=color, ls=":", lw=1)
    top.axhline(slo_ms, color="crimson", ls="--", lw=1.5, label=f"SLO: TTFT p90 ≤ {slo_ms:g} ms")
    _log_ms_axis(top)
    top.set_ylabel("TTFT p90 per step (ms, log scale)")
    top.set_title(f"Step ramp: {title}")
    top.legend(loc="best", fontsize=9)
    bottom.set_ylabel("requests/s achieved")
    bottom.set_xlabel("users (one step each)")
    bottom.set_ylim(bottom=0)
    bottom.legend(loc="best", fontsize=9)
    for ax in (top, bottom):
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
