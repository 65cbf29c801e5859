"""Stage 2 of the request path, *resolve model*: a served name to the model it runs on.

:class:`ModelRuntime` is everything one configured model needs on the hot path (hasher,
hash cache, policy, tokenizer, probe, history memo), built once at start-up so a request
does no set-up. A LoRA adapter's name resolves to its base model's runtime and the
adapter's hashing key (``lora``): same backends, different block hashes.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

from indexer.hashing import BlockHasher
from router.prompt.cold import HeadProbe
from kvconfig import Config, Model
from router.http.errors import BadRequest, PromptTooLong, UnknownModel
from router.prompt.hash_cache import HashCache
from router.prompt.history import HistoryMemo
from router.policies import make_policy, memory_ttl
from router.policies.approx_index import ApproxPrefixIndex
from router.tuning import Tuning
from router.policies.base import Policy, PrefixMemory, ReadsEngineState
from router.prompt.prompt_fields import TokenizeError
from router.prompt.remote_tokenize import ParityGuard, RemoteTokenizer
from router.prompt.tokenize import PromptTokenizer, load_tokenizer

log = logging.getLogger(__name__)


@dataclass
class ModelRuntime:
    """Everything one served model needs on the hot path, built once at start-up."""

    config: Model
    hasher: BlockHasher
    hash_cache: HashCache
    policy: Policy
    guard: ParityGuard
    remote: RemoteTokenizer
    backends: list[str]
    tier_weights: dict[str, float]
    tokenizer: PromptTokenizer | None = None
    probe: HeadProbe | None = None
    tokenizer_error: str | None = None
    max_model_len: int | None = None
    lora: dict[str, dict[str, Any]] = field(default_factory=dict)
    has_events: bool = False
    prefixes: ApproxPrefixIndex | None = None
    """Where the router sent prefixes lately, as the policy was built with it (every
    process's decisions are folded into it: :mod:`router.fleet.log`)."""
    memory: PrefixMemory | None = None
    """The policy itself when it remembers its decisions by prefix (kv_aware, prefix_approx)."""
    history: HistoryMemo | None = None
    """Block keys of chat histories already tokenized (:attr:`router.tuning.Tuning.history_memo`)."""
    engines: ReadsEngineState | None = None
    """The policy itself when it reads the engines' exact state (the bench's oracle, simulator only)."""

    def __post_init__(self) -> None:
        if isinstance(self.policy, PrefixMemory):
            self.memory = self.policy
        if isinstance(self.policy, ReadsEngineState):
            self.engines = self.policy

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def local(self) -> bool:
        """Whether prompts are tokenized here (else by a backend's ``/tokenize``)."""
        return self.tokenizer is not None and self.guard.mode != "remote"


class Models:
    """The configured models by name, and every served name (adapters too) to its runtime."""

    def __init__(self, config: Config, tuning: Tuning | None = None) -> None:
        settings = config.router
        tuning = tuning or Tuning()
        self.segment_cache_tokens = tuning.segment_cache_tokens
        k = tuning.kv_aware
        self.runtimes: dict[str, ModelRuntime] = {}
        self.served: dict[str, tuple[ModelRuntime, dict[str, Any] | None]] = {}
        for m in config.models:
            hasher = BlockHasher(m.hash_algo, m.block_size, m.hash_seed, m.vllm_version)
            name = m.policy or settings.policy
            prefixes = ApproxPrefixIndex(memory_ttl(name, settings, tuning), tuning.prefix_max_blocks)
            rt = ModelRuntime(
                config=m,
                hasher=hasher,
                hash_cache=HashCache(hasher, tuning.hash_cache_blocks, m.name),
                policy=make_policy(name, config, m, prefixes, tuning=tuning),
                guard=ParityGuard(m.name, m.tokenizer_mode, tuning.parity_sample_rate),
                remote=RemoteTokenizer(m.name),
                backends=[b.name for b in m.backends],
                tier_weights={"GPU": 1.0, "CPU": k.cpu_tier, "STORAGE": k.storage_tier, "DISK": k.storage_tier},
                max_model_len=m.max_model_len,
                has_events=any(b.kv_events for b in m.backends),
                prefixes=prefixes,
            )
            if tuning.history_memo and tuning.defer_cold_prompts:
                rt.history = HistoryMemo(m.name)
            self.runtimes[m.name] = rt
            self.served[m.name] = (rt, None)
            for a in m.lora_adapters:
                lora = {"name": a.name, "path": a.path, "int_id": a.id}
                rt.lora[a.name] = lora
                self.served[a.name] = (rt, lora)

    def __iter__(self) -> Any:
        return iter(self.runtimes.values())

    def __getitem__(self, name: str) -> ModelRuntime:
        return self.runtimes[name]

    def resolve(self, body: dict[str, Any]) -> tuple[ModelRuntime, dict[str, Any] | None]:
        """The runtime a body's ``model`` names, and its LoRA hashing key (None: the base model)."""
        model = body.get("model")
        if not isinstance(model, str):
            raise BadRequest("'model' is required and must be a string", code="missing_model")
        served = self.served.get(model)
        if served is None:
            raise UnknownModel(f"The model `{model}` does not exist.")
        return served

    async def load_tokenizers(self, executor: Executor) -> None:
        """Each model's local tokenizer (in ``executor``: loading one takes seconds). A model
        in ``auto`` mode whose tokenizer cannot load tokenizes remotely; ``local`` refuses to start."""
        loop = asyncio.get_running_loop()

        async def one(rt: ModelRuntime) -> None:
            if rt.config.tokenizer_mode == "remote":
                return
            try:
                rt.tokenizer = await loop.run_in_executor(executor, load_tokenizer, rt.config.tokenizer)
                rt.tokenizer.segments.cache.resize(self.segment_cache_tokens)
                rt.probe = HeadProbe(rt.tokenizer, rt.name)
            except TokenizeError as e:
                if rt.config.tokenizer_mode == "local":
                    raise
                rt.tokenizer_error = str(e)
                log.warning("model %s: local tokenizer unavailable (%s); tokenizing remotely", rt.name, e)

        await asyncio.gather(*(one(rt) for rt in self))


def length_error(rt: ModelRuntime, body: dict[str, Any], lengths: list[int]) -> str | None:
    """vLLM's message when the longest prompt plus ``max_tokens`` exceeds ``max_model_len``."""
    limit = rt.max_model_len
    if limit is None or not lengths:
        return None
    longest = max(lengths)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    requested = longest + (max_tokens if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) else 0)
    if longest < limit and requested <= limit:
        return None
    return (f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{requested} tokens ({longest} in the prompt, {requested - longest} for the completion). "
            "Please reduce the length of the prompt or the completion.")


def check_length(rt: ModelRuntime, body: dict[str, Any], lengths: list[int]) -> None:
    error = length_error(rt, body, lengths)
    if error is not None:
        raise PromptTooLong(error)
