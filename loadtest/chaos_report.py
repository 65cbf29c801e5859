"""Reports of ``kvrouter chaos``: ``chaos_report.md`` + ``chaos.png``, ``soak_report.md`` + ``soak.png``,
``replicas_report.md``. Plain tables from the JSON the runs write, so a report can be
rebuilt from ``chaos.json`` without running anything again."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _s(v: float | None, unit: str = "s") -> str:
    return "-" if v is None else f"{v:.2f}{unit}"


def _mb(xs: list[int]) -> str:
    return "/".join(f"{x / 2**20:.0f}" for x in xs) or "-"


def _ints(xs: list[int]) -> str:
    return "/".join(str(x) for x in xs) or "-"


def _verdict(acc: dict[str, bool | None]) -> str:
    failed = [k for k, v in acc.items() if v is False]
    return "pass" if not failed else "FAIL: " + ", ".join(failed)


def chaos_table(doc: dict[str, Any]) -> str:
    rows = ["| scenario | requests | failed (kinds) | unexpected | eject | re-admit | converge | settle | wrong / missed blocks "
            "| load counters | RSS MB before→after | FDs before→after | acceptance |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["scenarios"]:
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(r["failed_kinds"].items())) or "-"
        loads = "0" if r["load_counters_zero"] else str(r["load_counters"])
        rows.append(
            f"| {r['scenario']} | {r['requests']} | {r['failed']} ({kinds}) | {r['unexpected_failures']} "
            f"| {_s(r['eject_s'])} | {_s(r['readmit_s'])} | {_s(r['converge_s'])} | {_s(r['settle_s'])} "
            f"| {r['final_wrong_blocks']} / {r['final_missed_blocks']} | {loads} "
            f"| {_mb(r['rss_before'])}→{_mb(r['rss_after'])} | {_ints(r['fds_before'])}→{_ints(r['fds_after'])} "
            f"| {_verdict(r['acceptance'])} |")
    return "\n".join(rows)


def write_report(doc: dict[str, Any], out: Path) -> None:
    meta = doc["meta"]
    lines = [
        "# kvrouter chaos report",
        "",
        f"4 simulated engines (one process each, speedup {meta['speedup']}, sim args `{' '.join(meta['sim_args'])}`), "
        f"kv_aware routers with health_interval_s {meta['health_interval_s']}, open-loop multi-turn traffic "
        f"(rate scale {meta['rate_scale']:.3f}"
        + (f", {meta['target_load']:.0%} of a measured {meta['capacity_req_per_engine_s']:.2f} req/engine-s" if "target_load" in meta else "")
        + "). Times in wall seconds: eject from the fault, re-admit and converge from the recovery "
        "(converge: first time the index equalled every engine's true cache under traffic; settle: after traffic stopped).",
        "",
        chaos_table(doc),
        "",
        "Failure kinds: `openai_error` (an OpenAI error body), `sse_error` (a stream ended by an error event), "
        "`connection` (the router the request was on died); `bad_error`, `truncated` and `hang` are never acceptable. "
        "*Unexpected* counts failures that were not in flight on the faulted component when it failed.",
        "",
    ]
    for r in doc["scenarios"]:
        lines.append(f"- **{r['scenario']}**: {r['description']}." + (" " + " ".join(r["notes"]) if r["notes"] else ""))
        for ex in r["unexpected_examples"][:3]:
            lines.append(f"  - unexpected: {ex['outcome']} on {ex['backend']} (router {ex['router']}, sent {ex['sent_t']:.1f}s): "
                         f"{ex['detail'][:120]}")
    lines += ["", "![timeline](chaos.png)", ""]
    (out / "chaos_report.md").write_text("\n".join(lines))
    _chaos_png(doc, out / "chaos.png")


def _chaos_png(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = doc["scenarios"]
    fig, axes = plt.subplots(len(scenarios), 1, figsize=(10, 1.8 * len(scenarios) + 0.5), squeeze=False)
    for ax, r in zip(axes[:, 0], scenarios):
        health = [h for h in r["timeline"]["health"] if h["router"] == 0]
        ax.step([h["t"] for h in health], [1 if h["healthy"] else 0 for h in health], where="post",
                label="faulted engine healthy (router 0)")
        fails = r["timeline"]["failures"]
        ax.scatter([f[1] for f in fails], [0.5] * len(fails), marker="x", color="red", label="failed request (end)")
        ax.axvline(r["fault_t"], color="black", linestyle="--", linewidth=0.8)
        if r["recover_t"] is not None:
            ax.axvline(r["recover_t"], color="green", linestyle="--", linewidth=0.8)
        ax.set_ylim(-0.2, 1.3)
        ax.set_yticks([0, 1])
        ax.set_title(f"{r['scenario']}: {r['failed']} failed, {r['unexpected_failures']} unexpected", fontsize=9)
    axes[0, 0].legend(loc="upper right", fontsize=7)
    axes[-1, 0].set_xlabel("wall seconds (dashed: fault, green: recovery)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def soak_table(doc: dict[str, Any], key: str = "slopes") -> str:
    rows = ["| series | mean | min | max | fitted slope / hour | drift over the fit / mean |", "|---|---|---|---|---|---|"]
    for name, s in doc[key].items():
        if s["per_hour"] is None:
            rows.append(f"| {name} | - | - | - | - | - |")
            continue
        drift = "-" if s["drift_share"] is None else f"{s['drift_share']:+.1%}"
        rows.append(f"| {name} | {s['mean']:.4g} | {s['min']:.4g} | {s['max']:.4g} | {s['per_hour']:+.4g} | {drift} |")
    return "\n".join(rows)


def write_soak_report(doc: dict[str, Any], out: Path) -> None:
    meta = doc["meta"]
    lines = [
        "# kvrouter soak report",
        "",
        f"{meta['seconds']:.0f} s at rate scale {meta['rate_scale']:.3f}"
        + (f" ({meta['target_load']:.0%} of a measured {meta['capacity_req_per_engine_s']:.2f} req/engine-s)" if "target_load" in meta else "")
        + f", simulator speedup {meta['speedup']}, sampled every {meta['sample_s']:.0f} s; "
        f"{doc['requests']} requests, {doc['failed']} failed; load counters after: {doc['load_counters_after']}. "
        f"Fits leave out the first {meta['warmup_s']:.0f} s.",
        "",
        soak_table(doc),
        "",
        *_soak_fill_lines(doc),
        *_soak_forced_lines(doc),
        *_soak_step_lines(doc),
        "![soak](soak.png)",
        "",
    ]
    (out / "soak_report.md").write_text("\n".join(lines))
    _soak_png(doc, out / "soak.png")


def _soak_fill_lines(doc: dict[str, Any]) -> list[str]:
    """What the router's bounded hash cache did: filled before the fits (their slopes
    exclude its growth), after the warm-up (a second table fitted from the fill), or never."""
    meta = doc["meta"]
    bound, filled = meta.get("hash_cache_blocks"), meta.get("hash_cache_filled_s")
    if bound is None:
        return []
    if filled is None:
        return [f"The router's prefix hash cache (bound {bound:,} blocks) never filled: its growth is part of "
                "the slopes above, a bounded cache filling, not a leak only if it stops at the bound.", ""]
    line = f"The router's prefix hash cache (bounded at {bound:,} blocks) was full from {filled:.0f} s"
    if not doc.get("slopes_after_fill"):
        return [line + ", within the warm-up: the fits see it at its bound.", ""]
    return [line + ", after the warm-up; fitted from then:", "", soak_table(doc, "slopes_after_fill"), ""]


def _soak_forced_lines(doc: dict[str, Any]) -> list[str]:
    """The ejections ``--eject-every`` forced (engine paused), when any."""
    forced = doc["meta"].get("forced_ejections")
    if not forced:
        return []
    at = ", ".join(f"{f['engine']} at {f['t']:.0f} s" for f in forced)
    return [f"{len(forced)} ejections forced (each engine in turn paused with SIGSTOP): {at}.", ""]


def _soak_step_lines(doc: dict[str, Any]) -> list[str]:
    """RSS fitted between its steps (loadtest/chaos_soak.rss_steps), and each step."""
    st = doc.get("rss_steps")
    if not st:
        return []
    within = "-" if st["per_hour_within_segments"] is None else f"{st['per_hour_within_segments']:+.3g} MB/hour"
    if not st["steps"]:
        return [f"Router RSS never rose by {st['step_mb']:.0f} MB or more between two samples: the slope above is "
                f"its trend (fitted between steps it is the same, {within}).", ""]
    lines = [f"Router RSS rose in {len(st['steps'])} step(s) of {st['step_mb']:.0f} MB or more between two samples "
             f"(+{st['steps_total_mb']:.1f} MB in all); fitted between them, one line per segment with a common "
             f"slope, it grows {within}:", ""]
    lines += [f"- +{x['mb']:.1f} MB at {x['t']:.0f} s"
              + ("" if x.get("ejections") is None else f" ({x['ejections']:.0f} backend ejections counted by then)")
              for x in st["steps"]]
    return [*lines, ""]


def _soak_png(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(doc["slopes"])
    fig, axes = plt.subplots((len(names) + 2) // 3, 3, figsize=(13, 2.6 * ((len(names) + 2) // 3)), squeeze=False)
    for ax, name in zip(axes.flat, names):
        pts = [(s["t"], s[name]) for s in doc["samples"] if s.get(name) is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], linewidth=1)
        s = doc["slopes"][name]
        title = name if s["per_hour"] is None else f"{name} (slope {s['per_hour']:+.3g}/h)"
        steps = doc.get("rss_steps") or {}
        if name == "rss_mb" and steps.get("steps") and steps.get("per_hour_within_segments") is not None:
            title = f"{name} (slope {s['per_hour']:+.3g}/h; {steps['per_hour_within_segments']:+.3g}/h between steps)"
        ax.set_title(title, fontsize=9)
        ax.axvline(doc["meta"]["warmup_s"], color="grey", linestyle=":", linewidth=0.8)
        if doc["meta"].get("hash_cache_filled_s") is not None:
            ax.axvline(doc["meta"]["hash_cache_filled_s"], color="tab:orange", linestyle=":", linewidth=0.8)
        for step in (doc.get("rss_steps") or {}).get("steps", []):
            ax.axvline(step["t"], color="tab:red", linestyle="--", linewidth=0.6)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write_replicas_report(doc: dict[str, Any], out: Path) -> None:
    meta, v = doc["meta"], doc["three_vs_one_redis"]
    rows = ["| setup | requests | failed | cached ratio | TTFT p50 | TTFT p90 | max/mean requests | max/mean queue (sampled) |",
            "|---|---|---|---|---|---|---|---|"]
    for r in doc["runs"]:
        q = "-" if r["queue_max_mean"] is None else f"{r['queue_max_mean']:.2f}"
        mm = "-" if r["max_mean_requests"] is None else f"{r['max_mean_requests']:.2f}"
        rows.append(f"| {r['setup']} | {r['requests']} | {r['failed']} | {r['cached_ratio']:.3f} "
                    f"| {_s(r['ttft_s']['p50'])} | {_s(r['ttft_s']['p90'])} | {mm} | {q} |")
    loss = "-" if v["cached_ratio_loss"] is None else f"{v['cached_ratio_loss']:+.1%}"
    ttft = "-" if v["ttft_p90_change"] is None else f"{v['ttft_p90_change']:+.1%}"
    lines = [
        "# kvrouter replicas: 1 vs 3 routers on one Redis index",
        "",
        f"{meta['max_requests']} requests of the chaos workload (mixed, seed {meta['seed'] + 1000}) per run, rate scale "
        f"{meta['rate_scale']:.3f}, simulator speedup {meta['speedup']}; 3 routers get the sessions round-robin. "
        f"Medians of {meta.get('repeats', 1)} interleaved rounds (requests and failures are totals). "
        "TTFT in engine seconds.",
        "",
        *rows,
        "",
        f"3 vs 1 router on Redis: cached ratio lost {loss} (bar: at most 5%), TTFT p90 {ttft} (bar: at most +10%): "
        + ("pass" if v["pass"] else "FAIL") + ".",
        "",
    ]
    (out / "replicas_report.md").write_text("\n".join(lines))
