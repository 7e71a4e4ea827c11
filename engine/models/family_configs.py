"""Each family's reading of its own `config.json` keys (the registry's hooks, engine/models).

A hook reads the keys its transformers class reads and sets the ModelConfig fields they
mean; keys its transformers class ignores are read and dropped, so they are not refused.
Shared keys (sizes, eps, rope, tied embeddings, hidden_act) are already in `cfg`; a sparse MLP
is set as `cfg["moe"]`, the keyword arguments of ModelConfig's MoEConfig.
Torch-free: parsing a config imports no model code.
"""

from __future__ import annotations

from typing import Any

from engine.hf_config import LONGROPE_TYPES, HFConfig, parse_layer_types, parse_rope


def llama(hf: HFConfig, cfg: dict[str, Any]) -> None:
    """Llama: optional q/k/v/o bias, MLP bias; transformers' Llama ignores `sliding_window`,
    and the keys nanotron's exports carry (SmolLM2): `is_llama_config`, a marker, and
    `rope_interleaved`, which transformers never reads: it rotates halves, so only False means
    what it computes."""
    cfg["attention_bias"] = cfg["attention_out_bias"] = hf.flag("attention_bias")
    cfg["mlp_bias"] = hf.flag("mlp_bias")
    hf.get("sliding_window")
    hf.get("is_llama_config")
    hf.inert_unless("rope_interleaved", False)


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


def qwen3(hf: HFConfig, cfg: dict[str, Any]) -> None:
    """Qwen3: per-head q/k RMSNorm before RoPE; q/k/v/o bias only with `attention_bias`."""
    cfg["attention_bias"] = cfg["attention_out_bias"] = hf.flag("attention_bias")
    cfg["qk_norm"] = "head"
    hf.inert_unless("mlp_bias", False)
    sliding_windows(hf, cfg)


def qwen3_moe(hf: HFConfig, cfg: dict[str, Any]) -> None:
    """Qwen3-MoE: Qwen3's attention (a window in every layer with `use_sliding_window`), sparse
    MLPs in the layers `decoder_sparse_step` and `mlp_only_layers` leave sparse."""
    cfg["attention_bias"] = cfg["attention_out_bias"] = hf.flag("attention_bias")
    cfg["qk_norm"] = "head"
    hf.inert_unless("mlp_bias", False)
    hf.get("max_window_layers"), hf.get("layer_types")  # transformers' Qwen3-MoE reads neither
    window = _window(hf)
    if hf.flag("use_sliding_window") and window is not None:
        cfg["sliding_window"], cfg["sliding_window_layers"] = window, tuple(range(cfg["num_layers"]))
    num_experts = hf.get("num_experts", hf.get("num_local_experts", 128))
    if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts < 0:
        raise ValueError(f"config.json: 'num_experts' must be a non-negative integer, got {num_experts!r}")
    moe = dict(num_experts=num_experts, top_k=hf.positive_int("num_experts_per_tok", 8),
               intermediate_size=hf.positive_int("moe_intermediate_size", 768),
               norm_topk_prob=hf.flag("norm_topk_prob"))
    step = hf.positive_int("decoder_sparse_step", 1)
    dense = set(hf.get("mlp_only_layers", []))
    layers = tuple(i for i in range(cfg["num_layers"])
                   if num_experts > 0 and i not in dense and (i + 1) % step == 0)
    if layers:
        cfg["moe"] = {**moe, "layers": layers}


def mixtral(hf: HFConfig, cfg: dict[str, Any]) -> None:
    """Mixtral: Mistral's attention, every MLP sparse (experts of `intermediate_size`), the
    top-k router probabilities always renormalised."""
    hf.inert_unless("attention_bias", False)
    hf.inert_unless("mlp_bias", False)
    window = _window(hf)
    if window is not None:
        cfg["sliding_window"], cfg["sliding_window_layers"] = window, tuple(range(cfg["num_layers"]))
    cfg["moe"] = dict(num_experts=hf.positive_int("num_local_experts", 8),
                      top_k=hf.positive_int("num_experts_per_tok", 2),
                      intermediate_size=cfg["intermediate_size"], norm_topk_prob=True,
                      layers=tuple(range(cfg["num_layers"])))


