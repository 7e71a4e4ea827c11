"""The router's relayed stream releases its backend (in-flight count, backend response)
exactly once however the response ends, including when the client left before the first
byte, when Starlette never starts the body generator at all.

These drive Starlette's own `StreamingResponse.__call__` through the ASGI interface with
the `send`/`receive` a server passes when the client is gone: `send` raising OSError
(ASGI 2.4) or a disconnect message winning over a stalled send (earlier specs).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import pytest
from starlette.requests import ClientDisconnect

from kvtier.router.backends import Backend
from kvtier.router.proxy import RelayResponse, releaser


class _BackendBody(httpx.AsyncByteStream):
    """The backend response's body: records whether the router closed it."""

    def __init__(self) -> None:
        self.closed = 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield b"data: {}\n\n"

    async def aclose(self) -> None:
        self.closed += 1


def _relay(backend: Backend) -> tuple[RelayResponse, _BackendBody, list[bool]]:
    body = _BackendBody()
    release = releaser(backend, httpx.Response(200, stream=body))
    backend.in_flight += 1  # what Proxy._try holds when it hands the stream off
    started: list[bool] = []

    async def chunks() -> AsyncIterator[bytes]:  # shaped like Proxy._relay
        started.append(True)
        try:
            yield b"data: {}\n\n"
        finally:
            await release()

    return RelayResponse(chunks(), release), body, started


def _scope(spec: str) -> dict[str, Any]:
    return {"type": "http", "asgi": {"spec_version": spec}}


def test_client_gone_before_the_first_byte_asgi_2_4() -> None:
    backend = Backend("http://127.0.0.1:1")
    response, body, started = _relay(backend)

    async def receive() -> dict[str, Any]:
        await anyio.sleep_forever()
        raise AssertionError

    async def send(message: dict[str, Any]) -> None:
        raise OSError("the client closed its socket")

    async def main() -> None:
        with pytest.raises(ClientDisconnect):
            await response(_scope("2.4"), receive, send)

    anyio.run(main)
    assert not started  # the body generator never ran: its cleanup could not have released
    assert backend.in_flight == 0 and body.closed == 1


def test_client_gone_before_the_first_byte_earlier_asgi() -> None:
    backend = Backend("http://127.0.0.1:1")
    response, body, started = _relay(backend)

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        await anyio.sleep_forever()  # the response start never gets out

    anyio.run(response, _scope("2.3"), receive, send)
    assert not started and backend.in_flight == 0 and body.closed == 1


def test_a_stream_sent_whole_releases_once() -> None:
    backend = Backend("http://127.0.0.1:1")
    response, body, started = _relay(backend)
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        await anyio.sleep_forever()
        raise AssertionError

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    anyio.run(response, _scope("2.4"), receive, send)
    assert started and sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    assert backend.in_flight == 0 and body.closed == 1  # generator and response both ran cleanup: once
