"""Routing policies: one module each, behind :class:`router.policies.base.Policy`."""

from __future__ import annotations

from router.config import Config, Model, PolicyName
from router.policies.base import Policy

EXACT_STATE_POLICIES = ("oracle", "kv_aware+exact_load", "kv_aware+exact_cache", "kv_aware+exact")
"""Policies that read each engine's exact state through the simulator's side channel
(:mod:`router.policies.oracle`): the bench's reference, never a way to route real engines."""


def make_policy(name: PolicyName, config: Config, model: Model | None = None) -> Policy:
    """A fresh policy instance (policies keep per-model state: counters, prefix trees) for
    ``model`` (the exact-state policies ask its backends)."""
    settings = config.router
    if name in EXACT_STATE_POLICIES:
        from router.policies.engine_state import SideChannel
        from router.policies.oracle import KvAwareExact, Oracle

        if model is None:
            raise ValueError(f"policy {name} needs the model whose backends it asks")
        channel = SideChannel({b.name: b.url for b in model.backends})
        if name == "oracle":
            return Oracle(channel)
        return KvAwareExact(settings.weights, settings.prefix_max_blocks, channel,
                            load=name != "kv_aware+exact_cache", cache=name != "kv_aware+exact_load")
    if name == "round_robin":
        from router.policies.round_robin import RoundRobin

        return RoundRobin()
    if name == "random":
        from router.policies.random import RandomPolicy

        return RandomPolicy()
    if name == "least_loaded":
        from router.policies.least_loaded import LeastLoaded

        return LeastLoaded()
    if name == "power_of_two":
        from router.policies.power_of_two import PowerOfTwo

        return PowerOfTwo()
    if name == "session":
        from router.policies.session import SessionAffinity

        return SessionAffinity()
    if name == "prefix_approx":
        from router.policies.prefix_approx import PrefixApprox

        return PrefixApprox(settings.prefix_ttl_s, settings.prefix_max_blocks, settings.weights)
    if name == "kv_aware":
        from router.policies.kv_aware import KvAware

        return KvAware(settings.weights, settings.prefix_max_blocks)
    raise ValueError(f"unknown policy {name!r}")
