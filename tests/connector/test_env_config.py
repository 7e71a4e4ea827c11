"""The environment alone configures the connector, as LMCACHE_CONFIG_FILE does for LMCache:
`LLM()` and `kvtier generate` with KVTIER_TIERS / KVTIER_CONFIG and no connector argument
store and reuse K/V; an unreachable tier is one warning and generation still works."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from harness import process
from harness.redis import free_port
from harness.text import long_text

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
PARAMS = SamplingParams(temperature=0.0, max_tokens=3)
ENV_VARS = ("KVTIER_CONFIG", "KVTIER_TIERS", "LMCACHE_CONFIG_FILE")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def _llm(model: Path, **kw) -> LLM:
    return LLM(str(model), device="cpu", dtype="float32", enable_prefix_caching=False, num_gpu_blocks=128, **kw)


def test_kvtier_tiers_alone_enables_the_connector_in_llm(default_model_path: Path, clean_env) -> None:
    with _llm(default_model_path) as llm:
        assert llm.engine.kv_connector is None  # nothing in the environment: no connector
    clean_env.setenv("KVTIER_TIERS", "cpu?budget=1GiB")
    clean_env.setenv("KVTIER_CHUNK_SIZE", "64")
    with _llm(default_model_path, kv_connector=False) as llm:
        assert llm.engine.kv_connector is None  # the opt-out beats the environment
    prompt = long_text(1)
    with _llm(default_model_path) as llm:
        conn = llm.engine.kv_connector
        assert conn is not None and conn.config.chunk_size == 64
        first = llm.generate(prompt, PARAMS)[0]
        assert conn.flush(60)
        second = llm.generate(prompt, PARAMS)[0]
        assert second.num_cached_tokens == len(first.prompt_token_ids) - 1
        assert second.outputs[0].token_ids == first.outputs[0].token_ids


def test_unreachable_redis_is_one_warning_and_generation_works(default_model_path: Path, clean_env,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    clean_env.setenv("KVTIER_TIERS", f"cpu,{url}?connect_timeout_s=0.5")
    clean_env.setenv("KVTIER_CHUNK_SIZE", "64")
    prompt = long_text(1)
    with _llm(default_model_path) as llm:
        outs = [llm.generate(prompt, PARAMS)[0] for _ in range(3)]
        assert llm.engine.kv_connector.flush(60)
    assert outs[2].num_cached_tokens == len(outs[0].prompt_token_ids) - 1  # the cpu tier serves the repeats
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and url in r.getMessage()]
    assert len(warnings) == 1 and "unreachable" in warnings[0], warnings


def _generate(env: dict[str, str], prompt: Path) -> dict:
    cmd = [sys.executable, "-m", "kvtier", "generate", "--prompt-file", str(prompt), "--json", "--device", "cpu",
           "--max-tokens", "2", "--no-prefix-caching"]
    proc = process.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_kvtier_generate_reads_the_environment(tmp_path: Path, default_model_path: Path) -> None:
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(long_text(1))
    base = {k: v for k, v in os.environ.items() if k not in ENV_VARS} | {"PYTHONPATH": str(REPO)}
    assert "kv_connector" not in _generate(base, prompt)
    disk = tmp_path / "kv"
    first = _generate(base | {"KVTIER_TIERS": f"disk://{disk}?budget=1GiB", "KVTIER_CHUNK_SIZE": "64"}, prompt)
    n = len(first["prompt_token_ids"])
    assert first["kv_connector"]["stored_tokens"] == n
    config = tmp_path / "kv.yaml"
    config.write_text(f"chunk_size: 64\ntiers: ['disk://{disk}?budget=1GiB']\n")
    second = _generate(base | {"KVTIER_CONFIG": str(config)}, prompt)  # the first run's disk tier
    assert second["num_cached_tokens"] == n - 1 and second["token_ids"] == first["token_ids"]
