"""Gemma 2 and Gemma 3 (text) config.json parsing: transformers' defaults for absent keys, an
explicit null turning a soft-cap off, the legacy keys of checkpoints on the Hub read as
transformers 5 converts them, every computation-changing key in the fingerprint, and the
keys the engine does not implement refused by name."""

from __future__ import annotations

from typing import Any

import pytest

from engine.model_config import ModelConfig

# google/gemma-2-2b's config.json (transformers 4.42), and google/gemma-3-1b-it's (4.50),
# trimmed of nothing: every key a real checkpoint carries must parse.
GEMMA2_HUB: dict[str, Any] = {
    "architectures": ["Gemma2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid",
    "eos_token_id": [1, 107], "final_logit_softcapping": 30.0, "head_dim": 256,
    "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2304,
    "initializer_range": 0.02, "intermediate_size": 9216, "max_position_embeddings": 8192,
    "model_type": "gemma2", "num_attention_heads": 8, "num_hidden_layers": 26, "num_key_value_heads": 4,
    "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
    "sliding_window": 4096, "torch_dtype": "float32", "transformers_version": "4.42.4", "use_cache": True,
    "vocab_size": 256000,
}
GEMMA3_HUB: dict[str, Any] = {
    "architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid",
    "eos_token_id": [1, 106], "final_logit_softcapping": None, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "initializer_range": 0.02,
    "intermediate_size": 6912, "max_position_embeddings": 32768, "model_type": "gemma3_text",
    "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1, "pad_token_id": 0,
    "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
    "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0", "use_cache": True,
    "vocab_size": 262144,
}
# A sparse text config as gemma-3-4b-it's text_config is (tests/fixtures/real_configs): the
# absent sizes are Gemma3TextConfig's defaults.
GEMMA3_SPARSE: dict[str, Any] = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 2560,
    "intermediate_size": 10240, "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
    "sliding_window": 1024,
}


def _via_transformers(hub: dict[str, Any]) -> dict[str, Any]:
    """The same config as transformers 5 loads and saves it (per-layer-type rope_parameters,
    explicit layer_types)."""
    from transformers import AutoConfig

    kwargs = {k: v for k, v in hub.items() if k not in ("model_type", "transformers_version")}
    return {**AutoConfig.for_model(hub["model_type"], **kwargs).to_dict(), "architectures": hub["architectures"]}


def _parse(hf: dict[str, Any], **changes: Any) -> ModelConfig:
    return ModelConfig.from_hf_dict({**hf, **changes})


@pytest.mark.parametrize("hub", [GEMMA2_HUB, GEMMA3_HUB, GEMMA3_SPARSE], ids=["gemma2", "gemma3", "gemma3-sparse"])
def test_hub_config_parses_as_transformers_5_saves_it(hub: dict[str, Any]) -> None:
    legacy, saved = _parse(hub), ModelConfig.from_hf_dict(_via_transformers(hub))
    assert legacy.fingerprint == saved.fingerprint
    assert legacy.to_dict() == saved.to_dict()


def test_gemma2_features() -> None:
    cfg = _parse(GEMMA2_HUB)
    assert (cfg.architecture, cfg.norm_layout, cfg.norm_unit_offset) == ("Gemma2ForCausalLM", "sandwich", True)
    assert cfg.hidden_act == "gelu_pytorch_tanh" and cfg.tie_word_embeddings and cfg.qk_norm is None
    assert cfg.embedding_scale == pytest.approx(2304 ** 0.5) and cfg.attention_scale == 256 ** -0.5
    assert (cfg.attn_logit_softcap, cfg.final_logit_softcap) == (50.0, 30.0)
    assert cfg.sliding_window == 4096 and cfg.sliding_window_layers == tuple(range(0, 26, 2))
    assert cfg.local_rope_theta is None and cfg.rope_theta == 10000.0
    # Absent keys take Gemma2Config's defaults; an explicit null turns a cap off.
    bare = {k: v for k, v in GEMMA2_HUB.items() if k not in ("attn_logit_softcapping", "final_logit_softcapping",
                                                              "query_pre_attn_scalar", "sliding_window")}
    assert _parse(bare).to_dict() == cfg.to_dict()
    off = _parse(GEMMA2_HUB, attn_logit_softcapping=None, final_logit_softcapping=None)
    assert (off.attn_logit_softcap, off.final_logit_softcap) == (None, None)


