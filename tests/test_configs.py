"""The example configs in configs/ are what operators copy: each must load as it is."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.config import ConfigError, load_config, parse_config
from support import REPO

EXAMPLES = sorted((REPO / "configs").glob("*.yaml"))


def test_there_are_example_configs() -> None:
    assert {p.name for p in EXAMPLES} >= {"demo-fleet.yaml", "vllm-fleet.yaml", "indexer-redis.yaml"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_config_loads(path: Path) -> None:
    config = load_config(path)
    assert config.models and all(m.backends for m in config.models)


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
