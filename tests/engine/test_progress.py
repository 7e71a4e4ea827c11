"""Progress bars as a user at a terminal sees them (stderr on a real pty): model loading and a
long prefill, one bar at a time; none at --log-level warning or when stderr is not a terminal."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from harness import process
from harness.text import long_text
from tests.fixtures.tty import run_on_tty

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def generate_args(model: Path, prompt_file: Path, *extra: str) -> list[str]:
    # A ~250-token prompt at 64 tokens a step: a prefill of several steps.
    return [sys.executable, "-m", "kvtier", "generate", "--prompt-file", str(prompt_file), "--model", str(model),
            "--device", "cpu", "--max-tokens", "2", "--max-num-batched-tokens", "64", "--num-gpu-blocks", "64",
            *extra]


@pytest.fixture
def prompt_file(tmp_path: Path) -> Path:
    f = tmp_path / "long.txt"
    f.write_text(long_text(6))
    return f


ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def test_model_load_then_prefill_one_bar_at_a_time(default_model_path: Path, prompt_file: Path) -> None:
    r = run_on_tty(generate_args(default_model_path, prompt_file), ENV, str(REPO))
    assert r.returncode == 0, r.tty[-2000:]
    assert r.bars() == [f"loading {default_model_path.name}", "prefill request 0-0"], r.bars()
    assert "100%|" in r.tty.split("prefill request")[-1]  # the prefill bar reached its end
    assert "kvtier.request: request 0-0 finished" in r.tty  # the log line, after the bar, on its own line


@pytest.mark.parametrize("quiet", ["log-level", "not-a-tty"])
def test_quiet_at_warning_or_off_a_terminal(default_model_path: Path, prompt_file: Path, quiet: str) -> None:
    if quiet == "log-level":
        r = run_on_tty(generate_args(default_model_path, prompt_file, "--log-level", "warning"), ENV, str(REPO))
        out, err = r.stdout, r.tty
        assert r.returncode == 0
    else:
        p = process.run(generate_args(default_model_path, prompt_file), env=ENV, cwd=REPO, capture_output=True,
                        text=True, timeout=300)
        out, err = p.stdout, p.stderr
        assert p.returncode == 0, err
        assert "kvtier.request: request 0-0 finished" in err  # logging stays on: only bars are off
    assert out and "%|" not in err and "prefill request" not in err  # the completion printed, no bar
