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
