"""A real `kvtier cache-server` process on a free loopback port, for tests and benchmarks (the
pytest fixtures over it: tests/fixtures/cache_server.py)."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Sequence

from harness.process import Child, repo_env

_START_TIMEOUT_S = 60.0


class CacheServerProcess:
    """One server process; `args` are extra command-line arguments (e.g. --max-bytes);
    `prefix` runs it under a wrapper command (e.g. setpriv to drop capabilities)."""

    def __init__(self, *args: str, port: int = 0, prefix: Sequence[str] = ()) -> None:
        self.args = list(args)
        self.port = port
        self.prefix = list(prefix)
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"kvtier://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Starts the server (on the same port as before, after a stop) and waits until it listens.
        Its output goes to a log file (`log()`): a pipe nobody reads would stall a server that
        logs more than the pipe holds."""
        cmd = [*self.prefix, sys.executable, "-m", "kvtier.cmd_cache_server", "--port", str(self.port), *self.args]
        self.child = Child(cmd, name="cache server", env=repo_env())
        self.proc = self.child.proc
        line = self.child.wait_line("kvtier cache-server listening on ", _START_TIMEOUT_S)
        self.port = int(line.rsplit(":", 1)[1])

    def log(self) -> str:
        """Returns what the server has written (stderr, and its ready line) so far."""
        return self.child.log()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Signals the server and returns its exit code."""
        return self.stop_and_read(sig, timeout)[0]

    def stop_and_read(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> tuple[int, str]:
        """Signals the server; returns its exit code and everything it wrote. Past `timeout`
        it is killed and subprocess.TimeoutExpired raised."""
        code = self.child.stop(sig, timeout, strict=True)
        err = self.log()
        self.child.close()
        return code, err

    def restart(self) -> None:
        self.stop()
        self.start()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def memory_bytes(self, field: str) -> int:
        """Returns a memory field of the server's /proc/<pid>/status in bytes: VmRSS (resident
        now) or VmHWM (the kernel's resident peak)."""
        assert self.proc is not None
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) << 10
        raise AssertionError(f"{field} not in /proc/{self.proc.pid}/status")

    def kill(self) -> None:
        if self.alive():
            self.child.kill()
