"""``kvrouter replay``: send a workload to any OpenAI endpoint and measure what came back.

Every request is streamed with ``stream_options.include_usage``, so one pass yields
TTFT (first chunk carrying output), inter-token latency (gaps between later chunks),
end-to-end time, the engine's ``usage`` (prompt, cached and output tokens) and the
router's ``x-kvrouter-backend`` header (absent on plain vLLM: counted as ``-``).

Open loop (default): a session's first turn leaves at its trace timestamp divided by
``speedup``; its later turns wait for the previous answer plus the think time (also
divided by ``speedup``). Closed loop (``--concurrency C``): C workers each take the
next session and run its turns back to back, timestamps ignored.

Clocks: ``--speedup`` compresses the trace's clock. When the endpoint is a simulated
fleet whose engines run with ``--speedup X``, pass ``--sim-speedup X`` too: measured
times are multiplied by it, so every latency and rate in the summary is in engine
seconds and runs at different speedups compare. Against a real endpoint leave it at 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from loadtest import workloads
from loadtest.sim.world_clock import sleep_until
from loadtest.workloads import Session, Turn, Workload, WorkloadError, tenant_of

BACKEND_HEADER = "x-kvrouter-backend"
REASON_HEADER = "x-kvrouter-reason"
REQUEST_ID_HEADER = "x-request-id"
NO_BACKEND = "-"


@dataclass(slots=True)
class RequestRecord:
    """One request as seen by the client (times in wall seconds, relative to the run start)."""

    session_id: str
    turn: int
    sent_s: float
    ok: bool = False
    status: int = 0
    error: str | None = None
    backend: str = NO_BACKEND
    reason: str | None = None
    """The router's decision reason, where it sends one (``router.expose_decision_headers``)."""
    request_id: str | None = None
    """The answer's ``x-request-id``: the router's access-log line of this request has the same id."""
    ttft_s: float | None = None
    e2e_s: float | None = None
    engine_ttft_s: float | None = None
    """Engine seconds from arrival to first token, when the backend says (``kvrouter sim`` does)."""
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    text: str = ""


@dataclass(slots=True)
class ReplayResult:
    records: list[RequestRecord]
    wall_s: float
    time_scale: float
    target: str
    model: str
    workload: str

    def summary(self) -> dict[str, Any]:
        return summarize(self.records, self.wall_s, self.time_scale)


