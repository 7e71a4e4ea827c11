"""The router's FastAPI application: the OpenAI routes `kvtier serve` has, proxied, plus its
own `/health` and `/metrics`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvstore.deadlines import ROUTER_MODELS_TIMEOUT_S
from kvtier import __version__
from kvtier.router.backends import BackendPool
from kvtier.router.disagg import prefill_then_decode
from kvtier.router.proxy import Proxy
from kvtier.router.router_metrics import RouterMetrics
from kvtier.server.http_edge import MAX_BODY_BYTES, install_edge
from kvtier.server.openai_protocol import APIError

logger = logging.getLogger("kvtier.router")


def build_app(proxy: Proxy, pool: BackendPool, metrics: RouterMetrics, disaggregated: bool,
              api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """Returns the router application; health checks run while it serves. Auth, the body
    bound and the error shape are `kvtier serve`'s own (kvtier/server/http_edge.py)."""
    app = FastAPI(title="kvtier router", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
    serving_role = "decode" if disaggregated else "any"
    auth = install_edge(app, api_key, logger, max_body_bytes)

    async def read_json(request: Request) -> dict[str, Any]:
        data = await request.body()  # bounded by the edge's BodyLimit, declared length or not
        try:
            body = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            raise APIError(400, "the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        return body

    async def route(request: Request, path: str) -> Response:
        body = await read_json(request)
        headers = dict(request.headers)
        work = prefill_then_decode(proxy, path, body, headers) if disaggregated else proxy.forward(path, body, headers)
        return await unless_disconnected(request, work)

    @app.post("/v1/completions", dependencies=auth)
    async def completions(request: Request) -> Response:
        return await route(request, "/v1/completions")

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat(request: Request) -> Response:
        return await route(request, "/v1/chat/completions")

    @app.get("/v1/models", dependencies=auth)
    async def models(request: Request) -> Response:
        for backend in pool.available(serving_role):
            try:
                r = await proxy.client.get(backend.url + "/v1/models", headers=proxy.headers(dict(request.headers)),
                                           timeout=ROUTER_MODELS_TIMEOUT_S)
            except httpx.HTTPError:
                continue
            return Response(r.content, status_code=r.status_code, media_type="application/json")
        return APIError(503, "no healthy backend", "service_unavailable").response()

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if pool.available(serving_role) else 503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus() -> Response:
        for b in pool.backends:
            metrics.healthy.labels(b.url).set(1.0 if b.healthy else 0.0)
            metrics.in_flight.labels(b.url).set(b.in_flight)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


async def unless_disconnected(request: Request, work: Awaitable[Response]) -> Response:
    """Returns `work`'s response; if the client hangs up first, cancels it (closing the
    backend call, so the backend aborts the request) and returns a 499 nobody reads."""
    task = asyncio.ensure_future(work)

    async def hang_up() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(hang_up())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return APIError(499, "client disconnected", "client_disconnected").response()
