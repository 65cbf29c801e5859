"""Tenants (``router.tenants``): each tenant's prompts are cached apart, its limits hold.

A real ``kvrouter sim`` engine (it hashes blocks with ``cache_salt`` the way vLLM does) and a
real ``kvrouter serve`` in front, with tenants whose keys come from the environment and from a
file. One engine, so every tenant's prompts meet in one prefix cache: only the salt keeps
them apart.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from kvconfig import ConfigError, parse_config
from router.http.tenants import SALT_CONTEXT, Tenant, TokenBucket, salted
from support import KVROUTER, QWEN3_DIR, Proc, RouterProc, access_lines, free_ports, metric_sum, openai_error, wait_for, wait_http

pytestmark = pytest.mark.slow

MODEL = "qwen3"
ADMIN = "admin-key"
ANONYMOUS_KEY = "plain-client-key"
KEYS = {"alpha": "alpha-key-1", "beta": "beta-key-1", "gamma": "gamma-key-1", "limited": "limited-key-1",
        "frugal": "frugal-key-1"}
RETIRING = "beta-key-0-retiring"
"""beta's second key, in its key file next to the first (a rotation under way)."""


def salt_of(name: str) -> str:
    """What the router must derive: HMAC-SHA256 keyed with the tenant's first key in sorted order."""
    secret = min(KEYS[name], RETIRING) if name == "beta" else KEYS[name]
    return hmac.new(secret.encode(), SALT_CONTEXT + name.encode(), hashlib.sha256).hexdigest()


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProc]:
    tmp = tmp_path_factory.mktemp("tenants")
    port = free_ports(3)
    kv, replay = port + 1, port + 2
    sim = Proc([*KVROUTER, "sim", "--port", str(port), "--model", MODEL, "--tokenizer", str(QWEN3_DIR),
                "--kv-events-port", str(kv), "--replay-port", str(replay), "--hash-seed", "0"], tmp / "sim.log")
    (tmp / "beta.keys").write_text(f"{KEYS['beta']}\n{RETIRING}\n")
    config = {
        "models": [{"name": MODEL, "tokenizer": str(QWEN3_DIR), "block_size": 16, "hash_seed": "0",
                    "backends": [{"name": "engine-0", "url": f"http://127.0.0.1:{port}",
                                  "kv_events": f"tcp://127.0.0.1:{kv}", "kv_replay": f"tcp://127.0.0.1:{replay}"}]}],
        "router": {"api_key": ANONYMOUS_KEY, "admin_api_key": ADMIN, "health_interval_s": 0.5,
                   "tenants": {"alpha": {"keys": "env:ALPHA_KEYS"},
                               "beta": {"keys": f"file:{tmp / 'beta.keys'}"},
                               "gamma": {"keys": "env:GAMMA_KEYS", "client_salt": "allowed"},
                               "limited": {"keys": "env:LIMITED_KEYS", "requests_per_s": 0.2},
                               "frugal": {"keys": "env:FRUGAL_KEYS", "prompt_tokens_per_min": 100}}},
    }
    env = {"ALPHA_KEYS": KEYS["alpha"], "GAMMA_KEYS": KEYS["gamma"], "LIMITED_KEYS": KEYS["limited"],
           "FRUGAL_KEYS": KEYS["frugal"], "KVROUTER_SALT_SECRET": ""}
    try:
        wait_http(f"http://127.0.0.1:{port}/health", timeout=90, proc=sim.popen)
        r = RouterProc("router", config, tmp, env=env, log_level="info")
    except BaseException:
        sim.stop()
        raise
    try:
        yield r
    finally:
        r.stop()
        sim.stop()


def prompt() -> str:
    """A prompt no other test sends: about 100 tokens, several full blocks."""
    return f"Request {uuid.uuid4().hex}: " + "the tenants share one engine and nothing else. " * 10


def complete(router: RouterProc, key: str, text: str, **extra: Any) -> httpx.Response:
    body = {"model": MODEL, "prompt": text, "max_tokens": 1, **extra}
    return httpx.post(router.url + "/v1/completions", json=body, headers=bearer(key), timeout=30)


def cached(r: httpx.Response) -> int:
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def indexed(router: RouterProc, text: str, salt: str | None) -> None:
    """Until the router's index holds ``text``'s blocks under ``salt`` (the engine's events arrived)."""
    body = {"model": MODEL, "prompt": text, **({"cache_salt": salt} if salt else {})}

    def held() -> bool:
        d = httpx.post(router.url + "/debug/route", json=body, headers=bearer(ADMIN), timeout=10).json()
        return d["candidates"][0]["matched_blocks"] > 0

    wait_for(held, "the engine's blocks to reach the router's index", timeout=10)