def percentiles(values: list[float]) -> dict[str, float | None]:
    """``{p50, p90, p99, mean}`` with linear interpolation (numpy's default); None when empty."""
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    xs = sorted(values)

    def pct(p: float) -> float:
        k = (len(xs) - 1) * p
        lo = int(k)
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)

    return {"p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99), "mean": sum(xs) / len(xs)}


def summarize(records: list[RequestRecord], wall_s: float, time_scale: float = 1.0) -> dict[str, Any]:
    """The replay summary (the ``--output`` JSON); times in engine seconds (wall x ``time_scale``)."""
    ok = [r for r in records if r.ok]
    scale = time_scale
    out_tokens = sum(r.output_tokens for r in ok)
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    duration = wall_s * scale
    errors = Counter((r.error or "error").split(":")[0] for r in records if not r.ok)
    return {
        "requests": len(records),
        "completed": len(ok),
        "errors": len(records) - len(ok),
        "error_kinds": dict(errors),
        "duration_s": duration,
        "time_scale": scale,
        "ttft_s": percentiles([r.ttft_s * scale for r in ok if r.ttft_s is not None]),
        "e2e_s": percentiles([r.e2e_s * scale for r in ok if r.e2e_s is not None]),
        "itl_s": percentiles([g * scale for r in ok for g in r.itl_s]),
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / duration if duration > 0 else 0.0,
        "requests_per_s": len(ok) / duration if duration > 0 else 0.0,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cached_ratio": cached / prompt if prompt else 0.0,
        "backend_requests": dict(sorted(Counter(r.backend for r in records).items())),
        **({"tenants": _tenants(records, scale)} if any(tenant_of(r.session_id) for r in records) else {}),
    }


def _tenants(records: list[RequestRecord], scale: float) -> dict[str, dict[str, Any]]:
    """The noisy tenant (``tenant-0`` of the mixed workload's ``noisy_tenant``) against the others:
    what fairness between tenants is judged on."""
    groups: dict[str, list[RequestRecord]] = {}
    for r in records:
        groups.setdefault("tenant-0" if tenant_of(r.session_id) == "tenant-0" else "others", []).append(r)
    out = {}
    for name, rs in sorted(groups.items()):
        ok = [r for r in rs if r.ok]
        out[name] = {"requests": len(rs), "completed": len(ok), "rejected_429": sum(r.status == 429 for r in rs),
                     "ttft_s": percentiles([r.ttft_s * scale for r in ok if r.ttft_s is not None])}
    return out


class Replayer:
    """Runs one workload against one endpoint; one instance per run.

    ``think=False`` sends a session's next turn as soon as the previous answer is in
    (a saturation run); by default the turn's think time is waited first.

    ``clock`` times everything, the schedule and every measurement: the wall clock, or a
    simulated fleet's :class:`loadtest.sim.world_clock.WorldClock`, which the bench's oracle
    stops while it asks a question (arrivals wait and TTFTs do not grow meanwhile).
    """

    def __init__(
        self,
        target: str,
        model: str,
        *,
        speedup: float = 1.0,
        concurrency: int | None = None,
        time_scale: float = 1.0,
        timeout_s: float = 600.0,
        api_key: str | None = None,
        headers: dict[str, str] | None = None,
        on_done: Any = None,
        think: bool = True,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if speedup <= 0:
            raise ValueError(f"speedup must be > 0, got {speedup}")
        if concurrency is not None and concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self.target = target.rstrip("/")
        self.model = model
        self.speedup = speedup
        self.concurrency = concurrency
        self.time_scale = time_scale
        self.timeout_s = timeout_s
        self.headers = dict(headers or {})
        if api_key:
            self.headers["authorization"] = f"Bearer {api_key}"
        self.on_done = on_done
        self.think = think
        self.records: list[RequestRecord] = []
        self.clock = clock
        self._t0 = 0.0

    async def run(self, workload: Workload) -> ReplayResult:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        timeout = httpx.Timeout(self.timeout_s, connect=10.0)
        async with httpx.AsyncClient(limits=limits, timeout=timeout, headers=self.headers) as client:
            self._t0 = self.clock()
            if self.concurrency is None:
                await self._open_loop(client, workload)
            else:
                await self._closed_loop(client, workload, self.concurrency)
            wall = self.clock() - self._t0
        return ReplayResult(self.records, wall, self.time_scale, self.target, self.model, workload.name)

    def now(self) -> float:
        """Seconds since the run started, on :attr:`clock`."""
        return self.clock() - self._t0

    async def sleep_until(self, t: float) -> None:
        """Sleep until :meth:`now` reaches ``t`` (on a world clock, however long it stands still)."""
        await sleep_until(self._t0 + t, self.clock)

    async def _open_loop(self, client: httpx.AsyncClient, workload: Workload) -> None:
        if not workload.sessions:
            return
        t_first = workload.sessions[0].start_s

        async def start(s: Session) -> None:
            await self.sleep_until((s.start_s - t_first) / self.speedup)
            await self._session(client, s)

        await asyncio.gather(*(start(s) for s in workload.sessions))

    async def _closed_loop(self, client: httpx.AsyncClient, workload: Workload, concurrency: int) -> None:
        queue: asyncio.Queue[Session] = asyncio.Queue()
        for s in workload.sessions:
            queue.put_nowait(s)

        async def worker() -> None:
            while not queue.empty():
                await self._session(client, queue.get_nowait())

        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(workload.sessions)))))

    async def _session(self, client: httpx.AsyncClient, s: Session) -> None:
        for i, turn in enumerate(s.turns):
            if i and turn.think_s > 0 and self.think:
                await self.sleep_until(self.now() + turn.think_s / self.speedup)
            rec = await self.send(client, turn, s.session_id, i)
            self.records.append(rec)
            if self.on_done is not None:
                self.on_done(rec)
            if not rec.ok:
                break

    def target_for(self, session_id: str) -> str:
        """The endpoint a session's requests go to (one endpoint here; the bench's replicas spread them)."""
        return self.target

    async def send(self, client: httpx.AsyncClient, turn: Turn, session_id: str, index: int) -> RequestRecord:
        """Stream one request; never raises for HTTP or network trouble (it lands in the record)."""
        body = {**turn.body, "model": self.model, "stream": True, "stream_options": {"include_usage": True}}
        rec = RequestRecord(session_id, index, self.now())
        t_start = self.clock()
        t_last: float | None = None
        try:
            async with client.stream(
                "POST", self.target_for(session_id) + turn.path, json=body, headers={"x-session-id": session_id}
            ) as resp:
                rec.status = resp.status_code
                rec.backend = resp.headers.get(BACKEND_HEADER, NO_BACKEND)
                rec.reason = resp.headers.get(REASON_HEADER)
                rec.request_id = resp.headers.get(REQUEST_ID_HEADER)
                if resp.status_code != 200:
                    detail = (await resp.aread()).decode(errors="replace")[:200]
                    rec.error = f"http {resp.status_code}: {detail}"
                    return rec
                pieces: list[str] = []
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    try:
                        chunk = json.loads(data)
                    except json.JSONDecodeError:
                        rec.error = "protocol: a stream chunk is not JSON"
                        return rec
                    if "error" in chunk:
                        rec.error = f"stream error: {str(chunk['error'])[:200]}"
                        return rec
                    text = _chunk_text(chunk)
                    if text:
                        t = self.clock()
                        if t_last is None:
                            rec.ttft_s = t - t_start
                        else:
                            rec.itl_s.append(t - t_last)
                        t_last = t
                        pieces.append(text)
                    usage = chunk.get("usage")
                    if usage:
                        rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                        rec.output_tokens = int(usage.get("completion_tokens") or 0)
                        details = usage.get("prompt_tokens_details") or {}
                        rec.cached_tokens = int(details.get("cached_tokens") or 0)
                        sim = chunk.get("kvrouter_sim")
                        if isinstance(sim, dict) and isinstance(sim.get("engine_ttft_s"), (int, float)):
                            rec.engine_ttft_s = float(sim["engine_ttft_s"])
                rec.text = "".join(pieces)
        except httpx.HTTPError as e:
            rec.error = f"{type(e).__name__}: {e}"[:200]
            return rec
        rec.e2e_s = self.clock() - t_start
        if rec.ttft_s is None:
            rec.ttft_s = rec.e2e_s
        rec.ok = True
        return rec