def test_gemma3_features() -> None:
    cfg = _parse(GEMMA3_HUB, rope_scaling={"rope_type": "linear", "factor": 8.0})
    assert (cfg.architecture, cfg.qk_norm, cfg.norm_layout) == ("Gemma3ForCausalLM", "head", "sandwich")
    assert (cfg.attn_logit_softcap, cfg.final_logit_softcap) == (None, None)
    # Five sliding layers per global one: layers 5, 11, 17, 23 are global.
    assert cfg.sliding_window == 512
    assert set(range(26)) - set(cfg.sliding_window_layers) == {5, 11, 17, 23}
    # The global layers' base and scaling, the sliding layers' local base unscaled.
    assert (cfg.rope_theta, cfg.rope_scaling) == (1e6, {"rope_type": "linear", "factor": 8.0})
    assert (cfg.local_rope_theta, cfg.local_rope_scaling) == (10000.0, None)
    assert cfg.layer_rope(5) == (1e6, {"rope_type": "linear", "factor": 8.0})
    assert cfg.layer_rope(4) == (10000.0, None)
    # An explicit layer_types wins over the pattern, as in transformers.
    types = ["full_attention" if i % 2 else "sliding_attention" for i in range(26)]
    assert _parse(GEMMA3_HUB, layer_types=types).sliding_window_layers == tuple(range(0, 26, 2))


@pytest.mark.parametrize("hub,key,value", [
    (GEMMA2_HUB, "attn_logit_softcapping", 40.0), (GEMMA2_HUB, "final_logit_softcapping", None),
    (GEMMA2_HUB, "query_pre_attn_scalar", 224), (GEMMA2_HUB, "sliding_window", 2048),
    (GEMMA3_HUB, "rope_local_base_freq", 20000), (GEMMA3_HUB, "rope_theta", 500000),
    (GEMMA3_HUB, "sliding_window_pattern", 4), (GEMMA3_HUB, "final_logit_softcapping", 30.0),
], ids=lambda v: str(v) if not isinstance(v, dict) else v["model_type"])
def test_every_computation_changing_key_is_in_the_fingerprint(hub: dict[str, Any], key: str, value: Any) -> None:
    assert _parse(hub, **{key: value}).fingerprint != _parse(hub).fingerprint


@pytest.mark.parametrize("hub,changes,named", [
    (GEMMA2_HUB, {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    (GEMMA3_HUB, {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    # transformers' Gemma3Attention never applies it: refused rather than guessed.
    (GEMMA3_HUB, {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    (GEMMA2_HUB, {"embedding_multiplier": 12.0}, "embedding_multiplier"),
    (GEMMA3_HUB, {"sliding_window_pattern": 0}, "sliding_window_pattern"),
    (GEMMA2_HUB, {"sliding_window": -1}, "sliding_window"),
    (GEMMA2_HUB, {"attn_logit_softcapping": "50"}, "attn_logit_softcapping"),
    (GEMMA2_HUB, {"hidden_activation": "relu"}, "relu"),
    (GEMMA3_HUB, {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
    (GEMMA3_HUB, {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, "rope_parameters"),
    # The image-text checkpoint runs as its text part (tests/engine/test_multimodal.py), save
    # a final-logit cap: its head does not apply one, Gemma3ForCausalLM's does.
    ({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
      "text_config": {**GEMMA3_HUB, "final_logit_softcapping": 30.0}}, {}, "final_logit_softcapping"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_unimplemented_keys_are_refused_by_name(hub: dict[str, Any], changes: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        _parse(hub, **changes)
