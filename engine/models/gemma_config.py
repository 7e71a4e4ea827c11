"""Gemma 2's and Gemma 3's (text) reading of their `config.json` keys (the registry's hooks,
engine/models; the other families' are in family_configs.py).

Both families: (1 + w) RMSNorm before and after attention and the MLP, embeddings times
sqrt(hidden), a gelu-tanh gated MLP (`hidden_activation`), attention scale
`query_pre_attn_scalar ** -0.5`, layers alternating between a sliding window and global
attention (`layer_types`), tied embeddings by default. Gemma 2 soft-caps attention scores and
the final logits; Gemma 3 has q/k norms and a local RoPE base for its sliding layers.

Defaults are transformers' config classes' (Gemma2Config, Gemma3TextConfig), since a key
absent from config.json takes them: a Gemma 2 config without `attn_logit_softcapping` caps at
50, while an explicit null turns the cap off. Torch-free, like every hook.
"""

from __future__ import annotations

from typing import Any

from engine.hf_config import HFConfig, parse_layer_types, parse_rope

# transformers' Gemma3TextConfig defaults of the keys the shared parser reads
# (engine/model_config.py), whose own defaults (or none) differ: published Gemma 3 text_config
# dicts are sparse (gemma-3-4b-it's names three sizes) and transformers fills the rest from these.
GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6, "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
}


def _optional(hf: HFConfig, key: str, default: Any) -> Any:
    """Returns the key's value: `default` when absent, None when explicitly null."""
    value = hf.get(key)
    return default if key not in hf else value


def _positive_float(key: str, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"config.json: {key!r} must be a positive number or null, got {value!r}")
    return float(value)


def _common(hf: HFConfig, cfg: dict[str, Any], pattern: int, final_cap: float | None) -> None:
    """The keys Gemma 2 and 3 share; `pattern`: every pattern-th layer is global when
    `layer_types` is absent; `final_cap`: the final logits' cap when the key is absent."""
    cfg["norm_layout"] = "sandwich"
    cfg["norm_unit_offset"] = True
    cfg["embedding_scale"] = cfg["hidden_size"] ** 0.5
    # transformers' Gemma reads `hidden_activation`; a legacy `hidden_act` (read by the shared
    # parser) is ignored there, so here too.
    cfg["hidden_act"] = hf.get("hidden_activation", "gelu_pytorch_tanh")
    cfg["tie_word_embeddings"] = hf.flag("tie_word_embeddings", True)
    cfg["attention_bias"] = cfg["attention_out_bias"] = hf.flag("attention_bias")
    scalar = _positive_float("query_pre_attn_scalar", hf.get("query_pre_attn_scalar", 256))
    assert scalar is not None  # hf.get's default stands in for null
    cfg["attention_scale"] = scalar ** -0.5
    cfg["final_logit_softcap"] = _positive_float(
        "final_logit_softcapping", _optional(hf, "final_logit_softcapping", final_cap))
    hf.inert_unless("use_bidirectional_attention", False)
    hf.get("cache_implementation")  # a generation setting ("hybrid"): the engine's cache is paged
    window = hf.get("sliding_window", 4096)
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        raise ValueError(f"config.json: 'sliding_window' must be a positive integer, got {window!r}")
    # An older name some Gemma 2 configs still carry beside `sliding_window` (transformers reads
    # only the latter): inert as the same number, refused as another.
    hf.inert_unless("sliding_window_size", window)
    num_layers = cfg["num_layers"]
    default = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    types = parse_layer_types(hf, num_layers, default)
    cfg["sliding_window"] = window
    cfg["sliding_window_layers"] = tuple(i for i, t in enumerate(types) if t == "sliding_attention")


def gemma2(hf: HFConfig, cfg: dict[str, Any]) -> None:
    """Gemma 2: soft-capped attention scores (default 50) and final logits (default 30); every
    other layer slides (layer 0 first). One RoPE for all layers (the shared parser's)."""
    _common(hf, cfg, pattern=2, final_cap=30.0)
    cfg["attn_logit_softcap"] = _positive_float(
        "attn_logit_softcapping", _optional(hf, "attn_logit_softcapping", 50.0))


def gemma3_text(hf: HFConfig, cfg: dict[str, Any]) -> None:
    """Gemma 3 (text): per-head q/k (1 + w) RMSNorm before RoPE; five sliding layers per global
    one (`sliding_window_pattern`, 6) unless `layer_types` says; the global layers' RoPE base
    (default 1e6, possibly linearly scaled) and the sliding layers' (`rope_local_base_freq`,
    default 1e4)."""
    pattern = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6))
    if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern <= 0:
        raise ValueError(f"config.json: 'sliding_window_pattern' must be a positive integer, got {pattern!r}")
    _common(hf, cfg, pattern, final_cap=None)
    cfg["qk_norm"] = "head"
    # transformers' Gemma3Attention never applies it: refused rather than guessed either way.
    hf.inert_unless("attn_logit_softcapping")
    full, sliding = _gemma3_rope_params(hf)
    cfg["rope_theta"], cfg["rope_scaling"] = parse_rope(hf, full)
    cfg["local_rope_theta"], cfg["local_rope_scaling"] = parse_rope(hf, sliding)


def _gemma3_rope_params(hf: HFConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """Returns the (global, sliding) layers' rope parameters as Gemma3TextConfig builds them:
    transformers 5's per-layer-type `rope_parameters`, or the legacy `rope_theta`,
    `rope_scaling` (global layers only) and `rope_local_base_freq`."""
    params = hf.get("rope_parameters")
    scaling = hf.get("rope_scaling")
    theta = hf.get("rope_theta", 1_000_000.0)
    local = hf.get("rope_local_base_freq", 10_000.0)
    if params is None:
        full = dict(scaling or {"rope_type": "default"})
        return {**full, "rope_theta": theta}, {"rope_type": "default", "rope_theta": local}
    if not isinstance(params, dict) or not set(params) <= {"full_attention", "sliding_attention"}:
        raise ValueError(f"config.json: Gemma 3's 'rope_parameters' must map 'full_attention' and "
                         f"'sliding_attention' to their rope parameters, got {params!r}")
    full = dict(params.get("full_attention") or {"rope_type": "default"})
    full.update(scaling or {})
    full.setdefault("rope_theta", theta)
    sliding = dict(params.get("sliding_attention") or {"rope_type": "default"})
    sliding.setdefault("rope_theta", local)
    return full, sliding