def _chunk_text(chunk: dict[str, Any]) -> str:
    """The output text of one completions or chat stream chunk ('' for role/usage-only chunks)."""
    out = []
    for choice in chunk.get("choices") or ():
        if "text" in choice:
            out.append(choice.get("text") or "")
        else:
            delta = choice.get("delta") or {}
            out.append((delta.get("content") or "") + (delta.get("reasoning_content") or ""))
    return "".join(out)


def replay(
    workload: Workload,
    target: str,
    model: str,
    *,
    speedup: float = 1.0,
    concurrency: int | None = None,
    time_scale: float = 1.0,
    progress: bool = False,
    on_done: Any = None,
    timeout_s: float = 600.0,
) -> ReplayResult:
    """Run a replay to completion (blocking); ``progress`` shows a rich progress bar."""
    if not progress:
        r = Replayer(target, model, speedup=speedup, concurrency=concurrency, time_scale=time_scale,
                     on_done=on_done, timeout_s=timeout_s)
        return asyncio.run(r.run(workload))
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    cols = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("errors {task.fields[errors]}"), TimeElapsedColumn())
    with Progress(*cols, transient=False) as bar:
        task = bar.add_task(f"{workload.name} -> {target}", total=workload.num_requests, errors=0)
        errors = 0

        def done(rec: RequestRecord) -> None:
            nonlocal errors
            errors += not rec.ok
            bar.update(task, advance=1, errors=errors)
            if on_done is not None:
                on_done(rec)

        r = Replayer(target, model, speedup=speedup, concurrency=concurrency, time_scale=time_scale,
                     on_done=done, timeout_s=timeout_s)
        result = asyncio.run(r.run(workload))
        bar.update(task, completed=workload.num_requests)
    return result


def summary_table(summary: dict[str, Any], title: str = "replay") -> Any:
    from rich.table import Table

    def ms(d: dict[str, Any], k: str) -> str:
        v = d.get(k)
        return "-" if v is None else f"{v * 1000:.1f}"

    t = Table(title=title)
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_row("requests (errors)", f"{summary['requests']} ({summary['errors']})")
    for name in ("ttft_s", "itl_s", "e2e_s"):
        d = summary[name]
        t.add_row(f"{name[:-2]} ms p50/p90/p99", f"{ms(d, 'p50')} / {ms(d, 'p90')} / {ms(d, 'p99')}")
    t.add_row("output tokens/s", f"{summary['output_tokens_per_s']:.1f}")
    t.add_row("prompt / cached tokens", f"{summary['prompt_tokens']} / {summary['cached_tokens']}")
    t.add_row("cached ratio", f"{summary['cached_ratio']:.3f}")
    t.add_row("backends", ", ".join(f"{k}={v}" for k, v in summary["backend_requests"].items()))
    return t


