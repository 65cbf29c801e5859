"""The fleet config file (YAML): models, their backends, the router and the index.

It sits below ``indexer`` and ``router`` in the dependency order (docs/architecture.md):
the router, ``kvrouter indexer`` and ``kvrouter hash`` all read the same file, and
``indexer/`` must not import ``router/``.

Every model is ``extra="forbid"`` so a typo in YAML is an error that names the key,
at start-up rather than as a silently ignored setting. The shape is the contract in
DESIGN.md; fields beyond it are optional extensions with safe defaults.
"""

from __future__ import annotations

import hmac
import logging
import re
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

log = logging.getLogger(__name__)

HashAlgo = Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]
POLICIES = ("round_robin", "random", "least_loaded", "power_of_two", "session", "prefix_approx", "kv_aware")
"""The routing policies the router offers (:mod:`router.policies` builds them)."""
POLICY_NAMES: set[str] = set(POLICIES)
"""The names a config may give: :data:`POLICIES`, and those a module named in
``KVROUTER_POLICY_MODULES`` registers (:func:`router.policies.register`: the bench's oracle)."""


def _known_policy(v: str) -> str:
    if v not in POLICY_NAMES:
        raise ValueError(f"unknown policy {v!r}; one of {', '.join(sorted(POLICY_NAMES))}")
    return v


