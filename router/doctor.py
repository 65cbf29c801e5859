"""``kvrouter doctor --config FILE``: check a live fleet against the config before traffic.

Misconfiguration is the most common reason a KV-aware router silently degrades to
random routing: a wrong PYTHONHASHSEED, hash algorithm, block size or vLLM version makes
every lookup miss without any error, and an events endpoint given as ``ip`` instead of
``tcp://ip:port`` never connects. For every backend the doctor reports:

- whether it is up and serves the model (and its LoRA adapters), and its ``max_model_len``;
- whether its KV-event stream connects and at which seq: it subscribes, sends one small
  probe completion so the engine stores blocks, and reads the events that follow;
- whether the first ``BlockStored``'s hashes match the router's hasher, and if not the
  setting that would make them match (through :class:`indexer.verify.HashVerifier`);
- whether the engine's ``/tokenize`` agrees with local tokenization on a sample chat;
- with ``--router [URL]``, how often a running router's predicted cached tokens have agreed
  with those the engine reported, on live traffic (:mod:`router.doctor_fidelity`).

Exit status 0 when every check passed, 1 otherwise (a low agreement, or a router that could
not be read, included), 2 for an unreadable config.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
import zmq
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from indexer.events import BlockStored, EventDecodeError, build_replay_request, decode_batch, parse_pub_frames, parse_replay_reply
from indexer.hashing import BlockHasher, HashConfigError
from indexer.index import Worker
from indexer.subscriber import offset_endpoint
from indexer.verify import HashVerifier
from kvconfig import Backend, Config, ConfigError, Model, load_config
from router.doctor_fidelity import RouterUnavailable, RouterUnreachable, read, router_url
from router.prompt.prompt_fields import TokenizeError
from router.prompt.tokenize import load_tokenizer

SAMPLE_CHAT = {
    "messages": [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "List three prime numbers, then explain why 1 is not prime."},
    ]
}


@dataclass
class Check:
    name: str
    ok: bool | None
    detail: str


@dataclass
class BackendReport:
    model: str
    backend: str
    url: str
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok is not False for c in self.checks)

    def add(self, name: str, ok: bool | None, detail: str) -> None:
        self.checks.append(Check(name, ok, detail))


@dataclass
class RouterReport:
    """The running router ``--router`` read: one check, whether it answered (and which workers)."""

    router: str
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok is not False for c in self.checks)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="fleet config (YAML)")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for each backend's answers and events")
    parser.add_argument("--json", action="store_true", help="print the reports as JSON")
    parser.add_argument("--router", nargs="?", const="", default=None, metavar="URL",
                        help="also report each backend's live fidelity (predicted vs reported cached tokens) from the "
                             "router at URL (alone: the config's router.host and port), read with the admin key")


def run(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    reports: list[Any] = [check_backend(m, b, args.timeout) for m in config.models for b in m.backends]
    if args.router is not None:
        reports.append(check_router(config, args.router, args.timeout, reports))
    if args.json:
        print(json.dumps([{**asdict(r), "ok": r.ok} for r in reports], indent=2))
    else:
        _print(reports)
    return 0 if all(r.ok for r in reports) else 1


def check_router(config: Config, given: str, timeout: float, reports: list[BackendReport]) -> RouterReport:
    """Read the running router's fidelity and add a ``fidelity`` check to each backend's report
    (a new report for a backend the router has and the config does not, such as a discovered one)."""
    key = config.router.admin_api_key
    report = RouterReport(given)
    try:
        report.router = router_url(given, config.router)
        heard, verdicts = read(report.router, key.get_secret_value() if key else None, timeout)
    except RouterUnavailable as e:
        where = " (the config's router.host and port; give another address as --router URL)"
        report.checks.append(Check("router", False, str(e) + (where if isinstance(e, RouterUnreachable) and not given else "")))
        return report
    report.checks.append(Check("router", True, f"/debug/backends {heard}"))
    by_name = {r.backend: r for r in reports}
    for v in verdicts:
        if v.backend not in by_name:
            by_name[v.backend] = BackendReport(", ".join(v.models), v.backend, v.url)
            reports.append(by_name[v.backend])
        by_name[v.backend].add("fidelity", v.ok, v.detail)
    for r in reports:
        if not any(c.name == "fidelity" for c in r.checks):
            r.add("fidelity", None, f"the router at {report.router} does not route to it")
    return report


def check_backend(model: Model, backend: Backend, timeout: float) -> BackendReport:
    report = BackendReport(model.name, backend.name, backend.url)
    with httpx.Client(base_url=backend.url, timeout=timeout, headers=backend.auth_headers()) as http:
        if not _check_served(report, model, http):
            return report
        _check_events(report, model, backend, http, timeout)
        _check_tokenize(report, model, http)
    return report


def _check_served(report: BackendReport, model: Model, http: httpx.Client) -> bool:
    try:
        health = http.get("/health")
        models = http.get("/v1/models").json().get("data", [])
    except (httpx.HTTPError, ValueError) as e:
        report.add("reachable", False, f"{report.url}: {e!r}")
        return False
    report.add("reachable", health.status_code == 200, f"/health answered {health.status_code}")
    ids = {m.get("id"): m for m in models if isinstance(m, dict)}
    wanted = [model.name] + [a.name for a in model.lora_adapters]
    missing = [n for n in wanted if n not in ids]
    report.add("models served", not missing, f"missing {missing}; the engine serves {sorted(ids)}" if missing else ", ".join(wanted))
    mml = ids.get(model.name, {}).get("max_model_len")
    if model.max_model_len is not None and isinstance(mml, int) and mml < model.max_model_len:
        report.add("max_model_len", False, f"engine {mml} < config {model.max_model_len}")
    else:
        report.add("max_model_len", None, str(mml))
    return not missing


def _check_events(report: BackendReport, model: Model, backend: Backend, http: httpx.Client, timeout: float) -> None:
    if backend.kv_events is None:
        report.add("kv events", None, "no kv_events endpoint configured: kv_aware falls back to load only")
        return
    try:
        hasher = BlockHasher(model.hash_algo, model.block_size, model.hash_seed, model.vllm_version)
    except HashConfigError as e:
        report.add("hash config", False, str(e))
        return
    ctx = zmq.Context()
    try:
        for rank in range(backend.data_parallel_size):
            endpoint = offset_endpoint(backend.kv_events, rank)
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.setsockopt(zmq.LINGER, 0)
            sub.connect(endpoint)
            time.sleep(0.3)  # ZMQ slow joiner: messages before the subscription lands are lost
            _probe(http, model, hasher.block_size)
            stored, first_seq, n_msgs = _collect(sub, timeout)
            sub.close()
            name = f"kv events rank {rank}"
            if n_msgs == 0:
                report.add(name, False, f"no message from {endpoint} after a probe request: check the engine's "
                           "--kv-events-config (publisher zmq, endpoint tcp://*:PORT) and that the config gives "
                           "tcp://HOST:PORT of that engine")
                continue
            report.add(name, True, f"connected to {endpoint}, seq {first_seq}")
            if stored is None:
                report.add(f"hashes rank {rank}", None, "no BlockStored seen (probe shorter than a block?)")
                continue
            _verify(report, model, hasher, stored, rank)
            if backend.kv_replay:
                _check_replay(report, ctx, offset_endpoint(backend.kv_replay, rank), first_seq, timeout, rank)
    finally:
        ctx.destroy(linger=0)


def _probe(http: httpx.Client, model: Model, block_size: int) -> None:
    words = " ".join(f"doctor-{uuid.uuid4().hex[:6]}" for _ in range(block_size))
    try:
        http.post("/v1/completions", json={"model": model.name, "prompt": words, "max_tokens": 1})
    except httpx.HTTPError:
        pass


def _collect(sub: zmq.Socket, timeout: float) -> tuple[list[tuple[int, Any]] | None, int | None, int]:
    """Messages for up to ``timeout`` seconds: the first batch with a BlockStored, the first seq."""
    deadline = time.monotonic() + timeout
    first_seq = None
    n = 0
    while (left := deadline - time.monotonic()) > 0:
        if not sub.poll(int(left * 1000)):
            break
        try:
            _, seq, payload = parse_pub_frames(sub.recv_multipart())
            batch = decode_batch(payload)
        except (EventDecodeError, ValueError):
            continue
        n += 1
        first_seq = seq if first_seq is None else first_seq
        if any(isinstance(ev, BlockStored) for ev in batch.events):
            return [(seq, batch)], first_seq, n
    return None, first_seq, n


def _verify(report: BackendReport, model: Model, hasher: BlockHasher, stored: list[tuple[int, Any]], rank: int) -> None:
    verifier = HashVerifier(hasher, {a.name: a.path for a in model.lora_adapters}, window=1, min_mismatches=1)
    worker = Worker(report.backend, rank)
    outcome = None
    for _, batch in stored:
        outcome = verifier.check(worker, batch)
    assert outcome is not None
    name = f"hashes rank {rank}"
    if outcome.mismatch:
        report.add(name, False, verifier.diagnosis(worker) or "the engine's block hashes differ from the router's")
    elif outcome.match:
        report.add(name, True, f"{outcome.match} block(s) hash identically ({model.hash_algo}, seed {model.hash_seed!r}, "
                   f"block {model.block_size}, vLLM {model.vllm_version})")
    else:
        report.add(name, None, "the stored blocks could not be re-derived (parent unknown)")


def _check_replay(report: BackendReport, ctx: zmq.Context, endpoint: str, seq: int | None, timeout: float, rank: int) -> None:
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart(build_replay_request(seq or 0))
        if not dealer.poll(int(timeout * 1000)):
            report.add(f"replay rank {rank}", False, f"{endpoint} did not answer a replay request")
            return
        reply = parse_replay_reply(dealer.recv_multipart())
        report.add(f"replay rank {rank}", True, f"{endpoint} answered" + (f" from seq {reply[0]}" if reply else " (end marker)"))
    except (ValueError, EventDecodeError) as e:
        report.add(f"replay rank {rank}", False, f"{endpoint} answered malformed frames: {e}")
    finally:
        dealer.close()


def _check_tokenize(report: BackendReport, model: Model, http: httpx.Client) -> None:
    try:
        local = load_tokenizer(model.tokenizer).chat_ids(SAMPLE_CHAT)
    except TokenizeError as e:
        report.add("tokenizer", False, f"local tokenizer {model.tokenizer!r}: {e}")
        return
    try:
        r = http.post("/tokenize", json={"model": model.name, **SAMPLE_CHAT})
        remote = r.json().get("tokens") if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError) as e:
        report.add("tokenizer", None, f"/tokenize unavailable: {e!r}")
        return
    if remote is None:
        report.add("tokenizer", None, f"/tokenize answered {r.status_code}")
    elif remote == local:
        report.add("tokenizer", True, f"/tokenize agrees on a sample chat ({len(local)} tokens)")
    else:
        first = next((i for i, (a, b) in enumerate(zip(local, remote)) if a != b), min(len(local), len(remote)))
        report.add("tokenizer", False, f"/tokenize differs at token {first} ({len(local)} local vs {len(remote)} engine): "
                   "wrong tokenizer or chat template; consider tokenizer_mode: remote")


def _print(reports: list[Any]) -> None:
    console = Console()
    for r in reports:
        if isinstance(r, RouterReport):
            c = r.checks[0]
            console.print(f"[green]router {escape(r.router)}: ok, {escape(c.detail)}[/green]" if c.ok
                          else f"[red]{escape(c.detail)}[/red]",
                          soft_wrap=True, highlight=False)
            continue
        table = Table(title=f"{r.model} / {r.backend} ({r.url})", show_lines=False)
        table.add_column("check")
        table.add_column("result")
        table.add_column("detail")
        for c in r.checks:
            mark = {True: "[green]ok[/green]", False: "[red]FAIL[/red]", None: "[yellow]info[/yellow]"}[c.ok]
            table.add_row(c.name, mark, c.detail)
        console.print(table)
    bad = [r.backend if isinstance(r, BackendReport) else "router" for r in reports if not r.ok]
    console.print("[red]problems on: " + ", ".join(bad) + "[/red]" if bad else "[green]all backends ok[/green]")
