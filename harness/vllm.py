"""Real vLLM processes with kvtier's connector, for tests/vllm (run in vLLM's virtualenv) and
the benchmarks (which may start vLLM's virtualenv's Python from their own).

`VllmLLM` drives an `LLM` in a child process (harness/vllm_llm.py); `VllmServer` runs
`vllm serve` (the OpenAI server) on a free loopback port. Both run as harness/process.py's
`Child`, leading a process group that is gone after close, and every wait is bounded.
`start_together` starts several side by side. The tests' own vLLM helpers (the fp8 mark, KV
events): tests/fixtures/vllm.py.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import httpx

from harness.process import Child, http_ok, repo_env
from harness.redis import free_port
from harness.vllm_llm import MARK

START_TIMEOUT = 300.0
REQUEST_TIMEOUT = 300.0
SHUTDOWN_TIMEOUT = 60  # vllm serve drains this long on SIGINT (pending stores included)
# VllmServer's engine flags besides dtype and seed: vLLM's own prefix cache off, so every reuse is the connector's
ENGINE_FLAGS = ("--max-model-len", "4096", "--no-enable-prefix-caching")


def vllm_env(**extra: str) -> dict[str, str]:
    """Returns the environment for a vLLM child: both cores, a 2 GiB KV space, kvtier importable."""
    env = repo_env({"VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0-1"),
                    "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")})
    env.pop("OMP_NUM_THREADS", None)  # set to 1 for xdist workers; vLLM binds its own threads
    env.update(extra)
    return env


class VllmLLM:
    """An `LLM` with KVTierConnector in a child process; `generate` returns its outputs and metrics.
    vLLM runs in that one process (VLLM_ENABLE_V1_MULTIPROCESSING=0: its engine core and, on
    CPU, its worker in-process), each connector role still its own instance talking over the
    lookup channel; a start costs one process import instead of three.
    `VllmServer` runs vLLM's default layout."""

    def __init__(self, model: Path, extra_config: dict[str, Any], log: Path, env: dict[str, str] | None = None,
                 **spec: Any) -> None:
        spec = {"model": str(model), "extra_config": extra_config, **spec}
        self.log = log
        self.child = Child([sys.executable, "-m", "harness.vllm_llm", json.dumps(spec)], name="vLLM child",
                           log=log, env=vllm_env(VLLM_LOGGING_STREAM="ext://sys.stderr",
                                                 VLLM_ENABLE_V1_MULTIPROCESSING="0", **(env or {})),
                           own_group=True, stdin=subprocess.PIPE, answers=True)
        self.proc = self.child.proc
        try:
            self._answer(START_TIMEOUT)
        except BaseException:
            self.close()
            raise

    def _answer(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()  # the child answers or exits; either ends the read
            if not line:
                raise RuntimeError(f"vLLM child exited ({self.proc.poll()}); see {self.log}:\n{self.tail()}")
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
        raise TimeoutError(f"vLLM child gave no answer in {timeout} s; see {self.log}")

    def tail(self, n: int = 40) -> str:
        """Returns the last `n` lines of the child's log."""
        return "\n".join(self.child.log().splitlines()[-n:])

    def command(self, **cmd: Any) -> dict[str, Any]:
        """Sends one command; returns its answer."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._answer(REQUEST_TIMEOUT)

    def generate(self, prompts: list[list[int]], max_tokens: int = 8,
                 kv_transfer_params: dict[str, Any] | None = None, logprobs: int | None = None) -> dict[str, Any]:
        """Returns `{"outputs": [{"tokens", "cached", "logprobs"}...], "metrics": {...}}` for greedy runs."""
        return self.command(op="generate", prompts=prompts, max_tokens=max_tokens,
                            kv_transfer_params=kv_transfer_params, logprobs=logprobs)

    def close(self) -> None:
        """Asks the child to quit (its connector flushes), then stops it (SIGINT, then SIGKILL
        past SHUTDOWN_TIMEOUT) and what is left of its process group."""
        if self.proc.poll() is None and self.proc.stdin is not None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(SHUTDOWN_TIMEOUT)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.child.stop(signal.SIGINT, SHUTDOWN_TIMEOUT)
        self.child.close()


class VllmServer:
    """`vllm serve` (vLLM's OpenAI server) with KVTierConnector on a free loopback port; with
    `cli`, started as `kvtier-vllm serve` (kvtier/vllm_cli.py) instead. vLLM's default layout
    (front end, engine core and worker: three processes, the connector's roles in the last two),
    or with `worker_in_engine` the worker in the engine core's process (vLLM's `uni` executor,
    which its CPU build allows with VLLM_ENABLE_V1_MULTIPROCESSING=0): one process import less
    to start, the connector's roles still two instances talking over the lookup channel.
    `extra_config` None: no connector. `python` is the interpreter that runs it; `name` the
    served model name; `engine_flags` replace ENGINE_FLAGS; `env` updates vllm_env()'s;
    `args` are added last."""

    def __init__(self, model: Path, extra_config: dict[str, Any] | None, log: Path, kv_role: str = "kv_both",
                 *args: str, cli: bool = False, worker_in_engine: bool = False, python: str | Path = sys.executable,
                 name: str = "default", engine_flags: Sequence[str] = ENGINE_FLAGS,
                 shutdown_timeout: int = SHUTDOWN_TIMEOUT, start_timeout: float = START_TIMEOUT,
                 env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.stop_timeout = max(shutdown_timeout, SHUTDOWN_TIMEOUT) + 30
        kvt = {"kv_connector": "KVTierConnector", "kv_connector_module_path": "connector.vllm",
               "kv_role": kv_role, "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra_config}
        connector = ["--kv-transfer-config", json.dumps(kvt)] if extra_config is not None else []
        launcher = ["kvtier.vllm_cli", "serve"] if cli else ["vllm.entrypoints.openai.api_server"]
        cmd = [str(python), "-m", *launcher, "--model", str(model),
               "--served-model-name", name, "--host", "127.0.0.1", "--port", str(self.port),
               "--dtype", "float32", "--enforce-eager", *engine_flags, "--seed", "0",
               "--shutdown-timeout", str(shutdown_timeout), *connector, *args]
        environ = vllm_env(**(env or {}))
        if worker_in_engine:
            cmd += ["--distributed-executor-backend", "uni"]
            environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        self.child = Child(cmd, name="vllm serve", log=log, env=environ, own_group=True)
        self.proc = self.child.proc
        self.child.wait_ready(lambda: http_ok(f"{self.url}/health"), start_timeout, 0.5)

    def tail(self, n: int = 40) -> str:
        """Returns the last `n` lines of the server's log."""
        return "\n".join(self.child.log().splitlines()[-n:])

    def metrics(self) -> dict[str, float]:
        """Returns /metrics' kvtier counters, summed over label sets, and vLLM's prompt tokens
        cached by source, as `vllm:prompt_tokens_cached_by_source.<source>` (as VllmLLM does)."""
        out: dict[str, float] = {}
        for line in httpx.get(f"{self.url}/metrics", timeout=30).text.splitlines():
            if line.startswith("kvtier:"):
                name, value = line.rsplit(" ", 1)
                key = name.split("{", 1)[0]
            elif line.startswith("vllm:prompt_tokens_cached_by_source"):
                name, value = line.rsplit(" ", 1)
                key = "vllm:prompt_tokens_cached_by_source." + name.split('source="', 1)[1].split('"', 1)[0]
            else:
                continue
            out[key] = out.get(key, 0.0) + float(value)
        return out

    def close(self) -> int:
        """Stops the server as an operator would, SIGINT to its front end (SIGKILL to the group
        past a bound); returns the exit code. It drains (`--shutdown-timeout`): the connector's
        pending stores keep the engine stepping until they landed."""
        code = self.child.stop(signal.SIGINT, self.stop_timeout)
        self.child.close()
        return code


Started = TypeVar("Started", bound=VllmLLM | VllmServer)


def start_together(*starts: Callable[[], Started]) -> list[Started]:
    """Runs the `starts` (each starts one vLLM process and waits until it is ready) side by side;
    returns what they started, in order. A vLLM start is single-threaded Python imports in three
    processes one after the other (front end, engine core, worker), so two starts side by side
    use both cores and end well before two in a row would; the processes then serve one at a
    time (an idle vLLM sleeps). If a start fails, the others are closed and its error is raised."""
    with concurrent.futures.ThreadPoolExecutor(len(starts)) as pool:
        futures = [pool.submit(start) for start in starts]
        concurrent.futures.wait(futures)
    started = [f.result() for f in futures if f.exception() is None]
    if len(started) < len(futures):
        for proc in started:
            proc.close()
        raise next(e for f in futures if (e := f.exception()) is not None)
    return started


def close_together(*procs: VllmLLM | VllmServer) -> None:
    """Closes `procs` side by side (each waits seconds for vLLM's shutdown); returns when all
    have exited."""
    with concurrent.futures.ThreadPoolExecutor(max(1, len(procs))) as pool:
        list(pool.map(lambda proc: proc.close(), procs))
