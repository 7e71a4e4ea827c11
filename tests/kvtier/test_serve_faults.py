"""`kvtier serve` when a tier stops answering, on real processes: a SIGSTOPped cache server
costs a lookup at most its deadline, the request recomputes with the right tokens, the tier's
breaker opens and later closes (shown in /metrics), and hits return; SIGTERM ends within the
flush bound while the disk tier's directory is locked by another process (a disk that never
answers), dropping the queued stores and saying how many."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from harness.cache_server import CacheServerProcess
from harness.polling import wait_until
from harness.serve import ENGINE_ARGS, ServeProcess, metrics
from harness.text import long_text
from tests.fixtures.tiers import hold_dir_lock

pytestmark = pytest.mark.slow
LOOKUP_S = 0.5
SLACK_S = 1.5  # a shared, loaded machine; the cache server's calls used to wait up to 10 s


def _complete(url: str, prompt: str) -> dict:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0}
    r = httpx.post(url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _lookup(url: str, prompt: str) -> int:
    look = httpx.post(url + "/kv/lookup", json={"prompt": prompt}, timeout=60).json()
    return int(sum(look["tiers"].values()))


def test_a_frozen_cache_server_costs_a_lookup_its_deadline_and_requests_recompute(
        default_model_path: Path, cache_server_factory: type[CacheServerProcess]) -> None:
    cache = cache_server_factory("--max-bytes", "256MiB")
    assert cache.proc is not None
    tier = f"{cache.url}?lookup_timeout_s={LOOKUP_S}&load_timeout_s=1"
    s = ServeProcess("--model", str(default_model_path), *ENGINE_ARGS, "--kv-tier", tier, "--chunk-size", "64",
                     env={"KVTIER_BACKOFF_INITIAL_S": "0.2", "KVTIER_BACKOFF_MAX_S": "0.5"})
    try:
        prompt = long_text(4)
        cold = _complete(s.url, prompt)
        n = cold["usage"]["prompt_tokens"]
        assert wait_until(lambda: _lookup(s.url, prompt) == n - 1, 60.0, 0.1)  # every chunk landed in the cache server
        name = next(k.split("[")[1][:-1] for k in metrics(s.url) if k.startswith("kvtier:kv_tier_timeouts"))

        def reset_prefix_cache() -> None:
            assert httpx.post(s.url + "/kv/reset_prefix_cache", timeout=60).json() == {"reset": True}

        reset_prefix_cache()
        os.kill(cache.proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            found = _lookup(s.url, prompt)
            took = time.monotonic() - t0
            assert found == 0 and took < LOOKUP_S + SLACK_S, f"/kv/lookup took {took:.2f}s"
            frozen = _complete(s.url, prompt)  # the breaker is open: no call, the prompt recomputes
            assert frozen["choices"][0]["text"] == cold["choices"][0]["text"]
            assert frozen["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            m = metrics(s.url)
            assert m[f"kvtier:kv_tier_timeouts_total[{name}]"] >= 1
            assert m[f"kvtier:kv_tier_breaker_opens_total[{name}]"] >= 1
            assert m[f"kvtier:kv_tier_skipped_calls_total[{name}]"] >= 1
            assert m[f"kvtier:kv_tier_breaker_state[{name}]"] >= 1  # reads open or half-open
            assert httpx.get(s.url + "/health", timeout=5).status_code == 200
        finally:
            os.kill(cache.proc.pid, signal.SIGCONT)
        assert wait_until(lambda: _lookup(s.url, prompt) == n - 1, 60.0, 0.1)  # a probe closed the breaker
        assert metrics(s.url)[f"kvtier:kv_tier_breaker_state[{name}]"] == 0  # reads and writes closed
        reset_prefix_cache()
        warm = _complete(s.url, prompt)
        assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == n - 1  # loaded from the server again
        assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
    finally:
        assert s.stop() == 0, s.log()[-3000:]


def test_sigterm_ends_within_the_flush_bound_while_the_disk_never_answers(default_model_path: Path,
                                                                           tmp_path: Path) -> None:
    root = tmp_path / "kv"
    s = ServeProcess("--model", str(default_model_path), *ENGINE_ARGS, "--kv-tier", "cpu",
                     "--kv-tier", f"disk://{root}", "--chunk-size", "64", env={"KVTIER_FLUSH_TIMEOUT_S": "1"})
    try:
        with hold_dir_lock(root):  # every write to the directory now waits for this process
            for i in range(3):
                _complete(s.url, f"Request {i}. " + long_text(6))
            assert wait_until(lambda: metrics(s.url)["kvtier:kv_slow_tier_writes_pending"] >= 2, 60.0, 0.1)
            assert httpx.get(s.url + "/health", timeout=5).status_code == 200
            s.proc.send_signal(signal.SIGTERM)
            try:
                code = s.proc.wait(60)  # before the bound, the flush waited for the disk forever
            except subprocess.TimeoutExpired:
                pytest.fail(f"kvtier serve did not end after SIGTERM:\n{s.log()[-3000:]}")
        log = s.log()
        assert code == 0, log[-3000:]
        assert "shutdown flush ran out of time (flush_timeout_s=1)" in log and "dropped" in log, log[-3000:]
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait()
