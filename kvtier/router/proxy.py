"""Forwarding one OpenAI request to a backend chosen by the policy, with failover.

A backend that refuses the connection, drops it before answering, or answers 503 is marked
down and the request goes to the next backend in the policy's ranking; a 429 moves on
without marking it down. Nothing is retried once the client has received a byte, and no
request is sent to the same backend twice. A stream cut mid-way ends with an SSE error
event, so the client sees the failure instead of a truncated answer.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from kvstore.deadlines import ROUTER_CONNECT_TIMEOUT_S
from kvtier.router.backends import Backend, BackendPool
from kvtier.router.policy import Policy
from kvtier.router.prompt_view import view_request
from kvtier.router.router_metrics import RouterMetrics
from kvtier.server.openai_protocol import APIError

logger = logging.getLogger("kvtier.router")

_MOVE_ON = {429, 503}  # another backend may serve it; 503 also means this one is down


class RelayResponse(StreamingResponse):
    """A relayed stream that calls `release` (once) however it ends: sent whole, cut, or
    never started because the client left first (then its body generator never runs, so
    the generator's own cleanup cannot be relied on)."""

    def __init__(self, body: AsyncIterator[bytes], release: Callable[[], Awaitable[None]]) -> None:
        super().__init__(body, media_type="text/event-stream")
        self.release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.release()


@dataclass
class _Failed:
    """A try that ended before the client got anything: the next backend may take it."""

    response: Response | None  # the backend's answer to pass on if no other backend serves it


class Proxy:
    """Sends requests to the pool's backends in the policy's order."""

    def __init__(self, pool: BackendPool, policy: Policy, metrics: RouterMetrics, request_timeout_s: float,
                 backend_api_key: str | None = None) -> None:
        self.pool, self.policy, self.metrics = pool, policy, metrics
        self.client = pool.client
        self.timeout = httpx.Timeout(request_timeout_s, connect=ROUTER_CONNECT_TIMEOUT_S)
        self.backend_api_key = backend_api_key

    def headers(self, client_headers: dict[str, str]) -> dict[str, str]:
        """Returns the headers a backend call carries: JSON, and the backend key if the router
        has one, else the client's own Authorization."""
        out = {"content-type": "application/json"}
        auth = f"Bearer {self.backend_api_key}" if self.backend_api_key else client_headers.get("authorization")
        if auth:
            out["authorization"] = auth
        return out

    async def forward(self, path: str, body: dict[str, Any], headers: dict[str, str], role: str = "any") -> Response:
        """Returns the response of the first backend (policy order, `role`) that serves
        `body` at `path`; 503 if none can."""
        view = view_request(body)
        candidates = self.pool.available(role)
        if not candidates:
            self.metrics.no_backend.inc()
            return APIError(503, f"no healthy {'backend' if role == 'any' else role + ' backend'}",
                            "service_unavailable").response()
        backend_headers = self.headers(headers)
        ranking = await self.policy.rank(view, candidates, backend_headers)
        content = json.dumps(body).encode()
        last: Response | None = None
        for backend in ranking.order:
            if not backend.healthy:  # went down while we ranked or tried another
                continue
            self.metrics.requests.labels(backend.url, role).inc()
            if backend in ranking.hit_tokens:
                self.metrics.hit_tokens.labels(backend.url).inc(ranking.hit_tokens[backend])
            result = await self._try(backend, path, content, backend_headers, body.get("stream") is True)
            if not isinstance(result, _Failed):
                return result
            last = result.response or last
        if last is not None:
            return last
        self.metrics.no_backend.inc()
        return APIError(503, "every backend failed this request; see the router's log",
                        "service_unavailable").response()

    async def _try(self, backend: Backend, path: str, content: bytes, headers: dict[str, str],
                   stream: bool) -> Response | _Failed:
        request = self.client.build_request("POST", backend.url + path, content=content, headers=headers,
                                            timeout=self.timeout)
        backend.in_flight += 1
        handed_off = False
        try:
            try:
                resp = await self.client.send(request, stream=True)
            except httpx.TimeoutException as exc:
                return self._fail(backend, "timeout", exc, down=isinstance(exc, httpx.ConnectTimeout))
            except httpx.HTTPError as exc:
                return self._fail(backend, "connect", exc, down=True)
            streaming = False
            try:
                if resp.status_code != 200 or not stream:
                    data = await resp.aread()
                    out = Response(data, status_code=resp.status_code,
                                   media_type=resp.headers.get("content-type", "application/json"))
                    if resp.status_code in _MOVE_ON:
                        self.metrics.backend_errors.labels(backend.url, "status").inc()
                        if resp.status_code == 503:
                            self.pool.mark_down(backend, "answered 503")
                        return _Failed(out)
                    return out
                chunks = resp.aiter_raw()
                first = await chunks.__anext__()  # a backend dying before its first byte: next one
                streaming = True
            except (httpx.HTTPError, StopAsyncIteration) as exc:
                return self._fail(backend, "connect", exc, down=True)
            finally:
                if not streaming:
                    await resp.aclose()  # also when cancelled (the client hung up): the backend aborts
            handed_off = True
            release = releaser(backend, resp)
            return RelayResponse(self._relay(backend, first, chunks, release), release)
        finally:
            if not handed_off:
                backend.in_flight -= 1

    def _fail(self, backend: Backend, kind: str, exc: BaseException, down: bool) -> _Failed:
        self.metrics.backend_errors.labels(backend.url, kind).inc()
        if down:
            self.pool.mark_down(backend, f"{type(exc).__name__}: {exc}")
        return _Failed(None)

    async def _relay(self, backend: Backend, first: bytes, chunks: AsyncIterator[bytes],
                     release: Callable[[], Awaitable[None]]) -> AsyncIterator[bytes]:
        """Yields the backend's SSE bytes; a cut stream ends with an error event. Closing it
        (the client hung up) releases the backend's response, so the backend aborts."""
        try:
            yield first
            try:
                async for chunk in chunks:
                    yield chunk
            except httpx.HTTPError as exc:
                self.metrics.backend_errors.labels(backend.url, "stream").inc()
                self.pool.mark_down(backend, f"stream cut: {type(exc).__name__}")
                err = APIError(502, f"backend {backend.url} failed mid-stream", "internal_error").body()
                yield f"data: {json.dumps(err)}\n\n".encode()
        finally:
            await release()


def releaser(backend: Backend, resp: httpx.Response) -> Callable[[], Awaitable[None]]:
    """Returns a function that, on its first call only, ends the router's hold on `backend`
    and closes `resp` (shielded: it runs while a hung-up request is being cancelled)."""
    released = False

    async def release() -> None:
        nonlocal released
        if released:
            return
        released = True
        backend.in_flight -= 1
        with anyio.CancelScope(shield=True):
            await resp.aclose()

    return release
