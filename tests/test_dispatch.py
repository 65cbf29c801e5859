"""router.http.dispatch.Endpoints on a real uvicorn server on loopback."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from router.http.dispatch import Endpoints
from router.http.errors import BadRequest
from support import free_port, wait_http


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    app = FastAPI()

    @app.get("/from-fastapi")
    async def from_fastapi() -> dict[str, str]:
        return {"served_by": "fastapi"}

    endpoints = Endpoints(app)

    async def ok(_: Request) -> Response:
        return JSONResponse({"served_by": "endpoints"})

    async def bad(_: Request) -> Response:
        raise BadRequest("'model' is required", code="missing_model")

    async def bug(_: Request) -> Response:
        raise ZeroDivisionError("a bug")

    endpoints.add("GET", "/health", ok)
    endpoints.add("POST", "/bad", bad)
    endpoints.add("POST", "/bug", bug)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(endpoints, host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_http(f"http://127.0.0.1:{port}/health", timeout=30)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def test_own_endpoints_are_called_directly(url: str) -> None:
    assert httpx.get(url + "/health").json() == {"served_by": "endpoints"}


def test_router_errors_and_bugs_get_openai_shaped_answers(url: str) -> None:
    r = httpx.post(url + "/bad", content=b"{}")
    assert r.status_code == 400
    assert r.json() == {"error": {"message": "'model' is required", "type": "invalid_request_error", "code": "missing_model"}}
    r = httpx.post(url + "/bug", content=b"{}")
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "server_error" and r.json()["error"]["code"] == "internal_error"


def test_everything_else_goes_to_fastapi(url: str) -> None:
    assert httpx.get(url + "/from-fastapi").json() == {"served_by": "fastapi"}
    assert httpx.get(url + "/nowhere").status_code == 404
    assert httpx.get(url + "/bad").status_code == 405  # a method the endpoint table lacks
    assert httpx.head(url + "/health").status_code == 200  # HEAD of a GET endpoint, through FastAPI