PolicyName = Annotated[str, AfterValidator(_known_policy)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


def _non_empty(v: SecretStr) -> SecretStr:
    # An empty key would read as "no key" and leave the door open: say so instead.
    if not v.get_secret_value():
        raise ValueError("an API key must not be empty (null means no key)")
    return v


ApiKey = Annotated[SecretStr, AfterValidator(_non_empty)]
"""A secret: shown as ``**********`` by repr() and str(), so a logged config keeps it."""


class LoraAdapter(_Strict):
    """An adapter as given to the engines' ``--lora-modules name=path`` (id = lora_int_id)."""

    name: str
    """The adapter's model name, which clients send."""
    path: str
    """The adapter's path in the engines' ``--lora-modules name=path`` (hashed into its blocks from vLLM
    0.31)."""
    id: int = Field(ge=1)
    """The adapter's ``lora_int_id`` in the engines (hashed into its blocks by vLLM 0.11)."""


class Backend(_Strict):
    """One vLLM engine (or one DP group of engines behind one HTTP port)."""

    name: str
    """The backend's name in logs, metrics, ``/debug/*`` and ``x-kvrouter-backend``; a name listed under
    several models is one engine."""
    url: str
    """The engine's HTTP base URL (``http://host:port``), without credentials."""
    kv_events: str | None = None
    """The engine's KV-event publisher, ``tcp://HOST:PORT`` (``--kv-events-config`` ``endpoint`` with the
    engine's host); unset, the router gets no cache events from it."""
    kv_replay: str | None = None
    """The engine's replay socket, ``tcp://HOST:PORT`` (``replay_endpoint``): missed event batches are fetched
    from it."""
    data_parallel_size: int = Field(default=1, ge=1)
    """The engine's ``--data-parallel-size``: rank r publishes on the ``kv_events`` port + r and replays on
    the ``kv_replay`` port + r."""
    api_key: ApiKey | None = None
    """The engine's ``--api-key``: the router sends ``Authorization: Bearer KEY`` on every
    call to it (proxied requests, health checks, scrapes, /tokenize)."""

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"backend url must start with http:// or https://, got {v!r}")
        if "@" in urlsplit(v).netloc:
            # The url is shown in /debug/backends and in logs; a key belongs in api_key.
            raise ValueError("backend url must not carry credentials (user:password@); use the backend's api_key")
        return v.rstrip("/")

    def auth_headers(self) -> dict[str, str]:
        """The headers every call to this engine carries (empty without an ``api_key``)."""
        return {} if self.api_key is None else {"Authorization": f"Bearer {self.api_key.get_secret_value()}"}

    @field_validator("kv_events", "kv_replay")
    @classmethod
    def _zmq_endpoint(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(
                f"ZMQ endpoint must look like tcp://HOST:PORT (host and port, not just an ip), got {v!r}"
            )
        return v


class Discovery(_Strict):
    """Backends found by DNS: the name's A and AAAA records, as a Kubernetes headless Service
    or Consul serves them, one backend per address, every engine on the same ports."""

    dns: str = Field(min_length=1)
    """The name to resolve, e.g. ``vllm.default.svc.cluster.local`` (a headless Service)."""
    port: int = Field(ge=1, le=65535)
    """Every engine's HTTP port."""
    kv_events_port: int | None = Field(default=None, ge=1, le=65535)
    """Every engine's KV-event publisher port (unset: the router gets no cache events from them)."""
    kv_replay_port: int | None = Field(default=None, ge=1, le=65535)
    """Every engine's replay port (unset: missed event batches are not fetched)."""
    interval_s: float = Field(default=5.0, gt=0)
    """Seconds between lookups. A failed lookup keeps the last set it found."""
    nameserver: str | None = Field(default=None, pattern=r"^[^\s:]+(:\d{1,5})?$|^\[[0-9A-Fa-f:.]+\](:\d{1,5})?$")
    """``HOST[:PORT]`` (``[v6]:PORT``) of the DNS server to ask; unset, the system's resolver."""


class Model(_Strict):
    """One model the router serves: its tokenizer, the engines' hashing settings and its backends."""

    name: str
    """The model name clients send (the engines' ``--served-model-name``)."""
    tokenizer: str
    """The engines' tokenizer: a local directory or a Hugging Face hub id, loaded at start."""
    block_size: int = Field(default=16, ge=1)
    """The engines' ``--block-size``: tokens per KV block, the unit the prefix hashes cover."""
    hash_algo: HashAlgo = "sha256"
    """The engines' ``--prefix-caching-hash-algo``."""
    hash_seed: str | None = None
    """The engines' ``PYTHONHASHSEED``, which seeds the first block's hash (null: unset)."""
    vllm_version: str = "0.33.0"
    """The engines' vLLM version: it picks the block-hashing dialect and the KV-event wire format."""
    max_model_len: int | None = Field(default=None, ge=1)
    """Longest prompt plus ``max_tokens`` the router accepts: longer requests get 400 before any engine sees
    them. Unset, it is read from a backend's ``/v1/models``."""
    lora_adapters: list[LoraAdapter] = []
    """The LoRA adapters the engines serve (their ``--lora-modules``); clients name them as models."""
    backends: list[Backend] = []
    """The engines serving this model (at least one, unless ``discovery`` finds them)."""
    discovery: Discovery | None = None
    """Find more backends by DNS, added and removed as its records change (a backend listed in
    ``backends`` stays whatever DNS says)."""
    policy: PolicyName | None = None
    """This model's routing policy, one of ``round_robin``, ``random``, ``least_loaded``, ``power_of_two``,
    ``session``, ``prefix_approx``, ``kv_aware`` (null: ``router.policy``)."""
    tokenizer_mode: Literal["local", "remote", "auto"] = "local"
    """``local`` tokenizes in the router; ``remote`` asks an engine's ``/tokenize``; ``auto`` starts local and
    switches to remote when sampled parity checks keep mismatching."""
    @field_validator("hash_seed", mode="before")
    @classmethod
    def _seed_is_string(cls, v: object) -> object:
        # PYTHONHASHSEED is an environment string; YAML may hand us an int.
        return str(v) if isinstance(v, int) else v

    @model_validator(mode="after")
    def _unique_names(self) -> "Model":
        if not self.backends and self.discovery is None:
            raise ValueError(f"model {self.name!r} has no backends: list some, or find them with discovery")
        names = [b.name for b in self.backends]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"duplicate backend names in model {self.name!r}: {dupes}")
        return self


MOVED_WEIGHTS = {
    "share_cap": "kv_aware's cost of the prefill queued on each backend spreads load without it",
}
"""Keys ``router.weights`` no longer takes, refused like :data:`MOVED_KEYS`."""


class KvAwareWeights(_Strict):
    """Weights of the kv_aware cost (see router/policies/kv_aware.py for the formula)."""

    prefill: float = Field(default=1.0, ge=0.0)
    """Per block of prefill the backend would do: this prompt's uncached blocks plus prefill queued there."""
    decode: float = Field(default=0.1, ge=0.0)
    """Per active KV block. Dynamo weighs decode blocks 1:1 with prefill blocks; on the
    Mooncake bench that made kv_aware balance KV memory instead of queued prefill and
    lost to least_loaded on TTFT (engine TTFT p90 1.67 s vs 0.95 s at 0.1), because a
    step's cost grows ~1000x less per held block than per prefilled token."""

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: object) -> object:
        return refuse_moved(data, MOVED_WEIGHTS, "router.weights")


TENANT_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
ANONYMOUS = "anonymous"
"""The tenant ``router.api_key``'s clients are counted as (a name no tenant may take)."""


