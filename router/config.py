"""The fleet config file, under the name the router's modules and older callers import.

Its home is :mod:`kvconfig`, below both ``indexer`` and ``router`` in the dependency
order (docs/architecture.md), because ``kvrouter indexer`` and ``kvrouter hash`` read
the same file as the router and ``indexer/`` must not import ``router/``.
"""

from kvconfig import (  # noqa: F401  (re-exported)
    ApiKey,
    Backend,
    Config,
    ConfigError,
    HashAlgo,
    KeysFromEnv,
    KvAwareWeights,
    LoraAdapter,
    Model,
    PolicyName,
    RouterSettings,
    load_config,
    parse_config,
)
