"""Routing policies: one module each, behind :class:`router.policies.base.Policy`."""

from __future__ import annotations

from router.config import Config, Model, PolicyName, RouterSettings
from router.policies.approx_index import ApproxPrefixIndex
from router.policies.base import Policy
from router.policies.shares import Shares

EXACT_STATE_POLICIES = ("oracle", "kv_aware+exact_load", "kv_aware+exact_cache", "kv_aware+exact")
"""Policies that read each engine's exact state through the simulator's side channel
(:mod:`router.policies.oracle`): the bench's reference, never a way to route real engines."""


def memory_ttl(name: PolicyName, settings: RouterSettings) -> float:
    """How long policy ``name`` remembers where the router sent a prefix (0: it does not)."""
    if name == "prefix_approx":
        return settings.prefix_ttl_s
    if name == "kv_aware" or name.startswith("kv_aware+"):
        return settings.weights.speculative_ttl_s
    return 0.0


def make_policy(name: PolicyName, config: Config, model: Model | None = None, memory: ApproxPrefixIndex | None = None,
                shares: Shares | None = None) -> Policy:
    """A fresh policy instance for ``model`` (the exact-state policies ask its backends),
    with the model's prefix memory and request share: collaborators the router also
    feeds the other processes' decisions into (:mod:`router.fleet.log`). Fresh ones when
    not given."""
    settings = config.router
    if memory is None:
        memory = ApproxPrefixIndex(memory_ttl(name, settings), settings.prefix_max_blocks)
    if shares is None:
        shares = Shares(settings.weights.share_window)
    if name in EXACT_STATE_POLICIES:
        from router.policies.engine_state import SideChannel
        from router.policies.oracle import KvAwareExact, Oracle

        if model is None:
            raise ValueError(f"policy {name} needs the model whose backends it asks")
        channel = SideChannel({b.name: b.url for b in model.backends})
        if name == "oracle":
            return Oracle(channel)
        return KvAwareExact(settings.weights, memory, shares, channel,
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

        return PrefixApprox(memory, settings.weights)
    if name == "kv_aware":
        from router.policies.kv_aware import KvAware

        return KvAware(settings.weights, memory, shares)
    raise ValueError(f"unknown policy {name!r}")