class Tenant(_Strict):
    """A client of the router with keys of its own (``router.tenants.<name>``): the router
    identifies it by its key, binds a cache salt to it, so that no other tenant's request
    can hit its cached prefixes (or learn from its answers' cached tokens that they exist),
    and holds it to limits of its own."""

    keys: str
    """Where the tenant's API keys are read at start, never the keys themselves: ``env:VAR`` (an environment
    variable) or ``file:PATH`` (a mounted secret). Keys are separated by whitespace or lines: several while
    one is rotated out."""
    requests_per_s: float | None = Field(default=None, gt=0)
    """Requests per second, with bursts of up to one second's worth; one more gets 429 with ``Retry-After``.
    A host's router workers split it; each replica holds all of it. Unset: no limit."""
    prompt_tokens_per_min: int | None = Field(default=None, ge=1)
    """Prompt tokens per minute, with bursts of up to one minute's worth: a request is let through when
    the tenant has that many left (a prompt longer than a minute's worth, when it has the whole minute), its
    count is taken as the router tokenizes it and set right by the engine's ``usage``; over the limit, 429
    with ``Retry-After``. A host's router workers split it; each replica holds all of it. Unset: no limit."""
    client_salt: Literal["replaced", "allowed"] = "replaced"
    """``replaced``: every request gets the tenant's own ``cache_salt``, whatever the client sent.
    ``allowed``: a salt the client sends is kept (for a tenant that partitions its own users' caches),
    and one that sends none gets the tenant's."""

    @field_validator("keys")
    @classmethod
    def _a_place_not_a_key(cls, v: str) -> str:
        if not v.startswith(("env:", "file:")) or not v.partition(":")[2].strip():
            raise ValueError("keys must be env:VAR or file:PATH, where the keys are (never the keys themselves)")
        return v


MOVED_KEYS = {
    "connect_timeout_s": "the connect timeout is a lab tuning knob (router/tuning.py, 5 s); "
                         "router.request_timeout_s still bounds an engine's silence",
    "metrics_scrape_interval_s": "engines' /metrics are read at the lab tuning knob metrics_scrape_interval_s "
                                 "(router/tuning.py, 1 s)",
    "breaker_failures": "the circuit breaker's threshold is a lab tuning knob (router/tuning.py, 5 failures)",
}
"""Keys ``router`` no longer takes, and where they went: a file that still sets one is refused
with that sentence rather than pydantic's bare "extra inputs are not permitted"."""


def refuse_moved(data: object, moved: dict[str, str], where: str) -> object:
    """A ``before`` validator's body: refuse a section that sets a key of ``moved``, naming each."""
    if isinstance(data, dict):
        gone = [k for k in moved if k in data]
        if gone:
            raise ValueError("; ".join(f"{where}.{k} was removed: {moved[k]}; delete it from the file" for k in gone))
    return data