def phi3(hf: HFConfig, cfg: dict[str, Any]) -> None:
    """Phi-3: fused qkv_proj / gate_up_proj in the checkpoint, no biases, a window in every
    layer when `sliding_window` is set; longrope by `phi3_rope`."""
    hf.inert_unless("attention_bias", False)
    hf.inert_unless("mlp_bias", False)
    window = _window(hf)
    if window is not None:
        cfg["sliding_window"], cfg["sliding_window_layers"] = window, tuple(range(cfg["num_layers"]))


def phi3_rope(hf: HFConfig) -> tuple[float, dict[str, Any] | None]:
    """Phi-3's rope: default or longrope ("su" and "yarn" name longrope there), the original
    context from the top-level key (Phi3Config's default 4096)."""
    theta, scaling = parse_rope(hf, rope_types=LONGROPE_TYPES, aliases={"su": "longrope", "yarn": "longrope"},
                                original_max_default=4096)
    if scaling is None:  # the original context only sizes longrope: inert without it (Phi-3 mini 4k)
        hf.get("original_max_position_embeddings")
    else:
        half = _head_size(hf) // 2
        for k in ("short_factor", "long_factor"):
            if not isinstance(scaling[k], list) or len(scaling[k]) != half:
                raise ValueError(f"config.json: rope {k!r} must list {half} numbers")
    return theta, scaling


def _head_size(hf: HFConfig) -> int:
    heads = hf.positive_int("num_attention_heads")
    return hf.positive_int("head_dim", hf.positive_int("hidden_size") // heads)


def olmo2(hf: HFConfig, cfg: dict[str, Any]) -> None:
    """OLMo 2: RMSNorm over the whole q and k projections before RoPE, norms after each
    sub-layer (not before), q/k/v/o bias only with `attention_bias`."""
    cfg["attention_bias"] = cfg["attention_out_bias"] = hf.flag("attention_bias")
    cfg["qk_norm"] = "full"
    cfg["norm_layout"] = "post"
    hf.inert_unless("mlp_bias", False)


def granite(hf: HFConfig, cfg: dict[str, Any]) -> None:
    """Granite: Llama's layers with four multipliers (GraniteConfig's defaults are 1.0):
    `embedding_multiplier` on the embeddings, `residual_multiplier` on each branch output
    before the residual add, `attention_multiplier` as the whole score scale (in place of
    head_dim ** -0.5, so a config without it scales scores by 1), `logits_scaling` dividing the
    final logits. `attention_bias` puts a bias on q/k/v and o_proj alike; `mlp_bias` on the MLP.
    A multiplier of 1 leaves its field unset (no work, no fingerprint entry)."""
    cfg["attention_bias"] = cfg["attention_out_bias"] = hf.flag("attention_bias")
    cfg["mlp_bias"] = hf.flag("mlp_bias")
    cfg["attention_scale"] = _multiplier(hf, "attention_multiplier")
    embedding, residual, logits = (_multiplier(hf, k) for k in
                                   ("embedding_multiplier", "residual_multiplier", "logits_scaling"))
    cfg["embedding_scale"] = None if embedding == 1.0 else embedding
    cfg["residual_scale"] = None if residual == 1.0 else residual
    cfg["final_logit_divisor"] = None if logits == 1.0 else logits


def _multiplier(hf: HFConfig, key: str) -> float:
    """Returns a positive number key (1.0 when absent or null, GraniteConfig's default) as a float."""
    v = hf.get(key, 1.0)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
        raise ValueError(f"config.json: {key!r} must be a positive number, got {v!r}")
    return float(v)


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
