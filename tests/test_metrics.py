"""The router's series: one :class:`router.metrics.RouterMetrics` per process, and how the
workers of ``serve --workers N`` merge theirs (:mod:`router.http.worker_metrics`).

The merge is checked on snapshots and on two :class:`WorkerSeries` sharing a directory in
this process; the slow tests run a real 2-worker ``kvrouter serve``.
"""

from __future__ import annotations

import asyncio
import operator
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import Metric

from router import metrics
from router.http.worker_metrics import SNAPSHOT_S, Snapshot, WorkerSeries, merge, take
from support import REPO
from test_workers import MODEL, CountingEngine, Router, model, scrape


class Worker:
    """One worker's series: a registry with a counter, a histogram and two gauges."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("kvrouter_requests", "r", ["status"], registry=self.registry)
        self.seconds = Histogram("kvrouter_seconds", "s", registry=self.registry, buckets=(1.0, 2.0))
        self.summed = Gauge("kvrouter_summed", "g", registry=self.registry)
        self.own = Gauge("kvrouter_own", "g", registry=self.registry)

    def snapshot(self, pid: int) -> Snapshot:
        snap = take(self.registry.collect())
        snap.pid = pid
        return snap


GAUGE_MERGE = {"kvrouter_summed": operator.add}


def samples(merged: Iterator[Metric]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for m in merged for s in m.samples}


def two_workers() -> tuple[Worker, Worker]:
    a, b = Worker(), Worker()
    a.requests.labels("200").inc(2)
    b.requests.labels("200").inc(3)
    b.requests.labels("502").inc()
    a.seconds.observe(1.5)
    b.seconds.observe(0.5)
    a.summed.set(4)
    b.summed.set(5)
    a.own.set(1)
    b.own.set(2)
    return a, b


def test_counters_and_histograms_are_summed_over_the_workers() -> None:
    a, b = two_workers()
    got = samples(merge([(a.snapshot(1), True), (b.snapshot(2), True)], GAUGE_MERGE))
    assert got[("kvrouter_requests_total", (("status", "200"),))] == 5.0
    assert got[("kvrouter_requests_total", (("status", "502"),))] == 1.0
    assert got[("kvrouter_seconds_bucket", (("le", "1.0"),))] == 1.0
    assert got[("kvrouter_seconds_bucket", (("le", "2.0"),))] == 2.0
    assert got[("kvrouter_seconds_count", ())] == 2.0
    assert got[("kvrouter_seconds_sum", ())] == 2.0
    assert not any(name.endswith("_created") for name, _ in got)


def test_a_gauge_is_merged_as_declared_and_else_shown_per_worker() -> None:
    a, b = two_workers()
    got = samples(merge([(a.snapshot(1), True), (b.snapshot(2), True)], GAUGE_MERGE))
    assert got[("kvrouter_summed", ())] == 9.0
    assert got[("kvrouter_own", (("pid", "1"),))] == 1.0
    assert got[("kvrouter_own", (("pid", "2"),))] == 2.0


def test_a_dead_workers_counts_stay_and_its_gauges_leave() -> None:
    a, b = two_workers()
    got = samples(merge([(a.snapshot(1), True), (b.snapshot(2), False)], GAUGE_MERGE))
    assert got[("kvrouter_requests_total", (("status", "200"),))] == 5.0
    assert got[("kvrouter_seconds_count", ())] == 2.0
    assert got[("kvrouter_summed", ())] == 4.0
    assert ("kvrouter_own", (("pid", "2"),)) not in got


def test_a_scrape_shows_what_another_worker_counted_just_before_it(tmp_path: Path) -> None:
    """No periodic snapshot comes in time (the first is SNAPSHOT_S away): the scrape's own
    request makes the other worker write one."""
    a, b = Worker(), Worker()
    sa = WorkerSeries(tmp_path, a.registry.collect, GAUGE_MERGE)
    sb = WorkerSeries(tmp_path, b.registry.collect, GAUGE_MERGE)
    try:
        a.requests.labels("200").inc()
        b.requests.labels("200").inc(2)
        got = samples(asyncio.run(sa.merged()))
        assert got[("kvrouter_requests_total", (("status", "200"),))] == 3.0
    finally:
        sa.close()
        sb.close()


def test_a_worker_that_exits_leaves_its_counts_and_takes_its_gauges(tmp_path: Path) -> None:
    a, b = Worker(), Worker()
    sa = WorkerSeries(tmp_path, a.registry.collect, GAUGE_MERGE)
    sb = WorkerSeries(tmp_path, b.registry.collect, GAUGE_MERGE)
    try:
        b.requests.labels("200").inc(2)
        b.summed.set(5)
        sb.close()
        got = samples(asyncio.run(sa.merged()))
        assert got[("kvrouter_requests_total", (("status", "200"),))] == 2.0
        assert got[("kvrouter_summed", ())] == 0.0
    finally:
        sa.close()


def test_every_gauge_that_declares_a_multiprocess_mode_is_merged_that_way() -> None:
    """The gauges of modules that do not use :class:`RouterMetrics` yet still say how
    workers combine them with prometheus-client's ``multiprocess_mode``, which nothing
    reads any more: :data:`metrics.GAUGE_MERGE` must say the same."""
    import router.http.app  # noqa: F401  every module that declares a series

    how = {"livesum": operator.add, "livemax": max}
    declared = {
        g._name: how[g._multiprocess_mode]
        for name, module in list(sys.modules.items()) if name.split(".")[0] in ("router", "indexer")
        for g in vars(module).values() if isinstance(g, Gauge) and g._multiprocess_mode != "all"
    }
    assert declared
    assert {k: metrics.GAUGE_MERGE[k] for k in declared} == declared


def test_label_children_are_memoised() -> None:
    m = metrics.process_metrics()
    assert metrics.child(metrics.DECISIONS, MODEL, "kv_aware", "cache_hit") is m.child(m.decisions, MODEL, "kv_aware", "cache_hit")


def test_importing_the_router_replaces_nothing_in_prometheus_client(tmp_path: Path) -> None:
    """Not even with ``PROMETHEUS_MULTIPROC_DIR`` set, where it used to batch the library's
    multiprocess values."""
    code = "import router.http.app\nfrom prometheus_client import values\nprint(values.ValueClass.__module__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120, check=True,
                         env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)})
    assert out.stdout.strip() == "prometheus_client.values"


N = 40
KEY = f"kvrouter_requests_total,backend=e,model={MODEL},policy=kv_aware,status=200"
OVERHEAD = f"kvrouter_overhead_seconds_count,model={MODEL}"


def send(router: Router, n: int) -> None:
    """``n`` completions, each on a fresh connection: the kernel spreads them over the
    workers (all of 40 on one worker: 2^-39)."""
    for i in range(n):
        r = httpx.post(router.url + "/v1/completions", json={"model": MODEL, "prompt": f"count me {i}", "max_tokens": 1},
                       timeout=10)
        assert r.status_code == 200, r.text


@pytest.mark.slow
def test_any_workers_metrics_sum_both_workers_series(tmp_path: Path) -> None:
    with CountingEngine() as engine:
        router = Router({"models": [model({"name": "e", "url": engine.url})]}, tmp_path)
        try:
            send(router, N)
            for _ in range(6):  # fresh connections: both workers answer some of these scrapes
                m = scrape(router.url)
                assert m[KEY] == N and m[OVERHEAD] == N, (m.get(KEY), m.get(OVERHEAD))
        finally:
            router.stop()


@pytest.mark.slow
def test_a_killed_workers_counts_stay_in_the_sum(tmp_path: Path) -> None:
    """SIGKILL, with no scrape before it: what the worker counted reached the others through
    its periodic snapshot."""
    with CountingEngine() as engine:
        router = Router({"models": [model({"name": "e", "url": engine.url})]}, tmp_path)
        try:
            send(router, N)
            time.sleep(2 * SNAPSHOT_S)
            victim = router.backends()
            os.kill(victim["pid"], signal.SIGKILL)
            router.each_worker(lambda d: d["worker_restarts"] == 1 and d["pid"] != victim["pid"],
                               "the supervisor to restart the killed worker", timeout=60)
            m = scrape(router.url)
            assert m[KEY] == N and m[OVERHEAD] == N, (m.get(KEY), m.get(OVERHEAD))
        finally:
            router.stop()

