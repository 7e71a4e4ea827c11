"""`kvtier generate` end to end: a real subprocess, the real default model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness import process

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def kvtier(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return process.run([sys.executable, "-m", "kvtier", "generate", *args], cwd=REPO, env=env,
                       input=stdin, capture_output=True, text=True, timeout=600)


def test_json_output_per_prompt_and_prefix_reuse(tmp_path: Path, default_model_path: Path) -> None:
    long_prompt = "The harbour master wrote down every ship that arrived. " * 12
    f = tmp_path / "p.txt"
    f.write_text(long_prompt)
    r = kvtier(
        "The capital of France is",
        "--prompt-file",
        str(f),
        "--prompt-file",
        str(f),
        "--model",
        str(default_model_path),
        "--max-tokens",
        "6",
        "--json",
        "--device",
        "cpu",
        "--num-gpu-blocks",
        "64",
    )
    assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(lines) == 3
    for obj in lines:
        assert set(obj) >= {"prompt_token_ids", "token_ids", "text", "num_cached_tokens", "ttft_s"}
        assert 1 <= len(obj["token_ids"]) <= 6 and obj["ttft_s"] > 0
    assert lines[0]["token_ids"][:2] == [7042, 30]  # " Paris." — greedy, deterministic
    # The second copy of the file prompt is served from the engine's prefix cache.
    n = len(lines[1]["prompt_token_ids"])
    assert lines[1]["num_cached_tokens"] == 0
    assert lines[2]["num_cached_tokens"] == (n - 1) // 16 * 16
    assert lines[2]["token_ids"] == lines[1]["token_ids"]


def test_chat_plain_text_output(default_model_path: Path) -> None:
    r = kvtier(
        "-",
        "--chat",
        "--model",
        str(default_model_path),
        "--max-tokens",
        "5",
        "--device",
        "cpu",
        "--num-gpu-blocks",
        "64",
    )
    # "-" is a prompt here, not stdin: a one-character user turn through the chat template.
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()


def test_several_prompts_in_text_mode_are_separated(tmp_path: Path, default_model_path: Path) -> None:
    f = tmp_path / "p.txt"
    f.write_text("The capital of France is")
    r = kvtier("The capital of France is", "--prompt-file", str(f), "--model", str(default_model_path),
               "--max-tokens", "3", "--device", "cpu", "--num-gpu-blocks", "64")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "--- prompt 1/2 ---" and "--- prompt 2/2 ---" in lines
    second = lines.index("--- prompt 2/2 ---")
    assert lines[1:second] == lines[second + 1:] and "Paris" in lines[1]  # greedy: the same answer twice


@pytest.mark.parametrize(
    "args, message",
    [
        (["--max-tokens", "0", "hi"], "max_tokens must be >= 1"),
        (["--temperature", "-1", "hi"], "temperature must be >= 0"),
        ([], "no prompt given"),
        (["--prompt-file", "/nonexistent/prompt.txt"], "no such file"),
        (["   "], "prompt 1 is empty"),
        (["--prompt-file", "{tmp}"], "--prompt-file {tmp}: is a directory, not a file"),
        (["--prompt-file", "{tmp}/latin1.txt"],
         "--prompt-file {tmp}/latin1.txt: not UTF-8 text (byte 0xe9 at offset 3)"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args: list[str], message: str, tmp_path: Path) -> None:
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9 au lait".encode("latin-1"))
    args = [a.format(tmp=tmp_path) for a in args]
    message = message.format(tmp=tmp_path)
    r = kvtier(*args)
    assert r.returncode == 2
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and message in err[0] and err[0].startswith("kvtier generate: error:")
    assert r.stdout == ""


def test_unsupported_architecture_exit_2(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    (tmp_path / "model.safetensors").write_bytes(b"")  # weights present; only the architecture is wrong
    r = kvtier("hi", "--model", str(tmp_path), "--device", "cpu")
    assert r.returncode == 2 and "GPT2LMHeadModel" in r.stderr and len(r.stderr.strip().splitlines()) == 1
