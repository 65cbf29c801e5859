"""The example configs in configs/ are what operators copy: each must load, and say what
its comments say.

Each file's header gives the commands that start its engines (``kvrouter sim`` for the
demo fleet, ``vllm serve`` for the real ones); the router must be told exactly the
settings those engines run with, or its block hashes match nothing. The tests read the
commands from the headers and hold the configs to them.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import shlex
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from kvconfig import Backend, KvAwareWeights
from loadtest.sim.cli import configure as configure_sim
from loadtest.sim.fleet import instance_specs
from kvconfig import ConfigError, load_config, parse_config
from support import REPO

EXAMPLES = sorted((REPO / "configs").glob("*.yaml"))
REAL_FLEETS = [REPO / "configs" / "vllm-fleet.yaml", REPO / "configs" / "indexer-redis.yaml"]


def header_command(path: Path, start: str) -> list[str]:
    """The shell command in ``path``'s comment header that begins with ``start``, its
    continuation lines (a trailing backslash, or an open quote) joined."""
    lines = [line.removeprefix("#").strip() for line in path.read_text().splitlines() if line.startswith("#")]
    first = next(i for i, line in enumerate(lines) if start in line)
    text = lines[first][lines[first].index(start):]
    for line in lines[first + 1:]:
        if text.endswith("\\"):
            text = text[:-1] + " " + line
        elif text.count("'") % 2:
            text += " " + line
        else:
            break
    return shlex.split(text)


def zmq_host_port(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    return host, int(port)


def rank_sockets(b: Backend) -> list[tuple[str, int]]:
    """Every (host, port) a backend's engines listen on: HTTP, and the event and replay
    sockets of each data-parallel rank (rank r takes the configured port + r)."""
    url = urlsplit(b.url)
    out = [(url.hostname or "", url.port or 80)]
    for endpoint in (b.kv_events, b.kv_replay):
        if endpoint is not None:
            host, port = zmq_host_port(endpoint)
            out += [(host, port + r) for r in range(b.data_parallel_size)]
    return out


def test_there_are_example_configs() -> None:
    assert {p.name for p in EXAMPLES} >= {"demo-fleet.yaml", "vllm-fleet.yaml", "indexer-redis.yaml"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_no_two_engine_sockets_collide_across_data_parallel_ranks(path: Path) -> None:
    """A DP engine's rank r publishes on the event port + r and replays on the replay port
    + r: two base ports closer than ``data_parallel_size`` make rank 1 bind rank 0's replay."""
    config = load_config(path)
    sockets = [s for m in config.models for b in m.backends for s in rank_sockets(b)]
    assert len(sockets) == len(set(sockets)), sorted(sockets)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_engine_event_sockets_are_on_private_addresses(path: Path) -> None:
    """The ZMQ event and replay sockets are unauthenticated: an example must not teach
    exposing them."""
    config = load_config(path)
    endpoints = [e for m in config.models for b in m.backends for e in (b.kv_events, b.kv_replay) if e]
    assert endpoints
    for endpoint in endpoints:
        address = ipaddress.ip_address(zmq_host_port(endpoint)[0])
        assert address.is_loopback or (address.is_private and not address.is_unspecified), endpoint


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_no_example_config_carries_a_key(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Configs get committed; keys come from the environment (kvconfig.KeysFromEnv)."""
    for var in ("KVROUTER_API_KEY", "KVROUTER_ADMIN_API_KEY", "KVROUTER_BACKEND_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    config = load_config(path)
    assert config.router.api_key is None and config.router.admin_api_key is None
    assert all(b.api_key is None for m in config.models for b in m.backends)


def test_demo_fleet_is_where_its_sim_command_puts_the_engines() -> None:
    path = REPO / "configs" / "demo-fleet.yaml"
    config = load_config(path)
    parser = argparse.ArgumentParser()
    configure_sim(parser)
    cmd = header_command(path, "kvrouter sim")
    sim = parser.parse_args(cmd[2:])
    [model] = config.models
    assert (model.name, model.tokenizer, model.hash_seed) == (sim.model, sim.tokenizer, sim.hash_seed)
    assert (model.block_size, model.hash_algo, model.vllm_version) == (sim.block_size, sim.hash_algo, sim.vllm_version)
    assert (REPO / model.tokenizer).is_dir()
    specs = instance_specs(sim.host, sim.host, sim.port, sim.kv_events_port, sim.replay_port, sim.instances)
    engines = [(f"http://{s.host}:{s.port}", f"tcp://{s.host}:{s.kv_events_port}", f"tcp://{s.host}:{s.replay_port}")
               for s in specs]
    assert [(b.url, b.kv_events, b.kv_replay) for b in model.backends] == engines
    assert config.router.port not in {s.port for s in specs}


def test_demo_fleet_shows_the_default_weights() -> None:
    """README points at the demo config for the kv_aware weights' defaults."""
    assert load_config(REPO / "configs" / "demo-fleet.yaml").router.weights == KvAwareWeights()


@pytest.mark.parametrize("path", REAL_FLEETS, ids=lambda p: p.name)
def test_real_fleet_config_tells_the_router_the_engines_settings(path: Path) -> None:
    """The ``vllm serve`` line in the header against the model's hashing settings, adapters,
    and the backends started with exactly that line (its event port)."""
    config = load_config(path)
    cmd = header_command(path, "PYTHONHASHSEED=")
    seed = cmd[0].removeprefix("PYTHONHASHSEED=")
    assert cmd[1:3] == ["vllm", "serve"]
    flags = argparse.ArgumentParser()
    for flag in ("--served-model-name", "--block-size", "--prefix-caching-hash-algo", "--lora-modules",
                 "--kv-events-config", "--port"):
        flags.add_argument(flag)
    flags.add_argument("--data-parallel-size", type=int, default=1)
    flags.add_argument("--enable-prefix-caching", action="store_true")
    flags.add_argument("--enable-lora", action="store_true")
    engine = flags.parse_args(cmd[4:])
    [model] = config.models
    assert model.name == (engine.served_model_name or cmd[3])
    assert (model.hash_seed, model.block_size, model.hash_algo) == (seed, int(engine.block_size), engine.prefix_caching_hash_algo)
    if engine.lora_modules:
        assert {a.name: a.path for a in model.lora_adapters} == dict([engine.lora_modules.split("=", 1)])
    events = json.loads(engine.kv_events_config)
    event_port, replay_port = (zmq_host_port(events[k])[1] for k in ("endpoint", "replay_endpoint"))
    started = [b for b in model.backends if b.kv_events and zmq_host_port(b.kv_events)[1] == event_port]
    assert started, "no backend uses the command's event port"
    for b in started:
        assert b.kv_replay is not None and zmq_host_port(b.kv_replay)[1] == replay_port, b.name
        assert b.data_parallel_size == engine.data_parallel_size, b.name
        assert engine.port is None or urlsplit(b.url).port == int(engine.port), b.name


def test_unknown_key_is_rejected_by_name() -> None:
    raw = {"models": [{"name": "m", "tokenizer": "t", "backends": [{"name": "b", "url": "http://h:1"}], "blok_size": 16}]}
    with pytest.raises(ConfigError, match="blok_size"):
        parse_config(raw)


@pytest.mark.parametrize("bad", ["", "a\nb"])
def test_an_empty_or_multi_line_index_namespace_is_rejected_by_name(bad: str) -> None:
    raw = {"models": [{"name": "m", "tokenizer": "t", "backends": [{"name": "b", "url": "http://h:1"}]}],
           "index_namespace": bad}
    with pytest.raises(ConfigError, match="index_namespace"):
        parse_config(raw)
