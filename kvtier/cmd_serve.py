"""`kvtier serve`: an OpenAI-compatible HTTP server over one engine (and its KV connector)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
from collections.abc import Iterator
from typing import Any

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


def bind_socket(host: str, port: int) -> socket.socket:
    """Returns a listening-ready socket bound to (host, port); port 0 picks a free one.
    Raises ValueError naming the address if it cannot be bound."""
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {port}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


def run(args: argparse.Namespace) -> int:
    """Loads the model, serves until SIGINT/SIGTERM, then drains, flushes stores and exits 0."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    api_key = _resolve_api_key(args)
    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    sock = bind_socket(args.host, args.port)  # before the model loads: a taken port fails fast

    import uvicorn

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
        host, port = sock.getsockname()[:2]
        url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        config = uvicorn.Config(app, log_level=args.log_level, access_log=False, lifespan="off",
                                timeout_graceful_shutdown=args.shutdown_grace)
        server = _make_server_class()(config, ready_line=f"kvtier serve listening on {url}")
        loop.start()
        server.run(sockets=[sock])
        loop.stop()
    finally:
        llm.shutdown()  # flushes the connector's queued stores
    return 0


def _make_server_class() -> Any:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server that prints one ready line once it accepts connections and, on
        SIGINT/SIGTERM, shuts down gracefully and returns (uvicorn would re-raise the signal
        after its graceful shutdown, killing the process before our stores are flushed)."""

        def __init__(self, config: uvicorn.Config, ready_line: str) -> None:
            super().__init__(config)
            self.ready_line = ready_line

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if self.started:
                print(self.ready_line, flush=True)

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            originals = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in originals.items():
                    signal.signal(sig, handler)

    return Server
