"""The HTTP edge `kvtier serve` and `kvtier router` share (kvtier/server/http_edge.py), on both
real applications in-process: a missing or wrong key, a body over the bound (declared or
chunked), an unknown route and a malformed body get OpenAI-shaped errors, the same from both."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from engine import LLM
from harness.model import make_tiny_checkpoint
from kvtier.router.backends import Backend, BackendPool
from kvtier.router.policy import make_policy
from kvtier.router.proxy import Proxy
from kvtier.router.router_app import build_app as build_router
from kvtier.router.router_metrics import RouterMetrics
from kvtier.server.engine_loop import EngineLoop
from kvtier.server.server_app import build_app as build_server
from kvtier.server.server_metrics import ServerMetrics
from kvtier.server.serving import ServingContext

KEY = "s3cret"
LIMIT = 4096  # bytes


@pytest.fixture
def apps(tmp_path: Path) -> Iterator[dict[str, FastAPI]]:
    with LLM(str(make_tiny_checkpoint(tmp_path, "llama")), device="cpu", num_gpu_blocks=16) as llm:
        loop = EngineLoop(llm.engine, max_waiting=1)  # never started: a request that gets past the edge gets 503
        server = build_server(ServingContext(loop, "tiny"), ServerMetrics("tiny"), KEY, max_body_bytes=LIMIT)
        client = httpx.AsyncClient()
        pool = BackendPool([Backend("http://127.0.0.1:9")], client)  # never checked: none is healthy
        metrics = RouterMetrics()
        proxy = Proxy(pool, make_policy("round-robin", pool, metrics, 0.5), metrics, request_timeout_s=5.0)
        router = build_router(proxy, pool, metrics, disaggregated=False, api_key=KEY, max_body_bytes=LIMIT)
        yield {"serve": server, "router": router}
        asyncio.run(client.aclose())


def _answers(apps: dict[str, FastAPI], method: str, path: str, headers: dict[str, str] | None = None,
             json: object = None, content: bytes | None = None,
             chunks: list[bytes] | None = None) -> dict[str, httpx.Response]:
    """Returns each app's response to the same request; `chunks` are sent as a chunked body
    (no Content-Length)."""

    async def body() -> AsyncIterator[bytes]:
        for c in chunks or []:
            yield c

    async def one(app: FastAPI) -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://edge") as c:
            return await c.request(method, path, headers=headers, json=json,
                                   content=body() if chunks is not None else content)

    return {name: asyncio.run(one(app)) for name, app in apps.items()}


def _error(r: httpx.Response) -> dict[str, object]:
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return dict(body["error"])


def test_auth_is_checked_alike(apps: dict[str, FastAPI]) -> None:
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": KEY}):
        got = _answers(apps, "POST", "/v1/completions", json={"prompt": "hi"}, headers=headers)
        assert {r.status_code for r in got.values()} == {401}
        errors = [_error(r) for r in got.values()]
        assert errors[0] == errors[1] and errors[0]["code"] == "invalid_api_key"
    for name, r in _answers(apps, "GET", "/v1/models").items():
        assert r.status_code == 401, name


def test_bodies_over_the_bound_are_refused_declared_or_chunked(apps: dict[str, FastAPI]) -> None:
    auth = {"authorization": f"Bearer {KEY}"}
    big = b'{"prompt": "' + b"x" * LIMIT + b'"}'
    declared = _answers(apps, "POST", "/v1/completions", content=big,
                        headers={**auth, "content-type": "application/json"})
    chunked = _answers(apps, "POST", "/v1/completions", chunks=[big[i: i + 1000] for i in range(0, len(big), 1000)],
                       headers={**auth, "content-type": "application/json"})
    for got in (declared, chunked):
        assert {r.status_code for r in got.values()} == {413}
        errors = [_error(r) for r in got.values()]
        assert errors[0] == errors[1] and str(LIMIT) in str(errors[0]["message"])
    # A chunked body within the bound gets past the edge: no engine (503) / no backend (503).
    small = _answers(apps, "POST", "/v1/completions", chunks=[b'{"prompt": ', b'"hi"}'],
                     headers={**auth, "content-type": "application/json"})
    assert {r.status_code for r in small.values()} == {503}
    assert all(_error(r)["type"] == "service_unavailable" for r in small.values())


def test_unknown_routes_and_bad_json_get_openai_errors(apps: dict[str, FastAPI]) -> None:
    for name, r in _answers(apps, "GET", "/nope").items():
        assert r.status_code == 404 and _error(r)["type"] == "NotFoundError", name
    bad = _answers(apps, "POST", "/v1/completions", content=b"{not json",
                   headers={"authorization": f"Bearer {KEY}", "content-type": "application/json"})
    for name, r in bad.items():
        assert r.status_code == 400 and _error(r)["type"] == "invalid_request_error", name
