"""The router's container image (Containerfile), built with podman and run against a real fleet.

``make test`` builds it from a Python base made locally with debootstrap
(deploy/image/debootstrap-base.sh, cached across runs), so that no container registry is
needed; ``make image`` runs this same module on the official slim base
(``KVROUTER_IMAGE_BASE``, ``KVROUTER_IMAGE_TAG``). Both build through deploy/image/build.sh
with a CA bundle as the build secret (the host's, so that pip works behind a TLS-intercepting
proxy), marked with a line of its own that no layer of the image may contain. The image must
hold this checkout's sources: a layer cache that missed a change would otherwise pass.

The image then runs as production runs it, hardened (read-only root filesystem, no
capabilities), with the host's network on loopback only: the fleet config and the Qwen3
tokenizer mounted read-only, the client and admin keys from the environment, two workers.
A real ``kvrouter sim`` serves behind it. A chat answered, then one whose prefix the router
knows cached (its token count and predicted cached tokens must equal the engine's: the
tokenizer and the KV events reach the router inside the container), a streamed one, every
process in the container non-root, the access log on the container's stdout, and SIGTERM
(``podman stop``) draining and exiting 0 well before podman would kill it.

podman, runc and debootstrap missing fail the module with what installs them (``make
system``); they are never skipped. Rootful podman and debootstrap need root. Cold (no
base, no layers): about 3 minutes on 2 cores; warm: about 25 s.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from support import QWEN3_DIR, REPO, free_port, sse_events

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

IMAGE_DIR = REPO / "deploy" / "image"
CONTAINERS_CONF = IMAGE_DIR / "containers.conf"
BASE = os.environ.get("KVROUTER_IMAGE_BASE", "")
"""The Python base to build from (``make image``: the official slim image); unset, one made with debootstrap."""
TAG = os.environ.get("KVROUTER_IMAGE_TAG", "localhost/kvrouter:test")
MODEL = "qwen3"
API_KEY = "sk-image-client"
ADMIN_KEY = "sk-image-admin"
UID = "10001"
TOKENIZER_MOUNT = "/models/qwen3"
CA_NOTE = "pip trusts the CA bundle of build secret ca"
CA_MARKER = "# kvrouter image test: the build secret's own line, in no layer of the image"
"""The same on every run: a cached layer that held the secret would hold this very line."""
BUILD_TIMEOUT_S = 900
"""A cold build: debootstrap (about 70 s on 2 cores) and the image (about 90 s, its
dependencies from the package index), with room for a loaded host."""


def podman_env() -> dict[str, str]:
    """The environment podman runs in: the repo's containers.conf (runc, lower ulimits)."""
    return {**os.environ, "CONTAINERS_CONF": str(CONTAINERS_CONF)}


