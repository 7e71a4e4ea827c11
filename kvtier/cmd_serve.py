"""`kvtier serve`: an OpenAI-compatible HTTP server over one engine (and its KV connector)."""

from __future__ import annotations

import argparse
import os

from kvstore.deadlines import SHUTDOWN_GRACE_S
from kvtier.http_server import bind_socket, resolve_api_key, serve_app, socket_url
from kvtier.log_setup import ENGINE_LOG_HELP

HELP = "serve the engine over an OpenAI-compatible HTTP API (completions, chat, /metrics, /kv/lookup)"
LOG_LEVEL_HELP = ENGINE_LOG_HELP
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", metavar="HOST",
                   help="address to bind (default: 127.0.0.1, loopback only)")
    g.add_argument("--port", type=int, default=8000, metavar="N", help="TCP port; 0 picks a free one (default: 8000)")
    g.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model name clients send (default: the checkpoint dir's name)")
    g.add_argument("--api-key", default=None, metavar="KEY",
                   help="require Authorization: Bearer KEY on /v1/* and /kv/* (default: $KVTIER_API_KEY, else none)")
    g.add_argument("--tenants", default=None, metavar="FILE",
                   help="JSON/YAML file of tenant API key -> cache_salt (or -> {cache_salt, name}: the name labels "
                        "its figures in /metrics): a tenant's requests run under its salt "
                        "(another salt is refused, 403); needs --api-key, the operator's key (default: none, "
                        "clients choose cache_salt as in vLLM)")
    g.add_argument("--max-queue", type=int, default=256, metavar="N",
                   help="requests admitted beyond one batch (--max-num-seqs); more get 429 (default: 256)")
    g.add_argument("--shutdown-grace", type=float, default=SHUTDOWN_GRACE_S, metavar="SECONDS",
                   help=f"seconds in-flight requests get to finish on SIGINT/SIGTERM (default: {SHUTDOWN_GRACE_S:g})")
    g.add_argument("--kv-role", default="both", choices=["both", "producer", "consumer"],
                   help="disaggregated prefill: a producer answers one token and returns once the prompt's K/V is "
                        "in its tiers; a consumer loads it from the shared tier and decodes; both = a plain server "
                        "(default: both)")
    from kvtier.engine_args import add_model_arguments

    add_model_arguments(parser)  # --log-level: kvtier/cli.py adds it and configures logging


def _check_kv_role(role: str, connector: object) -> None:
    """Raises ValueError unless a producer or consumer has a tier another process can read."""
    if role == "both":
        return
    from connector.engine_connector import EngineConnector

    if not isinstance(connector, EngineConnector):
        raise ValueError(f"--kv-role {role} needs a KV connector with a shared tier (--kv-tier redis://... or kvtier://...)")
    schemes = [t.scheme for t in connector.config.kvstore.tiers]
    if all(s in ("device", "cpu") for s in schemes):
        raise ValueError(f"--kv-role {role}: tiers {schemes} are private to this process; add a shared one "
                         "(redis://, kvtier://, or a disk:// directory both servers use)")


def run(args: argparse.Namespace) -> int:
    """Loads the model, serves until SIGINT/SIGTERM, then drains, flushes stores and exits 0."""
    api_key = resolve_api_key(args.api_key)
    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    from kvtier.server.tenant_auth import TenantKeys

    tenants = TenantKeys.load(args.tenants, api_key) if args.tenants else None  # before the model loads
    sock = bind_socket(args.host, args.port)  # before the model loads: a taken port fails fast

    from kvtier.engine_args import build_llm
    from kvtier.server.engine_loop import EngineLoop
    from kvtier.server.server_app import build_app
    from kvtier.server.server_metrics import ServerMetrics
    from kvtier.server.serving import ServingContext

    llm = build_llm(args)
    try:
        name = args.served_model_name or (os.path.basename(os.path.normpath(args.model)) if args.model
                                          else DEFAULT_MODEL_NAME)
        metrics = ServerMetrics(name, llm.engine.kv_connector)
        if tenants is not None:
            metrics.label_tenants(tenants.names)
        metrics.watch_engine(llm.engine)
        loop = EngineLoop(llm.engine, args.max_queue, on_step=metrics.on_step, on_forget=metrics.forget)
        _check_kv_role(args.kv_role, llm.engine.kv_connector)
        app = build_app(ServingContext(loop, name, args.kv_role), metrics, api_key, tenants=tenants)
        loop.start()
        serve_app(app, sock, f"kvtier serve listening on {socket_url(sock)}", args.log_level, args.shutdown_grace)
        loop.stop()
    finally:
        llm.shutdown()  # flushes the connector's queued stores
    return 0
