"""deploy/kubernetes: what ``kubectl apply -k`` would create, held to what the router needs.

Each target (the base, and overlays/replicas with components/redis) is rendered by
``kubectl kustomize``, the kustomize a user applies it with; every object must validate
against the Kubernetes 1.30 schemas (the oldest release the manifests claim: the router's
preStop uses the sleep action, beta and on by default from 1.30) with
``kubernetes-validate``, offline and strict, so a misspelt field fails too. Then the
properties that decide whether the router works there are checked against the project's own
code rather than against copies of its values: the container's args parse with the real
``kvrouter serve`` parser and load the mounted ConfigMap through the server's own
``read_config``, the grace period covers ``router.drain_timeout_s`` as that config sets it
plus the server's ``CUT_GRACE_S``, and the Secret's variables are the ones ``KeysFromEnv``
reads. kubectl missing is a failure, never a skip: a skipped test would pass a broken
manifest.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from kvconfig import Config, KeysFromEnv
from router.cli import build_parser
from router.http.server import CUT_GRACE_S, read_config
from support import REPO

KUBERNETES_VERSION = "1.30.0"
"""The schemas every rendered object must validate against: the oldest release the manifests support."""
DEPLOY = REPO / "deploy" / "kubernetes"
TARGETS = {"base": DEPLOY, "replicas": DEPLOY / "overlays" / "replicas"}
"""Every directory a user applies with ``kubectl apply -k`` (the base through its top-level kustomization)."""
SECRET_EXAMPLE = DEPLOY / "secret.example.yaml"
MIN_KUSTOMIZE = (4, 0)
"""Components (components/redis) need kustomize >= 3.7; kubectl carries v4 from 1.21."""
ROUTER, ENGINES = "kvrouter", "vllm"
"""The router's Deployment and the engines' StatefulSet."""

Obj = dict[str, Any]


def kubectl() -> str:
    """kubectl with its built-in kustomize (on PATH, or next to this interpreter: ``make test``
    may download it into .venv/bin), or a failure that says how to get it."""
    exe = shutil.which("kubectl") or shutil.which("kubectl", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.fail("kubectl is not installed: tests/test_kubernetes.py renders deploy/kubernetes with "
                    "`kubectl kustomize` (a static binary from https://dl.k8s.io/release/v1.32.4/bin/linux/amd64/kubectl)")
    out = subprocess.run([exe, "version", "--client", "-o", "json"], capture_output=True, text=True, timeout=30)
    raw = json.loads(out.stdout or "{}").get("kustomizeVersion", "")
    version = tuple(int(p) for p in raw.lstrip("v").split(".")[:2] if p.isdigit())
    if len(version) < 2 or version < MIN_KUSTOMIZE:
        pytest.fail(f"{exe} has kustomize {raw or 'none'}; components need >= {'.'.join(map(str, MIN_KUSTOMIZE))} "
                    "(kubectl >= 1.21)")
    return exe


@dataclass
class Rendered:
    """One target's objects as ``kubectl kustomize`` prints them."""

    name: str
    objects: list[Obj]

    def get(self, kind: str, name: str) -> Obj:
        found = [o for o in self.objects if o["kind"] == kind and o["metadata"]["name"] == name]
        assert len(found) == 1, f"{self.name}: expected one {kind} {name}, found {len(found)}"
        return found[0]

    def of_kind(self, kind: str) -> list[Obj]:
        return [o for o in self.objects if o["kind"] == kind]

    def workloads(self) -> list[Obj]:
        return [o for o in self.objects if o["kind"] in ("Deployment", "StatefulSet")]


