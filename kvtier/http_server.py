"""Running a FastAPI app under uvicorn the way every kvtier HTTP command does: a socket bound
before heavy start-up (a taken port fails fast), one ready line on stdout once connections are
accepted, and a graceful SIGINT/SIGTERM shutdown that returns so the caller can clean up."""

from __future__ import annotations

import contextlib
import math
import signal
import socket
from collections.abc import Iterator
from typing import Any

from kvsettings import ProcessEnv
from kvstore.deadlines import KEEP_ALIVE_S


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


def resolve_api_key(flag: str | None) -> str | None:
    """Returns `--api-key`, else $KVTIER_API_KEY, else None; raises ValueError if it is empty."""
    key = flag if flag is not None else ProcessEnv.read().api_key
    if key is not None and not key.strip():
        raise ValueError("--api-key / $KVTIER_API_KEY is empty: give a key or unset it")
    return key


def socket_url(sock: socket.socket) -> str:
    """Returns the `http://host:port` URL a bound socket answers on."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def serve_app(app: Any, sock: socket.socket, ready_line: str, log_level: str, shutdown_grace: float,
              lifespan: bool = False) -> None:
    """Serves `app` on `sock` until SIGINT/SIGTERM, printing `ready_line` once it accepts
    connections (after the app's lifespan start-up, if `lifespan`); returns after a graceful
    shutdown (never re-raises the signal)."""
    import uvicorn

    config = uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="on" if lifespan else "off",
                            timeout_graceful_shutdown=math.ceil(shutdown_grace), timeout_keep_alive=KEEP_ALIVE_S)
    _make_server_class()(config, ready_line=ready_line).run(sockets=[sock])


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
