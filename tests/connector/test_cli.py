"""`kvtier generate` with connector flags: bad flags are clear errors; tiers persist across runs."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from harness import process
from harness.text import long_text
from kvtier.cli import main

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("argv,message", [
    (["--chunk-size", "16"], "--chunk-size/--kv-codec need a --kv-tier or --config"),
    (["--kv-tier", "nope://x"], "--kv-tier[0].url: unknown tier scheme 'nope'"),
    (["--kv-tier", "cpu", "--chunk-size", "0"], "--chunk-size must be > 0"),
    (["--config", "/nonexistent/kv.yaml"], "config: cannot read /nonexistent/kv.yaml"),
])
def test_bad_connector_flags_exit_2_naming_the_problem(argv, message, capsys):
    assert main(["generate", "hello", "--device", "cpu", *argv]) == 2
    assert message in capsys.readouterr().err


def test_an_unknown_codec_is_refused_by_the_parser_naming_it(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "hello", "--device", "cpu", "--kv-tier", "cpu", "--kv-codec", "zip"])
    assert exc.value.code == 2
    assert "--kv-codec: invalid choice: 'zip'" in capsys.readouterr().err


def test_config_file_keys_are_validated(tmp_path, capsys):
    cfg = tmp_path / "kv.yaml"
    cfg.write_text("tiers: [cpu]\nchunk_size: 64\nsave_unfull_chunk: maybe\n")
    assert main(["generate", "hello", "--device", "cpu", "--config", str(cfg)]) == 2
    assert "save_unfull_chunk" in capsys.readouterr().err


@pytest.mark.slow
def test_second_cli_run_reuses_the_first_runs_disk_tier(tmp_path, default_model_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(long_text(2))
    cmd = [sys.executable, "-m", "kvtier", "generate", "--prompt-file", str(prompt), "--json",
           "--device", "cpu", "--max-tokens", "3", "--no-prefix-caching",
           "--kv-tier", "cpu", "--kv-tier", f"disk://{tmp_path / 'kv'}", "--chunk-size", "32"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def once() -> dict:
        proc = process.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    first, second = once(), once()  # exit must flush the disk writes of the first run
    n = len(first["prompt_token_ids"])
    assert first["num_cached_tokens"] == 0 and first["kv_connector"]["stored_tokens"] == n
    assert second["num_cached_tokens"] == n - 1
    assert second["kv_connector"]["connector_hit_tokens"] == n - 1
    assert second["token_ids"] == first["token_ids"]
