"""What `kvtier serve` and `kvtier router` both do at their HTTP edge, implemented once:
every error answered in OpenAI's shape (`APIError`), the bearer API key, and a bound on
request bodies (declared or streamed)."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from connector.bearer_auth import bearer_key
from kvtier.server.openai_protocol import APIError

MAX_BODY_BYTES = 64 << 20  # a request body past this is refused


def unauthorized() -> APIError:
    """The 401 of a request without a valid API key (kvtier serve, its tenants, kvtier router)."""
    return APIError(401, "Invalid or missing API key (send Authorization: Bearer <key>).",
                    "authentication_error", code="invalid_api_key")


def install_edge(app: FastAPI, api_key: str | None, logger: logging.Logger,
                 max_body_bytes: int = MAX_BODY_BYTES) -> list[Any]:
    """Makes `app` answer every error in OpenAI's shape (crashes logged on `logger` and
    answered 500) and refuse bodies over `max_body_bytes` (413); returns the dependencies a
    route lists to require `Authorization: Bearer <api_key>` (none if `api_key` is None)."""

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        msg = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
        return APIError(400, msg, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "NotFoundError" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), kind).response()

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("request failed")
        return APIError(500, f"internal error: {type(exc).__name__}", "internal_error").response()

    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    if api_key is None:
        return []

    async def require_key(request: Request) -> None:
        if bearer_key(request.headers.get("authorization", ""), [api_key]) is None:
            raise unauthorized()

    return [Depends(require_key)]


class BodyLimit:
    """Refuses (413) a request whose body exceeds `max_bytes`: before reading it when its
    Content-Length says so, else once the bytes received pass the bound (a chunked body
    declares no length), so no handler ever holds more than `max_bytes` of body."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_big = f"request body over {self.max_bytes} bytes"
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                await APIError(413, too_big).response()(scope, receive, send)
                return
        received = 0

        async def bounded_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # FastAPI passes an HTTPException raised while it reads a body on to the
                    # app's handler (http_error above) instead of turning it into a 400.
                    raise HTTPException(413, too_big)
            return message

        await self.app(scope, bounded_receive, send)
