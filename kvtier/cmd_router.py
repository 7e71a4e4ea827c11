"""`kvtier router`: one OpenAI-compatible endpoint in front of several `kvtier serve`
instances, routing each request by KV hit (`kv-aware`), by prompt prefix (`prefix-hash`) or
in turn (`round-robin`); or, with `--prefill` and `--decode`, prefill on one instance and
decode on another through their shared KV tier."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from kvstore.deadlines import (
    ROUTER_HEALTH_INTERVAL_S,
    ROUTER_LOOKUP_TIMEOUT_S,
    ROUTER_REQUEST_TIMEOUT_S,
    SHUTDOWN_GRACE_S,
)
from kvtier.http_server import bind_socket, resolve_api_key, serve_app, socket_url
from kvtier.router import POLICIES

HELP = "route OpenAI requests across several `kvtier serve` instances (KV-aware, disaggregated prefill)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("backends")
    g.add_argument("--backend", action="append", default=[], metavar="URL",
                   help="a `kvtier serve` base URL, e.g. http://127.0.0.1:8001 (repeatable)")
    g.add_argument("--prefill", action="append", default=[], metavar="URL",
                   help="a `kvtier serve --kv-role producer` URL (repeatable; needs --decode)")
    g.add_argument("--decode", action="append", default=[], metavar="URL",
                   help="a `kvtier serve --kv-role consumer` URL (repeatable; needs --prefill)")
    g.add_argument("--policy", default="kv-aware", choices=POLICIES,
                   help="how a backend is picked per request (default: kv-aware)")
    g.add_argument("--lookup-timeout", type=float, default=ROUTER_LOOKUP_TIMEOUT_S, metavar="SECONDS",
                   help="kv-aware: seconds to wait for each backend's /kv/lookup; late = no hit "
                        f"(default: {ROUTER_LOOKUP_TIMEOUT_S})")
    g.add_argument("--balance-threshold", type=int, default=16, metavar="N",
                   help="kv-aware: a backend with more than N requests (running + waiting) above the least loaded "
                        "one ranks last, whatever it holds (default: 16)")
    g.add_argument("--health-interval", type=float, default=ROUTER_HEALTH_INTERVAL_S, metavar="SECONDS",
                   help=f"seconds between health checks of each backend (default: {ROUTER_HEALTH_INTERVAL_S})")
    g.add_argument("--request-timeout", type=float, default=ROUTER_REQUEST_TIMEOUT_S, metavar="SECONDS",
                   help="seconds a backend may take to answer or between stream chunks "
                        f"(default: {ROUTER_REQUEST_TIMEOUT_S:g})")
    g.add_argument("--backend-api-key", default=None, metavar="KEY",
                   help="API key sent to the backends (default: forward the client's Authorization header)")
    s = parser.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", metavar="HOST", help="address to bind (default: 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, metavar="N", help="TCP port; 0 picks a free one (default: 8000)")
    s.add_argument("--api-key", default=None, metavar="KEY",
                   help="require Authorization: Bearer KEY on /v1/* (default: $KVTIER_API_KEY, else none)")


def _backends(args: argparse.Namespace) -> tuple[list[tuple[str, str]], bool]:
    """Returns [(url, role)] and whether the router is disaggregated; ValueError naming the flag."""
    if args.backend and (args.prefill or args.decode):
        raise ValueError("give either --backend or --prefill/--decode, not both")
    if bool(args.prefill) != bool(args.decode):
        raise ValueError("disaggregated prefill needs both --prefill and --decode")
    pairs = [(u, "any") for u in args.backend] + [(u, "prefill") for u in args.prefill] + \
            [(u, "decode") for u in args.decode]
    if not pairs:
        raise ValueError("give at least one --backend URL (or --prefill and --decode)")
    for url, _ in pairs:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"a backend URL must start with http:// or https://, got {url!r}")
    return [(u.rstrip("/"), r) for u, r in pairs], bool(args.prefill)


def run(args: argparse.Namespace) -> int:
    """Serves the router until SIGINT/SIGTERM; returns 0."""
    if args.log_level != "debug":  # httpx logs every proxied call at INFO
        logging.getLogger("httpx").setLevel(logging.WARNING)
    pairs, disaggregated = _backends(args)
    if args.balance_threshold < 0:
        raise ValueError(f"--balance-threshold must be >= 0, got {args.balance_threshold}")
    for flag in ("lookup_timeout", "health_interval", "request_timeout"):
        if getattr(args, flag) <= 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
    api_key = resolve_api_key(args.api_key)
    sock = bind_socket(args.host, args.port)
    app = build(args, pairs, disaggregated, api_key)
    serve_app(app, sock, f"kvtier router listening on {socket_url(sock)}", args.log_level, SHUTDOWN_GRACE_S,
              lifespan=True)
    return 0


def build(args: argparse.Namespace, pairs: list[tuple[str, str]], disaggregated: bool, api_key: str | None) -> Any:
    """Returns the router app; its lifespan checks every backend once before it serves, then
    keeps checking them, and closes the HTTP client at exit."""
    import contextlib
    from collections.abc import AsyncIterator

    import httpx
    from fastapi import FastAPI

    from kvtier.router.app import build_app
    from kvtier.router.backends import Backend, BackendPool
    from kvtier.router.metrics import RouterMetrics
    from kvtier.router.policy import make_policy
    from kvtier.router.proxy import Proxy

    client = httpx.AsyncClient(limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
    metrics = RouterMetrics()
    pool = BackendPool([Backend(u, r) for u, r in pairs], client, interval_s=args.health_interval)
    policy = make_policy(args.policy, pool, metrics, args.lookup_timeout, args.balance_threshold)
    proxy = Proxy(pool, policy, metrics, args.request_timeout, args.backend_api_key)
    app = build_app(proxy, pool, metrics, disaggregated, api_key)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await pool.check_all()
        down = [b.url for b in pool.backends if not b.healthy]
        if down:
            logging.getLogger("kvtier.router").warning("backends down at start-up (retried every %.1fs): %s",
                                                       args.health_interval, ", ".join(down))
        pool.start()
        yield
        await pool.stop()
        await client.aclose()

    app.router.lifespan_context = lifespan
    return app