class RouterSettings(_Strict):
    """The router process: where it listens, how it routes, its keys, timeouts and limits."""

    host: str = "127.0.0.1"
    """Address the router listens on (``kvrouter serve --host`` overrides)."""
    port: int = Field(default=8080, ge=0, le=65535)
    """Port the router listens on (``kvrouter serve --port`` overrides)."""
    policy: PolicyName = "kv_aware"
    """The routing policy of every model that names none (``kvrouter serve --policy`` overrides): one of the
    policies ``models[].policy`` lists."""
    weights: KvAwareWeights = KvAwareWeights()
    """The weights of kv_aware's cost."""
    api_key: ApiKey | None = None
    """Clients of the OpenAI endpoints send ``Authorization: Bearer KEY``. It does not open
    ``/debug/*`` (see ``admin_api_key``)."""
    admin_api_key: ApiKey | None = None
    """The key for ``/debug/*`` and, while ``api_key`` or ``tenants`` is set, ``/metrics`` (Prometheus sends it as
    its bearer token). Unset while ``api_key`` or ``tenants`` is set, both are closed (403); with no key at all,
    everything is open (local use)."""
    tenants: dict[str, Tenant] = {}
    """Named tenants (``router.tenants.<name>``), each with its own keys, cache salt and limits. A request
    must then carry a tenant's key, or ``api_key``, whose clients are one more tenant without a salt or
    limits of its own (counted as ``anonymous``)."""
    expose_decision_headers: bool = False
    """Add ``x-kvrouter-reason`` to proxied responses. Off by default: a reason such as
    ``cache_hit`` tells any client whether some prefix (maybe another tenant's) is cached.
    ``x-kvrouter-backend`` is always sent."""
    forward_client_authorization: bool = False
    """Pass the client's ``Authorization`` header on to backends that have no ``api_key``
    (engines that check each client's own key). Off, engines never see a client's key."""
    max_body_bytes: int = Field(default=32 * 1024 * 1024, ge=1024)
    """Largest request body accepted; a larger one gets 413. A non-streamed answer from an engine, which the
    router holds whole, may be twice this; a larger one is a 502 (streamed answers are relayed as they arrive)."""
    request_timeout_s: float = Field(default=600.0, gt=0)
    """Longest silence from an engine, in seconds, before a request to it fails (a read timeout: a stream that
    keeps sending may last longer)."""
    retries: int = Field(default=2, ge=0)
    """How many more backends a request may try when one refuses the connection, closes it before answering,
    or answers 502/503; never once a response byte has arrived."""
    health_interval_s: float = Field(default=2.0, gt=0)
    """Seconds between ``GET /health`` checks of each backend: one failure ejects it, one success re-admits
    it."""
    session_header: str = "x-session-id"
    """The request header that names a session for the ``session`` policy (without it, the body's
    ``user``)."""
    drain_timeout_s: float = Field(default=30.0, ge=0)
    """On SIGTERM the router stops accepting connections and lets the requests in flight
    finish for at most this long; a stream still open then ends with an error event
    (code ``shutting_down``), a request not yet answered gets 503, and the process exits 0."""
    workers: int | None = Field(default=None, ge=1, le=256)
    """Router processes serving one port (``kvrouter serve --workers N`` and the
    ``KVROUTER_WORKERS`` variable override it). Default: the cores this process may run
    on. 1 is today's single process; more share load and health (router/http/workers.py)."""
    queue_busy_tokens: int | None = Field(default=None, ge=1)
    """Turns the router's admission queue on (off while unset). A backend is busy when the
    prompt tokens queued on it for prefill exceed this: the router's requests before their
    first token, every worker's and replica's, plus the requests the engine reports waiting
    that no router process sent. While every healthy backend of a model is busy, a new
    request waits at the router, and the policy decides when it leaves, on the index and
    load of that moment (late binding): lower ``priority`` first (vLLM's request field),
    then tenants in turn (the ``router.tenants`` tenant the key names, else the body's
    ``user``, else the client's key), then, within a tenant, shorter uncached prompts
    before longer ones, aged by their wait (arrival order while the queue has no recent
    wait). A tenant sending more than twice its fair share of the recent requests is let
    through only to a backend with room for it (nothing queued, or its uncached tokens fit
    under a quarter of the threshold), among its share of the backends, and waits while
    another backend has more than that quarter queued, so the others find short queues.
    About one engine step of prefill (``--max-num-batched-tokens``) is a place to start."""
    queue_max_waiting: int = Field(default=1024, ge=1)
    """Most requests one router process holds waiting per model; one more gets 429 with
    ``Retry-After`` at once."""
    queue_timeout_s: float = Field(default=30.0, gt=0)
    """Longest a request waits in the router's queue; then it gets 429 with ``Retry-After``."""
    fleet_state: str = "auto"
    """Where the router's processes share their state (load and recent decisions): the workers
    of one host always share it in memory; replicas on several hosts share it through a Redis
    URL given here. ``auto``: the index's URL when the index is
    Redis; ``local``: this host's workers only."""

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: object) -> object:
        return refuse_moved(data, MOVED_KEYS, "router")

    @field_validator("tenants")
    @classmethod
    def _tenant_names(cls, v: dict[str, Tenant]) -> dict[str, Tenant]:
        for name in v:
            if name == ANONYMOUS or not re.fullmatch(TENANT_NAME, name):
                raise ValueError(f"tenant name {name!r} must match {TENANT_NAME} and not be {ANONYMOUS!r} "
                                 "(it labels the tenant's metrics)")
        return v

    @field_validator("fleet_state")
    @classmethod
    def _fleet_state_kind(cls, v: str) -> str:
        if v not in ("auto", "local") and not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"fleet_state must be 'auto', 'local' or a Redis URL (redis://host:6379/0), got {redact_url(v)!r}")
        if _is_redis(v):
            _namespace_of(v)
        return v


