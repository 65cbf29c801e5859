"""The bench's policies, which read each simulated engine's exact state (never a way to route
real engines): ``oracle`` and the ``kv_aware+exact*`` ablations (:mod:`loadtest.policies.oracle`).

Importing this module registers them with the router (:func:`router.policies.register`); the
bench's routers import it through ``KVROUTER_POLICY_MODULES`` (:data:`loadtest.fleet.LAB_POLICIES`).
"""

from __future__ import annotations

from router.policies import Entry, Parts, register, speculative_ttl
from router.policies.base import Policy

EXACT_STATE_POLICIES = ("oracle", "kv_aware+exact_load", "kv_aware+exact_cache", "kv_aware+exact")


def _build(name: str, p: Parts) -> Policy:
    from loadtest.policies.engine_state import SideChannel
    from loadtest.policies.oracle import KvAwareExact, Oracle

    if p.model is None:
        raise ValueError(f"policy {name} needs the model whose backends it asks")
    channel = SideChannel({b.name: b.url for b in p.model.backends})
    if name == "oracle":
        return Oracle(channel)
    return KvAwareExact(p.config.router.weights, p.memory, channel, tuning=p.tuning.kv_aware,
                        load=name != "kv_aware+exact_cache", cache=name != "kv_aware+exact_load")


for _name in EXACT_STATE_POLICIES:
    register(_name, Entry(lambda p, n=_name: _build(n, p), speculative_ttl if _name != "oracle" else lambda _s, _t: 0.0))
