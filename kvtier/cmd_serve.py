"""`kvtier serve`: an OpenAI-compatible HTTP server over one engine (and its KV connector)."""

from __future__ import annotations

import argparse
import logging
import os

from kvtier.http_server import bind_socket, serve_app, socket_url

HELP = "serve the engine over an OpenAI-compatible HTTP API (completions, chat, /metrics, /kv/lookup)"
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
    g.add_argument("--max-queue", type=int, default=256, metavar="N",
                   help="requests admitted beyond one batch (--max-num-seqs); more get 429 (default: 256)")
    g.add_argument("--shutdown-grace", type=float, default=5.0, metavar="S",
                   help="seconds in-flight requests get to finish on SIGINT/SIGTERM (default: 5)")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="log level (default: info)")
    from connector.cli import add_connector_arguments
    from kvtier.engine_args import add_engine_arguments

    add_engine_arguments(parser)
    add_connector_arguments(parser)


def _resolve_api_key(args: argparse.Namespace) -> str | None:
    key = args.api_key if args.api_key is not None else os.environ.get("KVTIER_API_KEY")
    if key is not None and not key.strip():
        raise ValueError("--api-key / $KVTIER_API_KEY is empty: give a key or unset it")
    return key


def run(args: argparse.Namespace) -> int:
    """Loads the model, serves until SIGINT/SIGTERM, then drains, flushes stores and exits 0."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    api_key = _resolve_api_key(args)
    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    sock = bind_socket(args.host, args.port)  # before the model loads: a taken port fails fast

    from kvtier.engine_args import build_llm
    from kvtier.server.app import build_app
    from kvtier.server.engine_loop import EngineLoop
    from kvtier.server.metrics import ServerMetrics
    from kvtier.server.serving import ServingContext

    llm = build_llm(args)
    try:
        name = args.served_model_name or (os.path.basename(os.path.normpath(args.model)) if args.model
                                          else DEFAULT_MODEL_NAME)
        metrics = ServerMetrics(name, llm.engine.kv_connector)
        loop = EngineLoop(llm.engine, args.max_queue, on_step=metrics.on_step, on_forget=metrics.forget)
        app = build_app(ServingContext(loop, name), metrics, api_key)
        loop.start()
        serve_app(app, sock, f"kvtier serve listening on {socket_url(sock)}", args.log_level, args.shutdown_grace)
        loop.stop()
    finally:
        llm.shutdown()  # flushes the connector's queued stores
    return 0