class Config(_Strict):
    models: list[Model] = Field(min_length=1)
    """The models the router serves, each with the engines that serve it."""
    router: RouterSettings = RouterSettings()
    """The router process: where it listens, how it routes, its keys, timeouts and limits."""
    index: str = "memory"
    """Where the KV-block index lives: ``memory`` (this router's own, fed by the engines' KV events) or a
    Redis URL (``redis://host:6379/0``) that ``kvrouter indexer`` fills and router replicas share. The URL's
    ``namespace`` parameter (``redis://host:6379/0?namespace=fleet-a``; default ``kvr``) prefixes every key
    the router and ``kvrouter indexer`` read and write, the fleet-state log's too: a router reading another
    namespace than the indexer writes sees no cached block. Fleets (or tests) can share one Redis server
    under different namespaces."""

    @field_validator("index")
    @classmethod
    def _index_kind(cls, v: str) -> str:
        if v != "memory" and not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"index must be 'memory' or a Redis URL (redis://host:6379/0), got {redact_url(v)!r}")
        if v != "memory":
            _namespace_of(v)
        return v

    @model_validator(mode="before")
    @classmethod
    def _namespace_into_url(cls, data: object) -> object:
        """``index_namespace`` was a key of its own until the namespace became the Redis URL's
        ``namespace`` parameter. A file that still sets it keeps working: its value moves into
        the Redis URL it prefixes (the index's, else ``router.fleet_state``'s)."""
        if not isinstance(data, dict) or "index_namespace" not in data:
            return data
        data = dict(data)
        ns = data.pop("index_namespace")
        if not isinstance(ns, str) or not _NAMESPACE.fullmatch(ns):
            raise ValueError("index_namespace must be a non-empty single line; it is now the index URL's "
                             "namespace parameter (redis://host:6379/0?namespace=NAME)")
        log.warning("index_namespace is deprecated: give it as the index URL's namespace parameter "
                    "(redis://host:6379/0?namespace=%s)", ns)
        if isinstance(data.get("index"), str) and data["index"] != "memory":
            data["index"] = with_namespace(data["index"], ns)
        router = data.get("router")
        if isinstance(router, dict) and router.get("fleet_state") not in (None, "auto", "local"):
            data["router"] = {**router, "fleet_state": with_namespace(str(router["fleet_state"]), ns)}
        return data

    @model_validator(mode="after")
    def _one_namespace(self) -> "Config":
        given = {_namespace_of(u)[1] for u in (self.index, self.router.fleet_state) if _is_redis(u)}
        if len(given) > 1:
            raise ValueError(f"index and router.fleet_state name two namespaces {sorted(given)}: the fleet-state "
                             "log shares the index's, so name it once, or name the same one")
        return self

    @property
    def index_url(self) -> str:
        """``index`` without its ``namespace`` parameter (what Redis clients connect to), or ``memory``."""
        return _namespace_of(self.index)[0] if _is_redis(self.index) else self.index

    @property
    def index_namespace(self) -> str:
        """The key prefix of the Redis index and of the fleet-state log (the ``namespace`` URL parameter)."""
        for url in (self.index, self.router.fleet_state):
            if _is_redis(url):
                ns = _namespace_of(url)[1]
                if ns is not None:
                    return ns
        return DEFAULT_NAMESPACE

    @model_validator(mode="after")
    def _shared_backends_agree(self) -> "Config":
        # Backend state (health, load, connections) is kept per backend name, so a name
        # listed under two models must be the same engine.
        seen: dict[str, Backend] = {}
        for m in self.models:
            for b in m.backends:
                first = seen.setdefault(b.name, b)
                if first.url != b.url:
                    raise ValueError(f"backend {b.name!r} is listed with two urls: {first.url} and {b.url}")
                if first.api_key != b.api_key:
                    raise ValueError(f"backend {b.name!r} is listed with two api_keys")
        return self

    @model_validator(mode="after")
    def _unique_model_names(self) -> "Config":
        names = [m.name for m in self.models] + [a.name for m in self.models for a in m.lora_adapters]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"model and adapter names must be unique, repeated: {dupes}")
        return self

    def fleet_state_url(self) -> str | None:
        """The Redis URL replicas share their state through, or None (``router.fleet_state``)."""
        v = self.router.fleet_state
        if v == "local":
            return None
        if v == "auto":
            return None if self.index == "memory" else self.index_url
        return _namespace_of(v)[0]

    def model(self, name: str) -> Model | None:
        """The base model serving ``name`` (a model or one of its LoRA adapters)."""
        for m in self.models:
            if m.name == name or any(a.name == name for a in m.lora_adapters):
                return m
        return None


_USERINFO_PASSWORD = re.compile(r"(^|//)([^/?#@:]*):[^/?#@]*@")
_QUERY_PASSWORD = re.compile(r"(?i)([?&](?:password|passwd|pass)=)[^&#]*")