def render(target: Path) -> Rendered:
    out = subprocess.run([kubectl(), "kustomize", str(target)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"kubectl kustomize {target} failed:\n{out.stderr}"
    return Rendered(target.name, [o for o in yaml.safe_load_all(out.stdout) if o])


@pytest.fixture(scope="module")
def targets() -> dict[str, Rendered]:
    return {name: render(path) for name, path in TARGETS.items()}


@pytest.fixture(params=list(TARGETS))
def rendered(request: pytest.FixtureRequest, targets: dict[str, Rendered]) -> Rendered:
    return targets[request.param]


def pod(workload: Obj) -> Obj:
    return workload["spec"]["template"]["spec"]


def container(workload: Obj, name: str) -> Obj:
    found = [c for c in pod(workload)["containers"] if c["name"] == name]
    assert len(found) == 1, f"{workload['metadata']['name']} has no container {name}"
    return found[0]


def router_container(r: Rendered) -> Obj:
    return container(r.get("Deployment", ROUTER), "router")


def container_port(c: Obj, port: int | str) -> int:
    """A port given by name or number, as the container declares it."""
    numbers = {p["containerPort"] for p in c.get("ports", [])}
    if isinstance(port, int):
        assert port in numbers, f"port {port} is not one of container {c['name']}'s {sorted(numbers)}"
        return port
    named = [p["containerPort"] for p in c.get("ports", []) if p.get("name") == port]
    assert named, f"container {c['name']} has no port named {port!r}"
    return named[0]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def pod_labels(workload: Obj) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]


def flag(args: list[str], name: str) -> str | None:
    """The value of ``--name VALUE`` or ``--name=VALUE`` in a command line."""
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def env(c: Obj) -> dict[str, Obj]:
    return {e["name"]: e for e in c.get("env", [])}


@dataclass
class Serve:
    """The router's command line parsed by ``kvrouter serve``'s own parser, and the config it serves."""

    args: Any
    config: Config


def serve(r: Rendered, tmp_path: Path) -> Serve:
    """What the router container runs: its args through the real parser, ``--config`` found in the
    mounted ConfigMap and loaded by the server's own ``read_config`` (the CLI's overrides applied)."""
    c = router_container(r)
    assert c.get("command") == ["kvrouter"], f"the router container runs {c.get('command')}, not kvrouter"
    argv = list(c["args"])
    assert argv[:1] == ["serve"], f"the router container's args do not start with serve: {argv}"
    try:
        args = build_parser(argv).parse_args(argv)
    except SystemExit:
        pytest.fail(f"`kvrouter serve` refuses the container's args {argv} (see stderr)")
    path = PurePosixPath(args.config)
    mounts = [m for m in c.get("volumeMounts", []) if PurePosixPath(m["mountPath"]) == path.parent]
    assert mounts, f"--config {path}: nothing is mounted at {path.parent}"
    volume = next(v for v in pod(r.get("Deployment", ROUTER))["volumes"] if v["name"] == mounts[0]["name"])
    assert "configMap" in volume, f"{path.parent} is not a ConfigMap volume: {volume}"
    cm = r.get("ConfigMap", volume["configMap"]["name"])
    assert path.name in cm.get("data", {}), f"ConfigMap {cm['metadata']['name']} has no key {path.name}"
    local = tmp_path / r.name / path.name
    local.parent.mkdir(parents=True, exist_ok=True)
    local.write_text(cm["data"][path.name])
    args.config = str(local)
    return Serve(args, read_config(args))


def test_every_object_validates_against_the_pinned_kubernetes_schemas(rendered: Rendered) -> None:
    kinds = {(o["kind"], o["metadata"]["name"]) for o in rendered.objects}
    for wanted in [("Deployment", ROUTER), ("Service", ROUTER), ("StatefulSet", ENGINES), ("Service", ENGINES)]:
        assert wanted in kinds, f"{rendered.name} renders no {wanted}"
    errors = []
    for o in rendered.objects:
        try:
            kubernetes_validate.validate(o, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            errors.append(f"{o['kind']} {o['metadata']['name']}: {e.message} at {'/'.join(map(str, e.path))}")
    assert not errors, f"{rendered.name} against Kubernetes {KUBERNETES_VERSION}:\n" + "\n".join(errors)
    for w in rendered.workloads():  # the API server's own check, which no schema expresses
        assert selects(w["spec"]["selector"]["matchLabels"], pod_labels(w)), \
            f"{w['kind']} {w['metadata']['name']}: its selector does not match its pod template's labels"


def test_the_router_serves_the_mounted_config_on_its_container_port(rendered: Rendered, tmp_path: Path) -> None:
    """The address the router binds is the one the probes, the Service and the scrape use."""
    s = serve(rendered, tmp_path)
    c = router_container(rendered)
    assert s.config.router.host == "0.0.0.0", "the router must listen on the pod's address, not loopback"
    assert s.config.router.port == container_port(c, "http"), "the router listens elsewhere than its port 'http'"
    svc = rendered.get("Service", ROUTER)
    assert selects(svc["spec"]["selector"], pod_labels(rendered.get("Deployment", ROUTER))), "the Service selects no router pod"
    for p in svc["spec"]["ports"]:
        assert container_port(c, p["targetPort"]) == s.config.router.port
    notes = svc["metadata"].get("annotations", {})
    assert notes.get("prometheus.io/scrape") == "true"
    assert notes.get("prometheus.io/path") == "/metrics"
    assert notes.get("prometheus.io/port") == str(s.config.router.port), "Prometheus would scrape another port"


def test_probes_ask_livez_and_readyz_on_the_router_port(rendered: Rendered, tmp_path: Path) -> None:
    """/livez restarts a stuck process; /readyz takes a draining router, or one with no healthy
    engine for some model, out of the Service. The startup probe covers the tokenizer's load
    before the port opens, which a liveness probe alone would kill."""
    c = router_container(rendered)
    port = serve(rendered, tmp_path).config.router.port
    for probe, path in [("livenessProbe", "/livez"), ("readinessProbe", "/readyz"), ("startupProbe", "/livez")]:
        get = c.get(probe, {}).get("httpGet")
        assert get is not None, f"the router has no HTTP {probe}"
        assert get["path"] == path, f"{probe} asks {get['path']}, not {path}"
        assert container_port(c, get["port"]) == port, f"{probe} asks port {get['port']}, the router listens on {port}"


def prestop_sleep_s(c: Obj) -> int:
    pre = c.get("lifecycle", {}).get("preStop", {})
    if "sleep" in pre:
        return int(pre["sleep"]["seconds"])
    cmd = pre.get("exec", {}).get("command", [])
    return int(cmd[-1]) if cmd[:1] == ["sleep"] else 0


def test_the_grace_period_covers_prestop_drain_and_the_cut(rendered: Rendered, tmp_path: Path) -> None:
    """Kubernetes kills the pod terminationGracePeriodSeconds after it starts terminating,
    preStop included: the router must get through the preStop sleep (endpoints dropping the
    pod), its drain (``router.drain_timeout_s`` of the mounted config) and the time its cut
    answers take to reach clients (``CUT_GRACE_S``), or in-flight streams die mid-answer."""
    c = router_container(rendered)
    drain = serve(rendered, tmp_path).config.router.drain_timeout_s
    sleep = prestop_sleep_s(c)
    assert sleep >= 1, "without a preStop sleep, new connections still arrive after SIGTERM closed the port"
    grace = pod(rendered.get("Deployment", ROUTER)).get("terminationGracePeriodSeconds", 30)
    need = sleep + drain + CUT_GRACE_S
    assert grace >= need, f"terminationGracePeriodSeconds {grace} < preStop {sleep} + drain {drain:g} + cut {CUT_GRACE_S:g}"


def test_the_router_runs_as_non_root_on_a_read_only_root(rendered: Rendered) -> None:
    spec = pod(rendered.get("Deployment", ROUTER))
    sc = {**spec.get("securityContext", {}), **router_container(rendered).get("securityContext", {})}
    assert sc.get("runAsNonRoot") is True
    assert isinstance(sc.get("runAsUser"), int) and sc["runAsUser"] > 0, "runAsNonRoot needs a numeric non-zero uid"
    assert sc.get("readOnlyRootFilesystem") is True
    assert sc.get("allowPrivilegeEscalation") is False
    assert "ALL" in sc.get("capabilities", {}).get("drop", [])
    assert sc.get("seccompProfile", {}).get("type") == "RuntimeDefault"
    assert spec.get("automountServiceAccountToken") is False, "the router needs no Kubernetes API token"


def test_every_path_the_router_writes_is_a_writable_volume(rendered: Rendered) -> None:
    """On a read-only root the router still writes: temporary files in /tmp, the workers'
    fleet-state ring and metrics in /dev/shm (router/http/workers.py), and a hub tokenizer's
    download in HF_HOME. Each must be a writable emptyDir."""
    c = router_container(rendered)
    hf_home = env(c).get("HF_HOME", {}).get("value")
    assert hf_home, "HF_HOME is unset: a hub tokenizer would be written under the read-only root"
    volumes = {v["name"]: v for v in pod(rendered.get("Deployment", ROUTER))["volumes"]}
    for path in ["/tmp", "/dev/shm", hf_home]:
        mounts = [m for m in c.get("volumeMounts", []) if PurePosixPath(path).is_relative_to(m["mountPath"])]
        assert mounts, f"{path} is on the read-only root filesystem"
        mount = max(mounts, key=lambda m: len(m["mountPath"]))
        assert not mount.get("readOnly"), f"{path} is mounted read-only"
        assert "emptyDir" in volumes[mount["name"]], f"{path} is not on an emptyDir"


def test_resources_are_bounded(rendered: Rendered) -> None:
    """Requests and limits on CPU and memory: the router's default worker count is the CPU
    limit (router/http/workers.py reads the cgroup quota), and without a memory limit every
    worker's index could grow into the node's memory."""
    resources = router_container(rendered).get("resources", {})
    for kind in ("requests", "limits"):
        for what in ("cpu", "memory"):
            assert what in resources.get(kind, {}), f"the router has no {what} {kind[:-1]}"


def test_keys_come_from_the_secret_under_the_names_the_router_reads(
        rendered: Rendered, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every key variable the router reads (``KeysFromEnv``) comes from the Secret, never from a
    literal; the client and admin keys are required, so a pod without the Secret does not start
    open. The variables are then set as the Secret would set them, and the router's own loader
    must take each one."""
    c = router_container(rendered)
    wanted = {f"{KeysFromEnv.model_config['env_prefix']}{f}".upper() for f in KeysFromEnv.model_fields}
    variables = env(c)
    missing = wanted - set(variables)
    assert not missing, f"the router container does not set {sorted(missing)}"
    secret = yaml.safe_load(SECRET_EXAMPLE.read_text())
    kubernetes_validate.validate(secret, KUBERNETES_VERSION, strict=True)
    for name in sorted(wanted):
        ref = variables[name].get("valueFrom", {}).get("secretKeyRef")
        assert ref is not None, f"{name} is not read from a Secret"
        assert ref["name"] == secret["metadata"]["name"], f"{name} names Secret {ref['name']}"
        assert ref["key"] in secret["stringData"], f"{name} reads key {ref['key']}, which {SECRET_EXAMPLE.name} lacks"
        if name not in ("KVROUTER_BACKEND_API_KEY", "KVROUTER_SALT_SECRET"):  # neither one opens a door
            assert not ref.get("optional"), f"{name} is optional: without the Secret the router would start open"
    for name in wanted:
        monkeypatch.delenv(name, raising=False)
    alone = serve(rendered, tmp_path).config
    assert alone.router.api_key is None and alone.router.admin_api_key is None, "a key is written in the ConfigMap"
    values = {name: f"key-{i}" for i, name in enumerate(sorted(wanted))}
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    config = serve(rendered, tmp_path).config
    assert config.router.api_key and config.router.api_key.get_secret_value() == values["KVROUTER_API_KEY"]
    assert config.router.admin_api_key and config.router.admin_api_key.get_secret_value() == values["KVROUTER_ADMIN_API_KEY"]
    for m in config.models:
        for b in m.backends + discovered(m):
            assert b.api_key and b.api_key.get_secret_value() == values["KVROUTER_BACKEND_API_KEY"]


def discovered(model: Any, addresses: tuple[str, ...] = ("10.0.0.7",)) -> list[Any]:
    """The backends the router makes of a lookup's addresses for ``model`` (none without discovery)."""
    from router.fleet.discovery import Follower, backends

    if model.discovery is None:
        return []
    return backends(model.discovery, list(addresses), Follower(model.name, model.discovery, apply=None).api_key)  # type: ignore[arg-type]


def engine_args(r: Rendered) -> tuple[Obj, list[str]]:
    c = container(r.get("StatefulSet", ENGINES), "vllm")
    return c, [*c.get("command", []), *c.get("args", [])]


def zmq_port(endpoint: str) -> int:
    return int(endpoint.rpartition(":")[2])


def test_the_config_hashes_as_the_engines_do(rendered: Rendered, tmp_path: Path) -> None:
    """The router recomputes vLLM's block hashes: every setting that changes them must be the
    engines' own (README, "Quick start: a real vLLM fleet"), or no prefix ever matches."""
    config = serve(rendered, tmp_path).config
    c, argv = engine_args(rendered)
    assert argv[:2] == ["vllm", "serve"], f"the engines run {argv[:2]}"
    assert "--enable-prefix-caching" in argv
    (model,) = config.models
    assert flag(argv, "--served-model-name") == model.name
    assert flag(argv, "--block-size") == str(model.block_size)
    assert flag(argv, "--prefix-caching-hash-algo") == model.hash_algo
    assert env(c).get("PYTHONHASHSEED", {}).get("value") == model.hash_seed
    assert c["image"].rpartition(":")[2] == f"v{model.vllm_version}", "the engines' image is another vLLM version"
    events = json.loads(flag(argv, "--kv-events-config") or "{}")
    assert events.get("enable_kv_cache_events") is True and events.get("publisher") == "zmq"
    for key in ("endpoint", "replay_endpoint"):
        assert events.get(key, "").startswith("tcp://*:"), f"{key} {events.get(key)!r}: vLLM binds only on '*'"
    assert pod(rendered.get("StatefulSet", ENGINES)).get("enableServiceLinks") is False, \
        "a Service's VLLM_PORT=tcp://... variable stops vLLM at start"


def test_the_backends_are_the_engine_pods(rendered: Rendered, tmp_path: Path) -> None:
    """The engines are the StatefulSet's pods, found through the headless Service that selects
    them (one address per ready pod), on the ports each serves HTTP, events and replays on."""
    config = serve(rendered, tmp_path).config
    sts = rendered.get("StatefulSet", ENGINES)
    c, argv = engine_args(rendered)
    svc = rendered.get("Service", sts["spec"]["serviceName"])
    assert svc["spec"].get("clusterIP") == "None", "pod DNS names need a headless Service"
    assert selects(svc["spec"]["selector"], pod_labels(sts)), "the headless Service selects no engine pod"
    events = json.loads(flag(argv, "--kv-events-config") or "{}")
    http = int(flag(argv, "--port") or 8000)
    assert http == container_port(c, "http")
    (model,) = config.models
    assert model.discovery is not None and model.discovery.dns == svc["metadata"]["name"], \
        "discovery does not ask the engines' headless Service"
    for b in discovered(model, ("10.0.0.7", "10.0.0.8")):
        assert urlsplit(b.url).port == http
        assert b.kv_events and b.kv_replay, f"backend {b.name} has no KV-event stream: the router would route blind"
        assert b.kv_events.startswith(f"tcp://{urlsplit(b.url).hostname}:")
        assert zmq_port(b.kv_events) == zmq_port(events["endpoint"])
        assert zmq_port(b.kv_replay) == zmq_port(events["replay_endpoint"])
    for port in (http, zmq_port(events["endpoint"]), zmq_port(events["replay_endpoint"])):
        container_port(c, port)


def matches(selector: Obj, labels: dict[str, str]) -> bool:
    """A NetworkPolicy's label selector (``matchLabels``; empty selects every pod)."""
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def admits(policy: Obj, source: dict[str, str], port: int) -> bool:
    """Whether a NetworkPolicy lets a pod with labels ``source`` (same namespace) reach ``port``."""
    for rule in policy["spec"].get("ingress", []):
        ports = rule.get("ports")
        if ports and port not in [p.get("port") for p in ports]:
            continue
        peers = rule.get("from")
        if not peers or any("podSelector" in p and "namespaceSelector" not in p and matches(p["podSelector"], source)
                            for p in peers):
            return True
    return False


def test_network_policies_admit_the_router_and_no_one_else_to_private_ports(rendered: Rendered, tmp_path: Path) -> None:
    """The KV-event sockets and the Redis hold every block hash the fleet caches (README,
    Security), unauthenticated: only the router's pods may reach them, and the router must
    reach them, or it routes blind."""
    config = serve(rendered, tmp_path).config
    router = pod_labels(rendered.get("Deployment", ROUTER))
    stranger = {"app.kubernetes.io/name": "stranger"}
    backend = discovered(config.models[0])[0]
    engines = rendered.get("StatefulSet", ENGINES)
    reached = [(engines, urlsplit(backend.url).port or 80, False)]
    reached += [(engines, zmq_port(e), True) for e in (backend.kv_events or "", backend.kv_replay or "")]
    if (url := config.fleet_state_url()) is not None:
        reached.append((rendered.get("Deployment", urlsplit(url).hostname or ""), urlsplit(url).port or 6379, True))
    for workload, port, private in reached:
        name = workload["metadata"]["name"]
        policies = [p for p in rendered.of_kind("NetworkPolicy") if matches(p["spec"]["podSelector"], pod_labels(workload))]
        assert policies or not private, f"no NetworkPolicy covers {name}: port {port} is open to every pod"
        assert not policies or any(admits(p, router, port) for p in policies), f"the router cannot reach {name}:{port}"
        if private:
            assert not any(admits(p, stranger, port) for p in policies), f"any pod can reach {name}:{port}"


def without_fleet_state(config: Config) -> dict[str, Any]:
    return {**config.model_dump(mode="json"), "router": {**config.router.model_dump(mode="json"), "fleet_state": None}}


def test_replicas_share_their_state_through_the_redis_of_the_overlay(targets: dict[str, Rendered], tmp_path: Path) -> None:
    """Two routers route as one only through ``router.fleet_state``: the overlay's config must
    point it at the Redis the component runs, and otherwise be the base's config (the two
    files are copies: this is what keeps them so)."""
    base, replicas = targets["base"], targets["replicas"]
    one = serve(base, tmp_path).config
    many = serve(replicas, tmp_path).config
    assert one.fleet_state_url() is None, "the base's single router points at a Redis it does not run"
    assert replicas.get("Deployment", ROUTER)["spec"]["replicas"] >= 2
    url = many.fleet_state_url()
    assert url is not None, "the replicas share no state: each would route on its own requests only"
    svc = replicas.get("Service", urlsplit(url).hostname or "")
    assert (urlsplit(url).port or 6379) in [p["port"] for p in svc["spec"]["ports"]]
    redis = replicas.get("Deployment", svc["metadata"]["name"])
    assert selects(svc["spec"]["selector"], pod_labels(redis)), "the Redis Service selects no Redis pod"
    assert without_fleet_state(one) == without_fleet_state(many), \
        "components/redis/config.yaml differs from base/config.yaml beyond router.fleet_state"
    pdb = replicas.get("PodDisruptionBudget", ROUTER)
    assert selects(pdb["spec"]["selector"]["matchLabels"], pod_labels(replicas.get("Deployment", ROUTER)))
