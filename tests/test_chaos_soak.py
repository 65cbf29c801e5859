"""Issue 17 §2 scaled down: ``kvrouter chaos --soak`` for about a minute.

The hour-long run is ``kvrouter chaos --soak 3600``; this one checks that the soak
samples every series, fits its slopes, writes its report and plot, and that a minute of
steady traffic leaves nothing behind: no failed request, every load counter at 0, and
memory and descriptors flat after the warm-up. The router's prefix hash cache, whose
filling was the hour's RSS growth, is run with a bound the minute fills several times
over: it must reach it and never pass it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest.chaos_soak import SERIES, SoakOptions, run_soak

BOUND = 1024

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_a_minute_of_traffic_leaves_nothing_behind(tmp_path: Path) -> None:
    doc = run_soak(SoakOptions(out=tmp_path, seconds=60, sample_s=5, speedup=4.0, rate_scale=1.5, warmup_s=20,
                               health_interval_s=2.0, quiet=True, hash_cache_blocks=BOUND))
    assert doc["requests"] > 100 and doc["failed"] == 0
    assert all(v == 0 for v in doc["load_counters_after"]["router-0"].values()), doc["load_counters_after"]
    assert len(doc["samples"]) >= 10
    slopes = doc["slopes"]
    assert set(slopes) == set(SERIES)
    assert all(slopes[s]["per_hour"] is not None for s in ("rss_mb", "open_fds", "index_entries", "asyncio_tasks"))
    assert abs(slopes["rss_mb"]["drift_share"]) < 0.05, slopes["rss_mb"]
    assert slopes["open_fds"]["max"] - slopes["open_fds"]["min"] <= 32, slopes["open_fds"]
    cached = [s["hash_cache_blocks"] for s in doc["samples"] if "hash_cache_blocks" in s]
    assert len(cached) >= 10 and max(cached) == BOUND, cached
    assert doc["meta"]["hash_cache_filled_s"] is not None and doc["meta"]["hash_cache_blocks"] == BOUND
    assert "hash cache" in (tmp_path / "soak_report.md").read_text()
    assert (tmp_path / "soak_report.md").exists() and (tmp_path / "soak.png").stat().st_size > 0


def _rss(values: list[float]) -> list[dict[str, float]]:
    return [{"t": 10.0 * i, "rss_mb": v} for i, v in enumerate(values)]


def test_rss_steps_split_a_burst_from_a_trend_and_hide_no_leak() -> None:
    """The step analysis reads a one-off rise (a burst's high-water mark) as a step with a
    flat trend around it, and a steady leak as a trend, whichever way it is cut."""
    from loadtest.chaos_soak import rss_steps

    leak = rss_steps(_rss([260 + 21.0 * i * 10 / 3600 for i in range(360)]), 0.0)
    assert leak["steps"] == [] and abs(leak["per_hour_within_segments"] - 21.0) < 0.01
    burst = rss_steps(_rss([263.0 + 0.01 * (i % 3) for i in range(200)] + [277.0 + 0.01 * (i % 3) for i in range(160)]), 0.0)
    assert [round(s["mb"]) for s in burst["steps"]] == [14] and abs(burst["per_hour_within_segments"]) < 0.1
    stairs = rss_steps(_rss([260.0 + 5 * (i // 60) for i in range(360)]), 0.0)
    assert len(stairs["steps"]) == 5 and stairs["steps_total_mb"] == 25.0