def redact_url(url: str) -> str:
    """``url`` with its password (``user:PASSWORD@`` or ``?password=``) shown as ``***``,
    for logs, error messages and anything served: a Redis URL often carries one."""
    return _QUERY_PASSWORD.sub(r"\1***", _USERINFO_PASSWORD.sub(r"\1\2:***@", url))


def bearer_matches(authorization: str | None, key: bytes) -> bool:
    """Whether an ``Authorization`` header value is ``Bearer <key>`` (the scheme in any
    case, RFC 9110), compared with :func:`hmac.compare_digest` so the time taken does not
    depend on how many leading characters of a guess were right. Servers decode header
    bytes as latin-1, so encoding back gives the bytes sent."""
    if authorization is None or authorization[:7].lower() != "bearer ":
        return False
    return hmac.compare_digest(authorization[7:].strip().encode("latin-1"), key)


DEFAULT_NAMESPACE = "kvr"
_NAMESPACE = re.compile(r"[^\n]+")


def _is_redis(url: str) -> bool:
    return url.startswith(("redis://", "rediss://", "unix://"))


def _namespace_of(url: str) -> tuple[str, str | None]:
    """A Redis URL without its ``namespace`` query parameter (redis-py would pass it on to the
    connection as an unknown argument), and that parameter's value if it has one."""
    parts = urlsplit(url)
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    names = [v for k, v in pairs if k == "namespace"]
    if not names:
        return url, None
    if not _NAMESPACE.fullmatch(names[-1]) or len(names) > 1:
        raise ValueError(f"the namespace parameter of {redact_url(url)!r} must be given once, non-empty, on one line")
    return urlunsplit(parts._replace(query=urlencode([(k, v) for k, v in pairs if k != "namespace"]))), names[-1]


def with_namespace(url: str, namespace: str) -> str:
    """``url`` with ``namespace`` as its ``namespace`` parameter (what ``index_namespace`` became)."""
    bare, given = _namespace_of(url)
    if given is not None and given != namespace:
        raise ValueError(f"index_namespace {namespace!r} and the URL's namespace parameter {given!r} disagree")
    parts = urlsplit(bare)
    query = "&".join(q for q in (parts.query, urlencode({"namespace": namespace})) if q)
    return urlunsplit(parts._replace(query=query))


class ConfigError(Exception):
    """The config file is missing, not YAML, or names an unknown key or a bad value."""


class KeysFromEnv(BaseSettings):
    """Keys given as environment variables instead of in the file (which is often committed);
    an empty variable counts as unset."""

    model_config = SettingsConfigDict(env_prefix="KVROUTER_", extra="ignore", use_attribute_docstrings=True)

    api_key: SecretStr | None = None
    """Replaces ``router.api_key``."""
    admin_api_key: SecretStr | None = None
    """Replaces ``router.admin_api_key``."""
    backend_api_key: SecretStr | None = None
    """The ``api_key`` of every backend that has none in the file."""
    salt_secret: SecretStr | None = None
    """The secret the tenants' cache salts are derived from (``router.tenants``). Unset, each tenant's
    salt is derived from its own keys, so replacing the key that seeds it (its first in sorted order)
    starts its cache afresh; set, salts outlive key rotations. Every router process and replica must
    see the same value."""

    def apply(self, config: Config) -> None:
        router = config.router
        for field in ("api_key", "admin_api_key"):
            value = getattr(self, field)
            if value is not None and value.get_secret_value():
                setattr(router, field, value)
                log.info("router.%s from KVROUTER_%s", field, field.upper())
        key = self.backend_api_key
        if key is not None and key.get_secret_value():
            for m in config.models:
                for b in m.backends:
                    if b.api_key is None:
                        b.api_key = key


def load_config(path: str | Path) -> Config:
    """The file's config, with the keys the environment gives (see :class:`KeysFromEnv`)."""
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"cannot read config {path}: {e}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"config {path} is not valid YAML: {e}") from e
    config = parse_config(raw, source=str(path))
    KeysFromEnv().apply(config)
    return config


def parse_config(raw: object, source: str = "<config>") -> Config:
    try:
        return Config.model_validate(raw)
    except ValidationError as e:
        lines = [f"{source}: invalid config"]
        for err in e.errors():
            where = ".".join(str(p) for p in err["loc"]) or "(top level)"
            lines.append(f"  {where}: {err['msg']}")
        raise ConfigError("\n".join(lines)) from None