def podman(*args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(["podman", *args], env=podman_env(), capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} failed ({r.returncode}): {r.stderr[-3000:]}")
    return r


def host_ca_bundle() -> Path:
    """``CA_BUNDLE``, else the CA bundle the host's own pip trusts: behind a TLS-intercepting
    proxy it holds the proxy's CA, and the build's pip reaches the index only through the
    build secret."""
    for var in ("CA_BUNDLE", "PIP_CERT", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE"):
        value = os.environ.get(var, "")
        if value and Path(value).is_file():
            return Path(value)
    debian = Path("/etc/ssl/certs/ca-certificates.crt")
    if debian.is_file():
        return debian
    import certifi

    return Path(certifi.where())


@dataclass
class Built:
    tag: str
    log: str
    """podman build's output."""


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Built:
    tools = ("podman", "runc") if BASE else ("podman", "runc", "debootstrap")
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if missing:
        pytest.fail(f"{', '.join(missing)} not installed: `make test` installs them with apt-get (`make system`)")
    if os.geteuid() != 0:
        pytest.fail("the image test runs podman rootful and debootstrap, both as root")
    base = BASE
    if not base:
        r = subprocess.run([str(IMAGE_DIR / "debootstrap-base.sh")], env=podman_env(), capture_output=True, text=True,
                           timeout=BUILD_TIMEOUT_S)
        assert r.returncode == 0, f"debootstrap-base.sh failed ({r.returncode}): {r.stderr[-5000:]}"
        base = r.stdout.split()[-1]
    ca = tmp_path_factory.mktemp("ca") / "ca.pem"
    ca.write_text(host_ca_bundle().read_text() + "\n" + CA_MARKER + "\n")
    r = subprocess.run([str(IMAGE_DIR / "build.sh"), "--base", base, "--tag", TAG, "--ca", str(ca)], env=podman_env(),
                       capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    assert r.returncode == 0, f"build.sh failed ({r.returncode}): {r.stderr[-5000:]}"
    assert r.stdout.split()[-1] == TAG
    return Built(TAG, r.stderr)


PACKAGES = ("router", "indexer", "kvconfig", "loadtest")
SOURCE_DIGEST = """
import hashlib, importlib, pathlib, sys
h = hashlib.sha256()
for name in sys.argv[1:]:
    root = pathlib.Path(importlib.import_module(name).__file__).parent
    for f in sorted(root.rglob("*.py")):
        h.update(f"{name}/{f.relative_to(root)}".encode() + b"\\0" + f.read_bytes())
print(h.hexdigest())
"""
"""The sha256 of the named packages' Python files as an interpreter imports them: the image's
and this checkout's must be equal."""


def test_the_image_holds_this_checkout_as_a_fixed_non_root_user(image: Built) -> None:
    """A build that reused a stale layer (a step whose cache key misses the sources) would
    serve old code and pass every other test here."""
    config = json.loads(podman("image", "inspect", image.tag).stdout)[0]["Config"]
    assert config["User"] == f"{UID}:{UID}"
    assert config["Entrypoint"][:4] == ["/opt/kvrouter/bin/kvrouter", "serve", "--config", "/etc/kvrouter/config.yaml"]
    inside = podman("run", "--rm", "--network", "none", "--entrypoint", "python3", image.tag, "-c", SOURCE_DIGEST,
                    *PACKAGES).stdout.strip()
    here = subprocess.run([sys.executable, "-c", SOURCE_DIGEST, *PACKAGES], cwd=REPO, capture_output=True, text=True,
                          check=True, timeout=60).stdout.strip()
    assert inside == here, "the image's router is not this checkout's"


def test_the_ca_secret_reached_pip_and_no_layer_of_the_image(image: Built) -> None:
    """The secret is used where it is mounted, and never written: a Containerfile that copied
    it into the system store (a common way to trust a proxy's CA) would fail here."""
    lines = image.log.splitlines()
    step = next(i for i, line in enumerate(lines) if "STEP" in line and "--mount=type=secret,id=ca" in line)
    cached = step + 1 < len(lines) and lines[step + 1].startswith("--> Using cache")
    assert cached or CA_NOTE in image.log, "the dependency step ran without the CA secret mounted"
    data = json.loads(podman("image", "inspect", image.tag).stdout)[0]["GraphDriver"]["Data"]
    layers = [d for d in [data.get("UpperDir", ""), *data.get("LowerDir", "").split(":")] if d]
    assert layers and all(Path(d).is_dir() for d in layers), data
    found = subprocess.run(["grep", "-rlF", "--no-messages", CA_MARKER, *layers], capture_output=True, text=True,
                           timeout=120)
    assert found.returncode == 1, f"the CA secret is in the image: {found.stdout[:2000]}"


def fleet_config(sim: Any) -> dict[str, Any]:
    """The config the container mounts: the engines on the host's loopback, the tokenizer at
    its mount point, no keys (they come from the environment)."""
    backends = [{"name": f"sim-{i}", "url": sim.http(i), "kv_events": sim.kv(i), "kv_replay": sim.replay(i)}
                for i in range(sim.instances)]
    model = {"name": MODEL, "tokenizer": TOKENIZER_MOUNT, "block_size": 16, "hash_algo": "sha256", "hash_seed": "0",
             "vllm_version": "0.33.0", "backends": backends}
    return {"models": [model], "router": {"health_interval_s": 0.5, "expose_decision_headers": True}}


@pytest.fixture
def container(image: Built, sim_fleet: Any, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """The image serving a 2-engine ``kvrouter sim`` on a free loopback port: (name, url); removed always."""
    sim = sim_fleet("--hash-seed", "0", instances=2, model=MODEL)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(fleet_config(sim)))
    config.chmod(0o644)
    port = free_port()
    name = f"kvrouter-test-{uuid.uuid4().hex[:10]}"
    try:
        podman("run", "-d", "--name", name, "--network", "host", "--read-only", "--cap-drop", "all",
               "--security-opt", "no-new-privileges",
               "-v", f"{config}:/etc/kvrouter/config.yaml:ro", "-v", f"{QWEN3_DIR}:{TOKENIZER_MOUNT}:ro",
               "-e", f"KVROUTER_API_KEY={API_KEY}", "-e", f"KVROUTER_ADMIN_API_KEY={ADMIN_KEY}",
               image.tag, "--host", "127.0.0.1", "--port", str(port), "--workers", "2")
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            state = podman("inspect", "--format", "{{.State.Status}}", name).stdout.strip()
            assert state == "running", f"the container is {state}: {podman('logs', name).stderr[-5000:]}"
            assert time.monotonic() < deadline, f"not ready after 120 s: {podman('logs', name).stderr[-5000:]}"
            time.sleep(0.5)
        yield name, url
    finally:
        podman("rm", "-f", "-t", "0", name, check=False)


def chat_body(system: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 8, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": "What is a KV cache?"}], **extra}


def test_the_image_routes_chats_to_a_simulated_fleet(container: tuple[str, str]) -> None:
    name, url = container
    client = {"authorization": f"Bearer {API_KEY}"}
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}
    # A system prompt of several blocks no earlier run sent: the engines start with it uncached.
    system = f"Session {uuid.uuid4().hex}. " + "You answer in one short line, plainly. " * 12
    body = chat_body(system)

    assert httpx.post(url + "/v1/chat/completions", json=body, timeout=30).status_code == 401  # the key from -e counts
    first = httpx.post(url + "/v1/chat/completions", json=body, headers=client, timeout=30)
    assert first.status_code == 200, first.text
    answer = first.json()
    assert answer["choices"][0]["message"]["content"], answer
    backend = first.headers["x-kvrouter-backend"]

    # The engine's KV events reach the router in the container: the next request sharing the
    # prefix is predicted cached there, exactly as many tokens as the engine then reports.
    again = chat_body(system + " Be brief.")
    deadline = time.monotonic() + 15
    while True:
        route = httpx.post(url + "/debug/route", json=again, headers=admin, timeout=10)
        assert route.status_code == 200, route.text
        mine = next(c for c in route.json()["candidates"] if c["backend"] == backend)
        if mine["matched_blocks"] > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    decision = route.json()
    assert decision["backend"] == backend and decision["reason"] == "cache_hit", decision
    second = httpx.post(url + "/v1/chat/completions", json=again, headers=client, timeout=30)
    assert second.status_code == 200 and second.headers["x-kvrouter-backend"] == backend, second.text
    usage = second.json()["usage"]
    assert usage["prompt_tokens"] == decision["num_tokens"], (usage, decision["num_tokens"])
    assert usage["prompt_tokens_details"]["cached_tokens"] == mine["predicted_cached_tokens"] > 0, (usage, mine)

    streamed = httpx.post(url + "/v1/chat/completions", headers=client, timeout=30,
                          json=chat_body(system + " Stream it.", stream=True, stream_options={"include_usage": True}))
    assert streamed.status_code == 200, streamed.text
    events, rest = sse_events(streamed.content)
    assert events[-1] == b"[DONE]" and rest == b"", streamed.content[-500:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]), chunks
    assert chunks[-1]["usage"]["completion_tokens"] > 0, chunks[-1]

    # Every process in the container (the supervisor, its two workers, this probe) runs as the image's user.
    probe = "import os; print(sorted({os.stat('/proc/' + p).st_uid for p in os.listdir('/proc') if p.isdigit()}), " \
            "sum(p.isdigit() for p in os.listdir('/proc')))"
    uids, count = podman("exec", name, "python3", "-c", probe).stdout.rsplit(maxsplit=1)
    assert uids == f"[{UID}]" and int(count) >= 4, (uids, count)

    logs = podman("logs", name)
    access = [json.loads(line) for line in logs.stdout.splitlines() if line.startswith("{")]
    assert [(a["path"], a["status"]) for a in access].count(("/v1/chat/completions", 200)) == 3, logs.stdout[-3000:]

    # SIGTERM reaches the router as PID 1 and drains: an idle router exits 0 at once, long
    # before podman's 30 s would turn to SIGKILL (exit 137).
    started = time.monotonic()
    podman("stop", "-t", "30", name, timeout=60)
    stopped_in = time.monotonic() - started
    exit_code = podman("inspect", "--format", "{{.State.ExitCode}}", name).stdout.strip()
    assert exit_code == "0" and stopped_in < 20, (exit_code, stopped_in, podman("logs", name).stderr[-3000:])
