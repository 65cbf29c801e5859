"""Routing policies: one module each, behind :class:`router.policies.base.Policy`."""

from __future__ import annotations

from router.config import Config, PolicyName
from router.policies.base import Policy


def make_policy(name: PolicyName, config: Config) -> Policy:
    """A fresh policy instance (policies keep per-model state: counters, prefix trees)."""
    settings = config.router
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
