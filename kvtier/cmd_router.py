"""`kvtier router`: one OpenAI-compatible endpoint in front of several `kvtier serve`
instances, routing each request by KV hit (`kv-aware`), by prompt prefix (`prefix-hash`) or
in turn (`round-robin`); or, with `--prefill` and `--decode`, prefill on one instance and
decode on another through their shared KV tier."""

from __future__ import annotations

import argparse
import logging
from dataclasses import fields
from typing import Any

from kvstore.deadlines import SHUTDOWN_GRACE_S
from kvtier.cli_help import add_config_arguments
from kvtier.http_server import bind_socket, resolve_api_key, serve_app, socket_url
from kvtier.router.router_config import BACKEND_FLAGS, RouterConfig

HELP = "route OpenAI requests across several `kvtier serve` instances (KV-aware, disaggregated prefill)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the router's flags, each built from its `RouterConfig` field (kvtier/router/router_config.py)."""
    add_config_arguments(parser.add_argument_group("backends"), RouterConfig, BACKEND_FLAGS)
    add_config_arguments(parser.add_argument_group("server"), RouterConfig,
                         [f.name for f in fields(RouterConfig) if f.name not in BACKEND_FLAGS])


def run(args: argparse.Namespace) -> int:
    """Serves the router until SIGINT/SIGTERM; returns 0."""
    if args.log_level != "debug":  # httpx logs every proxied call at INFO
        logging.getLogger("httpx").setLevel(logging.WARNING)
    config = RouterConfig(**{f.name: getattr(args, f.name) for f in fields(RouterConfig)}).validate()
    api_key = resolve_api_key(config.api_key)
    sock = bind_socket(config.host, config.port)
    app = build(config, api_key)
    serve_app(app, sock, f"kvtier router listening on {socket_url(sock)}", args.log_level, SHUTDOWN_GRACE_S,
              lifespan=True)
    return 0


def build(config: RouterConfig, api_key: str | None) -> Any:
    """Returns the router app; its lifespan checks every backend once before it serves, then
    keeps checking them, and closes the HTTP client at exit."""
    import contextlib
    from collections.abc import AsyncIterator

    import httpx
    from fastapi import FastAPI

    from kvtier.router.backends import Backend, BackendPool
    from kvtier.router.policy import make_policy
    from kvtier.router.proxy import Proxy
    from kvtier.router.router_app import build_app
    from kvtier.router.router_metrics import RouterMetrics

    client = httpx.AsyncClient(limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
    metrics = RouterMetrics()
    pool = BackendPool([Backend(u, r) for u, r in config.pairs()], client, interval_s=config.health_interval)
    policy = make_policy(config.policy, pool, metrics, config.lookup_timeout, config.balance_threshold)
    proxy = Proxy(pool, policy, metrics, config.request_timeout, config.backend_api_key)
    app = build_app(proxy, pool, metrics, config.disaggregated, api_key)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await pool.check_all()
        down = [b.url for b in pool.backends if not b.healthy]
        if down:
            logging.getLogger("kvtier.router").warning("backends down at start-up (retried every %.1fs): %s",
                                                       config.health_interval, ", ".join(down))
        pool.start()
        yield
        await pool.stop()
        await client.aclose()

    app.router.lifespan_context = lifespan
    return app
