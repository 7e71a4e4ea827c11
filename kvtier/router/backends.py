"""The router's backends: their URLs, health and the requests it has in flight on each.

Health is learned two ways: a periodic `GET /health` (a backend that fails it is skipped
until it passes again) and every proxied call (a refused connection or a 503 marks the
backend down at once, so no later request is sent there before a health check passes).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

import httpx

from kvstore.deadlines import ROUTER_HEALTH_INTERVAL_S, ROUTER_HEALTH_TIMEOUT_S

logger = logging.getLogger("kvtier.router")


@dataclass(eq=False)
class Backend:
    """One `kvtier serve` instance as the router sees it."""

    url: str
    role: str = "any"  # "any", or "prefill" / "decode" in disaggregated mode
    healthy: bool = False  # until the first health check passes
    in_flight: int = 0  # requests this router has open on it

    def __str__(self) -> str:
        return self.url


class BackendPool:
    """The backends and their health; health checks run as one asyncio task."""

    def __init__(self, backends: list[Backend], client: httpx.AsyncClient,
                 interval_s: float = ROUTER_HEALTH_INTERVAL_S, timeout_s: float = ROUTER_HEALTH_TIMEOUT_S) -> None:
        if not backends:
            raise ValueError("the router needs at least one backend")
        urls = [b.url for b in backends]
        if len(set(urls)) != len(urls):
            raise ValueError(f"a backend URL is given twice: {urls}")
        self.backends = backends
        self.client = client
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self._task: asyncio.Task[None] | None = None

    def available(self, role: str = "any") -> list[Backend]:
        """Returns the healthy backends of `role`, in configuration order."""
        return [b for b in self.backends if b.healthy and b.role == role]

    def mark_down(self, backend: Backend, reason: str) -> None:
        """Takes `backend` out of rotation until a health check passes."""
        if backend.healthy:
            logger.warning("backend %s is down (%s); skipped until its health check passes", backend, reason)
        backend.healthy = False

    async def check(self, backend: Backend) -> bool:
        """Returns whether `backend` answers `GET /health` with 200 now, and records it."""
        try:
            ok = (await self.client.get(f"{backend.url}/health", timeout=self.timeout_s)).status_code == 200
        except httpx.HTTPError:
            ok = False
        if ok and not backend.healthy:
            logger.info("backend %s is up", backend)
        elif not ok:
            self.mark_down(backend, "health check failed")
        backend.healthy = ok
        return ok

    async def check_all(self) -> None:
        """Checks every backend once, concurrently."""
        await asyncio.gather(*(self.check(b) for b in self.backends))

    def start(self) -> None:
        """Starts the periodic health checks on the running event loop."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Stops the health checks."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.check_all()