# -- command ------------------------------------------------------------------------------


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """Workload-shaping flags shared by replay, bench and demo."""
    p.add_argument("--seed", type=int, default=0, help="seed of every pseudo-random choice (default 0)")
    p.add_argument("--tokenizer", default=str(workloads.DEFAULT_TOKENIZER),
                   help="tokenizer directory for generated text and token counts (default: shipped Qwen3)")
    p.add_argument("--length-scale", type=float, default=1.0,
                   help="mooncake: scale of every 512-token block and input length (default 1)")
    p.add_argument("--output-scale", type=float, default=1.0, help="mooncake: scale of output lengths (default 1)")
    p.add_argument("--prompt-form", choices=("ids", "text"), default="ids",
                   help="mooncake: send prompts as token-id lists (default) or decoded text")
    p.add_argument("--session-rate", type=float, default=1.0, help="sharegpt: new conversations per second")
    p.add_argument("--think-time", type=float, default=5.0, help="sharegpt: mean think time between turns (s)")
    p.add_argument("--max-output-tokens", type=int, default=1024, help="sharegpt: cap of each turn's max_tokens")
    p.add_argument("--mix", action="append", default=[], metavar="KEY=VALUE",
                   help="mixed: one of the mixed workload's knobs (loadtest.workloads.MixedSpec), repeatable: "
                        "e.g. agent=0.5, context_tokens=16384, burst_factor=8")
    p.add_argument("--drop-tenant", default=None, metavar="NAME",
                   help="replay without the sessions of this tenant, e.g. tenant-0: the other tenants' "
                        "traffic as it is without a noisy neighbour (mixed with --mix noisy_tenant=X)")


def load_workload(args: argparse.Namespace, path: str, fmt: str | None) -> Workload:
    fmt = fmt or workloads.detect_format(path)
    opts: dict[str, Any] = {}
    if fmt == "mooncake":
        opts = {"length_scale": args.length_scale, "output_scale": args.output_scale, "prompt_form": args.prompt_form}
    elif fmt == "sharegpt":
        opts = {"session_rate": args.session_rate, "think_s": args.think_time,
                "max_output_tokens": args.max_output_tokens}
    elif fmt == "mixed":
        opts = {"mix": key_values(args.mix, "--mix")}
    wl = workloads.load(path, fmt, seed=args.seed, max_requests=args.max_requests,
                        tokenizer_path=args.tokenizer, **opts)
    return workloads.without_tenant(wl, args.drop_tenant) if args.drop_tenant else wl


def key_values(items: list[str], flag: str) -> dict[str, str]:
    """Repeatable ``KEY=VALUE`` command-line items (``--mix``, ``--kv-weight``) as a dict; a malformed one names its flag."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise WorkloadError(f"{flag} wants KEY=VALUE, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="trace file; for --format synthetic or mixed a JSON spec or 'default'")
    p.add_argument("--target", required=True, help="base URL of an OpenAI endpoint, e.g. http://127.0.0.1:8080")
    p.add_argument("--model", required=True, help="model name to put in every request")
    p.add_argument("--format", choices=workloads.FORMATS, default=None, help="trace format (default: detected)")
    p.add_argument("--speedup", type=float, default=1.0, help="compress the trace clock by X (default 1)")
    p.add_argument("--rate-scale", type=float, default=1.0, help="multiply the arrival rate by R (default 1)")
    p.add_argument("--max-requests", type=int, default=None, help="send at most N requests")
    p.add_argument("--concurrency", type=int, default=None, help="closed loop with C concurrent sessions")
    p.add_argument("--sim-speedup", type=float, default=1.0,
                   help="the simulated engines' --speedup: report times in engine seconds (default 1)")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    p.add_argument("--output", default=None, help="write the summary JSON here")
    p.add_argument("--records", default=None, help="write one JSON line per request here")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_workload_args(p)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console(stderr=True)
    try:
        wl = load_workload(args, args.trace, args.format).rate_scaled(args.rate_scale)
        result = replay(wl, args.target, args.model, speedup=args.speedup, concurrency=args.concurrency,
                        time_scale=args.sim_speedup, progress=not args.quiet, timeout_s=args.timeout)
    except (WorkloadError, ValueError) as e:
        console.print(f"[red]error:[/red] {e}")
        return 2
    summary = result.summary()
    summary.update({"target": args.target, "model": args.model, "workload": wl.name, "skipped": wl.skipped})
    Console().print(summary_table(summary, f"{wl.name} -> {args.target}"))
    if args.output:
        Path(args.output).write_text(json.dumps(summary, indent=2) + "\n")
    if args.records:
        write_records(result.records, args.records)
    return 0 if summary["completed"] else 1


def write_records(records: list[RequestRecord], path: str | Path) -> None:
    with open(path, "w") as fh:
        for r in records:
            d = asdict(r)
            d.pop("text")
            fh.write(json.dumps(d) + "\n")


if __name__ == "__main__":
    from router.cli import main

    sys.exit(main(["replay", *sys.argv[1:]]))
