"""Tiny random checkpoints of each supported architecture, for tests and benchmarks (the
fixtures of the real default model: tests/fixtures/model.py)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from engine.default_model import ensure_default_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

# Small enough to build in well under a second, large enough for GQA (4 q heads, 2 kv heads).
_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
             vocab_size=49152, initializer_range=0.1, bos_token_id=1, eos_token_id=2,
             pad_token_id=2)

# The model-family checkpoints (tests/engine/test_model_families.py): the proof sizes,
# hidden 128, 3 layers, GQA 4:2, a 1000-token vocabulary, weights with a raised init range.
FAMILY_TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                   vocab_size=1000, initializer_range=0.1, bos_token_id=1, eos_token_id=2,
                   pad_token_id=0)


def make_tiny_checkpoint(tmp_path: Path, model_type: str = "qwen2", seed: int = 0,
                         tokenizer_dir: Path | None = None, **overrides: Any) -> Path:
    """Saves a randomly initialised transformers model of `model_type` (any the engine
    supports) plus the default model's tokenizer into `tmp_path / <model_type>-<seed>`;
    returns the dir."""
    return make_checkpoint(Path(tmp_path) / f"{model_type}-{seed}", {"model_type": model_type, **_TINY, **overrides},
                           seed, tokenizer_dir, keep_config=False)


def make_checkpoint(out: Path, config: dict[str, Any], seed: int = 0, tokenizer_dir: Path | None = None,
                    keep_config: bool = True) -> Path:
    """Saves a transformers model built from `config` (a config.json dict, `model_type` in
    it) with random weights, plus the default model's tokenizer, into `out`; returns `out`.
    Biases and norm weights (q/k norms too) are randomised as well, so loading them is
    actually tested. With `keep_config` the saved config.json is `config` itself, as
    published, not transformers' re-serialisation of it."""
    import json

    from transformers import AutoConfig, AutoModelForCausalLM

    rest = {k: v for k, v in config.items() if k != "model_type"}
    cfg = AutoConfig.for_model(config["model_type"], **rest)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.5)
            elif "norm" in name:  # +-0.5 around the init: 1 for w norms, 0 for Gemma's (1 + w)
                p.add_(torch.empty_like(p).uniform_(-0.5, 0.5))
    model.save_pretrained(out)
    if keep_config:
        (out / "config.json").write_text(json.dumps(config, indent=2))
    src = tokenizer_dir or ensure_default_model()
    for f in TOKENIZER_FILES:
        if (src / f).is_file():
            shutil.copy(src / f, out / f)
    return out
