"""Routing policies: one module each, behind :class:`router.policies.base.Policy`, built by name.

The router offers the policies of :data:`kvconfig.POLICIES`. Others plug in through
:func:`register`, from a module named in the ``KVROUTER_POLICY_MODULES`` variable (comma
separated, imported at start): that is how the bench adds its oracle and the
``kv_aware+exact*`` ablations (:mod:`loadtest.policies`), which read the simulator's exact
state and never route real engines.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass

import kvconfig
from kvconfig import Config, Model, RouterSettings
from router.policies.approx_index import ApproxPrefixIndex
from router.policies.base import Policy
from router.tuning import Tuning


@dataclass(frozen=True, slots=True)
class Parts:
    """What a policy is built from: the config, its model, and the model's prefix memory (which
    the router also feeds every process's decisions into: :mod:`router.fleet.log`)."""

    config: Config
    model: Model | None
    memory: ApproxPrefixIndex
    tuning: Tuning


@dataclass(frozen=True, slots=True)
class Entry:
    build: Callable[[Parts], Policy]
    memory_ttl: Callable[[RouterSettings, Tuning], float] = lambda _s, _t: 0.0
    """How long the policy remembers where the router sent a prefix (0: it does not)."""


_REGISTRY: dict[str, Entry] = {}


def register(name: str, entry: Entry) -> None:
    """Offer policy ``name`` (a config may then name it)."""
    _REGISTRY[name] = entry
    kvconfig.POLICY_NAMES.add(name)


def load_plugins() -> None:
    """Import the modules ``KVROUTER_POLICY_MODULES`` names (each calls :func:`register`)."""
    for module in filter(None, (m.strip() for m in os.environ.get("KVROUTER_POLICY_MODULES", "").split(","))):
        importlib.import_module(module)


def offered() -> list[str]:
    """Every policy a config may name, the router's own first."""
    return [*kvconfig.POLICIES, *sorted(set(_REGISTRY) - set(kvconfig.POLICIES))]


def memory_ttl(name: str, settings: RouterSettings, tuning: Tuning) -> float:
    return _REGISTRY[name].memory_ttl(settings, tuning)


def make_policy(name: str, config: Config, model: Model | None = None, memory: ApproxPrefixIndex | None = None,
                tuning: Tuning | None = None) -> Policy:
    """A fresh policy instance for ``model``, with the model's prefix memory (a fresh one when
    not given)."""
    entry = _REGISTRY.get(name)
    if entry is None:
        raise ValueError(f"unknown policy {name!r}; one of {', '.join(sorted(_REGISTRY))}")
    settings = config.router
    tuning = tuning or Tuning()
    if memory is None:
        memory = ApproxPrefixIndex(entry.memory_ttl(settings, tuning), tuning.prefix_max_blocks)
    return entry.build(Parts(config, model, memory, tuning))


def _round_robin(_: Parts) -> Policy:
    from router.policies.round_robin import RoundRobin

    return RoundRobin()


def _random(_: Parts) -> Policy:
    from router.policies.random import RandomPolicy

    return RandomPolicy()


def _least_loaded(_: Parts) -> Policy:
    from router.policies.least_loaded import LeastLoaded

    return LeastLoaded()


def _power_of_two(_: Parts) -> Policy:
    from router.policies.power_of_two import PowerOfTwo

    return PowerOfTwo()


def _session(_: Parts) -> Policy:
    from router.policies.session import SessionAffinity

    return SessionAffinity()


def _prefix_approx(p: Parts) -> Policy:
    from router.policies.prefix_approx import PrefixApprox

    return PrefixApprox(p.memory, p.tuning.kv_aware)


def _kv_aware(p: Parts) -> Policy:
    from router.policies.kv_aware import KvAware

    return KvAware(p.config.router.weights, p.memory, p.tuning.kv_aware)


def speculative_ttl(_: RouterSettings, tuning: Tuning) -> float:
    return tuning.kv_aware.speculative_ttl_s


for _name, _entry in {
    "round_robin": Entry(_round_robin),
    "random": Entry(_random),
    "least_loaded": Entry(_least_loaded),
    "power_of_two": Entry(_power_of_two),
    "session": Entry(_session),
    "prefix_approx": Entry(_prefix_approx, lambda _, t: t.prefix_ttl_s),
    "kv_aware": Entry(_kv_aware, speculative_ttl),
}.items():
    register(_name, _entry)
assert set(_REGISTRY) == set(kvconfig.POLICIES), "router.policies builds exactly kvconfig.POLICIES"
