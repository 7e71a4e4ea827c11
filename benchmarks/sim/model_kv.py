"""KV bytes per token of a model: layers x 2 (K and V) x kv_heads x head_dim x dtype bytes."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1, "int8": 1}


@dataclass(frozen=True)
class ModelKV:
    """The shape of one token's K/V in the paged cache."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float16"

    @property
    def bytes_per_token(self) -> int:
        """Returns the K/V bytes one token occupies in a pool or a tier (raw codec)."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]


# Figures from each model's published config.json.
PRESETS: dict[str, ModelKV] = {
    "smollm2-135m": ModelKV("SmolLM2-135M (fp32, as run here)", 30, 3, 64, "float32"),
    "llama-3-8b": ModelKV("Llama-3-8B", 32, 8, 128, "bfloat16"),
    "llama-3-70b": ModelKV("Llama-3-70B", 80, 8, 128, "bfloat16"),
    "qwen2.5-7b": ModelKV("Qwen2.5-7B", 28, 4, 128, "bfloat16"),
}


def from_hf_config(path: str | Path, dtype: str | None = None) -> ModelKV:
    """Returns the ModelKV of a Hugging Face config.json (or a checkpoint dir holding one).

    Raises ValueError naming the missing field when the config lacks one."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    cfg = json.loads(p.read_text())
    for field in ("num_hidden_layers", "num_attention_heads", "hidden_size"):
        if field not in cfg:
            raise ValueError(f"{p}: config has no {field!r}")
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    dt = dtype or cfg.get("torch_dtype") or "float16"
    if dt not in DTYPE_BYTES:
        raise ValueError(f"{p}: unknown dtype {dt!r} (one of {', '.join(DTYPE_BYTES)})")
    return ModelKV(p.parent.name, cfg["num_hidden_layers"], cfg.get("num_key_value_heads", heads), head_dim, dt)


def resolve(spec: str, dtype: str | None = None) -> ModelKV:
    """Returns a preset by name, or the model of a config.json path; ValueError otherwise."""
    if spec in PRESETS:
        m = PRESETS[spec]
        return m if dtype is None else ModelKV(m.name, m.num_layers, m.num_kv_heads, m.head_dim, dtype)
    if Path(spec).exists():
        return from_hf_config(spec, dtype)
    raise ValueError(f"unknown model {spec!r}: a preset ({', '.join(PRESETS)}) or a config.json path")
