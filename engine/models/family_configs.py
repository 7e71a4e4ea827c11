"""Each family's reading of its own `config.json` keys (the registry's hooks, engine/models).

A hook reads the keys its transformers class reads and sets the ModelConfig fields they
mean; keys its transformers class ignores are read and dropped, so they are not refused.
Shared keys (sizes, eps, rope, tied embeddings, hidden_act) are already in `cfg`.
Torch-free: parsing a config imports no model code.
"""

from __future__ import annotations

from typing import Any

from engine.hf_config import HFConfig, parse_layer_types


def llama(hf: HFConfig, cfg: dict[str, Any]) -> None:
    """Llama: optional q/k/v/o bias, MLP bias; transformers' Llama ignores `sliding_window`."""
    cfg["attention_bias"] = cfg["attention_out_bias"] = hf.flag("attention_bias")
    cfg["mlp_bias"] = hf.flag("mlp_bias")
    hf.get("sliding_window")


def mistral(hf: HFConfig, cfg: dict[str, Any]) -> None:
    """Mistral: a sliding window in every layer when `sliding_window` is set."""
    cfg["attention_bias"] = cfg["attention_out_bias"] = hf.flag("attention_bias")
    hf.inert_unless("mlp_bias", False)
    window = _window(hf)
    if window is not None:
        cfg["sliding_window"], cfg["sliding_window_layers"] = window, tuple(range(cfg["num_layers"]))


def qwen2(hf: HFConfig, cfg: dict[str, Any]) -> None:
    """Qwen2: q/k/v bias always (no o_proj bias); sliding layers as `sliding_windows` reads them."""
    cfg["attention_bias"] = True
    hf.get("attention_bias")  # transformers' Qwen2 always has the q/k/v bias
    hf.inert_unless("mlp_bias", False)
    sliding_windows(hf, cfg)


def sliding_windows(hf: HFConfig, cfg: dict[str, Any]) -> None:
    """Qwen-style windows: only with `use_sliding_window`, in the layers `layer_types` marks
    "sliding_attention" (default: index >= `max_window_layers`), as transformers applies them."""
    num_layers = cfg["num_layers"]
    use = hf.flag("use_sliding_window")
    window = _window(hf)
    first = int(hf.get("max_window_layers", 28))
    default = ["sliding_attention" if use and window and i >= first else "full_attention"
               for i in range(num_layers)]
    types = parse_layer_types(hf, num_layers, default)
    layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if use and window is not None and layers:
        cfg["sliding_window"], cfg["sliding_window_layers"] = window, layers


def _window(hf: HFConfig) -> int | None:
    window = hf.get("sliding_window")
    if window is None or window == 0:
        return None
    if not isinstance(window, int) or isinstance(window, bool) or window < 0:
        raise ValueError(f"config.json: 'sliding_window' must be a positive integer, got {window!r}")
    return window