def test_another_tenants_cached_prompt_is_a_miss(router: RouterProc) -> None:
    text = prompt()
    assert cached(complete(router, KEYS["alpha"], text)) == 0
    indexed(router, text, salt_of("alpha"))  # also checks the salt the router derived and sent
    assert cached(complete(router, KEYS["alpha"], text)) > 0
    assert cached(complete(router, KEYS["beta"], text)) == 0
    assert cached(complete(router, RETIRING, text)) > 0  # beta's other key is beta too: its own cache now
    assert cached(complete(router, KEYS["alpha"], text)) > 0  # still cached for alpha meanwhile


def test_a_client_salt_is_replaced_by_the_tenants_own(router: RouterProc) -> None:
    text = prompt()
    complete(router, KEYS["alpha"], text)
    indexed(router, text, salt_of("alpha"))
    # beta sends alpha's very salt: replaced by beta's, so nothing of alpha's is reachable.
    assert cached(complete(router, KEYS["beta"], text, cache_salt=salt_of("alpha"))) == 0
    # alpha sends some salt of its own choosing: replaced by alpha's, so alpha's cache answers.
    assert cached(complete(router, KEYS["alpha"], text, cache_salt="chosen-by-the-client")) > 0


def test_a_client_salt_is_kept_for_a_tenant_that_allows_it(router: RouterProc) -> None:
    text = prompt()
    complete(router, KEYS["gamma"], text, cache_salt="gamma-user-7")
    indexed(router, text, "gamma-user-7")
    # The engine saw the client's salt as sent: router.api_key's clients keep theirs too.
    assert cached(complete(router, ANONYMOUS_KEY, text, cache_salt="gamma-user-7")) > 0
    # Without one, gamma's requests get the tenant's salt.
    other = prompt()
    complete(router, KEYS["gamma"], other)
    indexed(router, other, salt_of("gamma"))


def test_predicted_cached_tokens_equal_the_engines_with_salts(router: RouterProc) -> None:
    texts = [prompt() for _ in range(2)]
    ids = []
    for name in ("alpha", "beta", "alpha", "beta"):
        for text in texts:
            rid = f"pred-{uuid.uuid4().hex}"
            r = httpx.post(router.url + "/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 1},
                           headers={**bearer(KEYS[name]), "x-request-id": rid}, timeout=30)
            assert r.status_code == 200, r.text
            ids.append(rid)
            indexed(router, text, salt_of(name))
    wait_for(lambda: {line["request_id"] for line in access_lines(router.log_path)} >= set(ids), "the access-log lines")
    lines = [line for line in access_lines(router.log_path) if line["request_id"] in ids]
    assert all(line["predicted_cached_tokens"] == line["cached_tokens"] for line in lines), lines
    assert sum(line["cached_tokens"] > 0 for line in lines) == 4, lines  # each tenant's second round hit


def test_requests_over_a_tenants_rate_get_429_with_retry_after(router: RouterProc) -> None:
    assert complete(router, KEYS["limited"], prompt()).status_code == 200
    r = complete(router, KEYS["limited"], prompt())
    assert r.status_code == 429, r.text
    assert 1 <= int(r.headers["retry-after"]) <= 5
    assert openai_error(r.content)["code"] == "rate_limit_exceeded"
    assert complete(router, KEYS["alpha"], prompt()).status_code == 200  # another tenant's rate is its own


def test_prompt_tokens_over_a_tenants_minute_get_429_with_retry_after(router: RouterProc) -> None:
    first = complete(router, KEYS["frugal"], prompt() * 2)  # ~200 tokens: more than a minute's 100, on a full minute
    assert first.status_code == 200, first.text
    used = first.json()["usage"]["prompt_tokens"]
    assert used > 100
    r = complete(router, KEYS["frugal"], "short")
    assert r.status_code == 429, r.text
    # Until the first's debt (its tokens beyond the minute's 100) is paid back, at 100 tokens a minute.
    assert 1 <= int(r.headers["retry-after"]) <= math.ceil((used - 100) * 60 / 100), (used, r.headers)
    assert openai_error(r.content)["type"] == "rate_limit_error"


def test_a_wrong_or_missing_key_is_401_and_a_tenant_key_opens_no_admin_endpoint(router: RouterProc) -> None:
    for headers in (bearer("not-a-key"), {}, bearer(KEYS["alpha"] + "x")):
        r = httpx.post(router.url + "/v1/completions", json={"model": MODEL, "prompt": "hi"}, headers=headers)
        assert r.status_code == 401 and openai_error(r.content)["code"] == "invalid_api_key"
    r = httpx.post(router.url + "/debug/route", json={"model": MODEL, "prompt": "hi"}, headers=bearer(KEYS["alpha"]))
    assert r.status_code == 401


def test_router_api_key_still_opens_the_endpoints(router: RouterProc) -> None:
    r = complete(router, ANONYMOUS_KEY, prompt())
    assert r.status_code == 200
    assert httpx.get(router.url + "/v1/models", headers=bearer(ANONYMOUS_KEY)).status_code == 200


def test_tenant_metrics_count_requests_refusals_and_reused_tokens(router: RouterProc) -> None:
    text = prompt()
    complete(router, KEYS["alpha"], text)
    indexed(router, text, salt_of("alpha"))
    complete(router, KEYS["alpha"], text)
    complete(router, KEYS["limited"], prompt())
    page = httpx.get(router.url + "/metrics", headers=bearer(ADMIN)).text
    assert metric_sum(page, "kvrouter_tenant_requests_total", tenant="alpha", outcome="admitted") >= 2
    assert metric_sum(page, "kvrouter_tenant_requests_total", tenant="limited", outcome="requests_per_s") >= 1
    assert metric_sum(page, "kvrouter_tenant_requests_total", tenant="anonymous", outcome="admitted") >= 1
    assert metric_sum(page, "kvrouter_tenant_prompt_tokens_total", tenant="alpha", kind="reused") > 0
    assert metric_sum(page, "kvrouter_tenant_prompt_tokens_total", tenant="alpha", kind="recomputed") > 0
    assert metric_sum(page, "kvrouter_tenant_prompt_tokens_total", tenant="beta", kind="recomputed") > 0


def test_a_tenant_whose_keys_are_missing_stops_the_start_naming_it(tmp_path: Path) -> None:
    config = {"models": [{"name": MODEL, "tokenizer": str(QWEN3_DIR), "backends": [{"name": "e", "url": "http://127.0.0.1:9"}]}],
              "router": {"tenants": {"acme": {"keys": "env:KVROUTER_TEST_NO_SUCH_VARIABLE"}}}}
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(config))
    r = subprocess.run([*KVROUTER, "serve", "--config", str(path), "--workers", "1"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2, r.stderr
    assert "router.tenants.acme.keys" in r.stderr and "KVROUTER_TEST_NO_SUCH_VARIABLE" in r.stderr


def test_literal_keys_in_the_file_and_moved_keys_are_refused_by_name() -> None:
    base = {"models": [{"name": MODEL, "tokenizer": "t", "backends": [{"name": "e", "url": "http://e"}]}]}
    with pytest.raises(ConfigError, match="env:VAR or file:PATH"):
        parse_config({**base, "router": {"tenants": {"acme": {"keys": "sk-literal"}}}})
    with pytest.raises(ConfigError, match="breaker_failures was removed"):
        parse_config({**base, "router": {"breaker_failures": 3}})
    with pytest.raises(ConfigError, match="router.weights.share_cap was removed"):
        parse_config({**base, "router": {"weights": {"share_cap": 1.2}}})
    assert parse_config({**base, "index": "redis://h:6379/0", "index_namespace": "old"}).index_namespace == "old"


def test_the_salt_goes_in_front_of_the_body_or_replaces_the_clients() -> None:
    tenant = Tenant("t", "s", keep_client_salt=False)
    body: dict[str, Any] = {"model": "m", "prompt": "p"}
    assert salted(tenant, b' {"model":"m", "prompt":"p"}', body) == b' {"cache_salt":"s","model":"m", "prompt":"p"}'
    body = {"model": "m", "cache_salt": "mine"}
    assert json.loads(salted(tenant, b'{"model":"m","cache_salt":"mine"}', body)) == {"model": "m", "cache_salt": "s"}
    keeps = Tenant("k", "s", keep_client_salt=True)
    assert salted(keeps, b'{"cache_salt":"mine"}', {"cache_salt": "mine"}) == b'{"cache_salt":"mine"}'


def test_a_token_bucket_lets_a_burst_through_then_its_rate() -> None:
    b = TokenBucket(rate=2.0, burst=2.0, now=0.0)
    assert b.take(1, now=0.0) == 0.0 and b.take(1, now=0.0) == 0.0
    assert b.take(1, now=0.0) == pytest.approx(0.5)
    assert b.take(1, now=0.5) == 0.0
    big = TokenBucket(rate=1.0, burst=10.0, now=0.0)
    assert big.take(25, now=0.0) == 0.0  # longer than the burst: passes on a full bucket, leaves a debt
    assert big.take(1, now=10.0) == pytest.approx(6.0)
    half = TokenBucket(rate=2.0, burst=2.0, now=0.0)  # one of two workers: half the rate and burst
    assert half.take(1, share=0.5, now=0.0) == 0.0 and half.take(1, share=0.5, now=0.0) == pytest.approx(1.0)
