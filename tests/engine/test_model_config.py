"""ModelConfig: parsing real HF configs, validation errors, and a stable fingerprint."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from engine.model_config import ModelConfig
from engine.rotary import compute_inv_freq
from harness import process
from harness.model import make_tiny_checkpoint

REPO = Path(__file__).resolve().parents[2]


def _with_config(src: Path, dst: Path, **changes) -> Path:
    """Makes `dst` checkpoint `src` with config.json keys changed (None deletes); every other
    file is a symlink to `src`'s (no copy of the weights; only read here)."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "config.json":
            (dst / f.name).symlink_to(f)
    cfg = json.loads((src / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_default_model_config(default_model_path: Path) -> None:
    cfg = ModelConfig.from_pretrained(default_model_path)
    assert (cfg.architecture, cfg.model_type) == ("LlamaForCausalLM", "llama")
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
    assert (cfg.head_size, cfg.vocab_size, cfg.intermediate_size) == (64, 49152, 1536)
    assert cfg.rope_theta == 100000.0 and cfg.rope_scaling is None
    assert cfg.tie_word_embeddings and not cfg.attention_bias and not cfg.mlp_bias
    assert 2 in cfg.eos_token_ids  # <|im_end|>, also the tokenizer's eos
    assert cfg.bos_token_id == 1
    assert len(cfg.fingerprint) == 32 and int(cfg.fingerprint, 16) >= 0


def test_unsupported_architecture_names_it(tmp_path: Path, default_model_path: Path) -> None:
    bad = _with_config(default_model_path, tmp_path / "gpt2", architectures=["GPT2LMHeadModel"],
                       model_type="gpt2")
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        ModelConfig.from_pretrained(bad)
    (bad / "model.safetensors").unlink()  # a bare config names the architecture too
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        ModelConfig.from_pretrained(bad)


def test_not_a_checkpoint_dir(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="config.json"):
        ModelConfig.from_pretrained(tmp_path)


def test_unsupported_rope_type_is_value_error(tmp_path: Path, default_model_path: Path) -> None:
    bad = _with_config(default_model_path, tmp_path / "dynamic",
                       rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0})
    with pytest.raises(ValueError, match="dynamic"):
        ModelConfig.from_pretrained(bad)


def test_legacy_and_hf5_rope_keys_agree(tmp_path: Path, default_model_path: Path) -> None:
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}
    new = _with_config(default_model_path, tmp_path / "new",
                       rope_parameters={"rope_theta": 5e5, **llama3})
    old = _with_config(default_model_path, tmp_path / "old", rope_parameters=None,
                       rope_theta=5e5, rope_scaling={**llama3, "rope_type": None, "type": "llama3"})
    a, b = ModelConfig.from_pretrained(new), ModelConfig.from_pretrained(old)
    assert a.rope_theta == b.rope_theta == 5e5
    assert a.rope_scaling == b.rope_scaling == llama3
    assert a.fingerprint == b.fingerprint


def test_llama3_inv_freq_matches_transformers() -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    hf_cfg = LlamaConfig(hidden_size=2048, num_attention_heads=16, head_dim=128,
                         rope_parameters=params, max_position_embeddings=131072)
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    ours = compute_inv_freq(128, 5e5, {k: v for k, v in params.items() if k != "rope_theta"})
    torch.testing.assert_close(ours, ref.float(), rtol=1e-6, atol=0)


def test_head_dim_and_qwen2_bias_and_eos_merge(tmp_path: Path, default_model_path: Path) -> None:
    ckpt = make_tiny_checkpoint(tmp_path, "qwen2", head_dim=32, tokenizer_dir=default_model_path)
    gen = json.loads((ckpt / "generation_config.json").read_text())
    gen["eos_token_id"] = [2, 7]
    (ckpt / "generation_config.json").write_text(json.dumps(gen))
    cfg = ModelConfig.from_pretrained(ckpt)
    assert cfg.architecture == "Qwen2ForCausalLM"
    assert cfg.head_size == 32 and cfg.q_size == 4 * 32 and cfg.kv_size == 2 * 32
    assert cfg.attention_bias and not cfg.attention_out_bias
    assert cfg.eos_token_ids == [2, 7]


def test_bad_sizes_are_value_errors(tmp_path: Path, default_model_path: Path) -> None:
    bad = _with_config(default_model_path, tmp_path / "heads", num_key_value_heads=4)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        ModelConfig.from_pretrained(bad)
    bad = _with_config(default_model_path, tmp_path / "hidden", hidden_size="576")
    with pytest.raises(ValueError, match="hidden_size"):
        ModelConfig.from_pretrained(bad)


def _fingerprint_in_subprocess(path: Path, hashseed: str) -> str:
    code = ("import sys; from engine.model_config import ModelConfig; "
            "print(ModelConfig.from_pretrained(sys.argv[1]).fingerprint)")
    env = {**os.environ, "PYTHONHASHSEED": hashseed, "PYTHONPATH": str(REPO)}
    out = process.run([sys.executable, "-c", code, str(path)], env=env, cwd=REPO,
                      capture_output=True, text=True, check=True, timeout=120)
    return out.stdout.strip()


def test_fingerprint_stable_across_processes(default_model_path: Path) -> None:
    a = _fingerprint_in_subprocess(default_model_path, "1")
    b = _fingerprint_in_subprocess(default_model_path, "12345")
    assert a == b == ModelConfig.from_pretrained(default_model_path).fingerprint


def test_fingerprint_identifies_weights_not_location(tmp_path: Path,
                                                     default_model_path: Path) -> None:
    a = make_tiny_checkpoint(tmp_path / "a", "llama", seed=0, tokenizer_dir=default_model_path)
    b = make_tiny_checkpoint(tmp_path / "b", "llama", seed=1, tokenizer_dir=default_model_path)
    copy = tmp_path / "copy"
    shutil.copytree(a, copy)
    fa, fb, fc = (ModelConfig.from_pretrained(p).fingerprint for p in (a, b, copy))
    assert fa == fc  # same weights elsewhere on disk
    assert fa != fb  # same architecture and sizes, different weights
    default = ModelConfig.from_pretrained(default_model_path).fingerprint
    assert default not in (fa, fb)
    # A size change alone (same weight bytes) changes it too.
    eps = _with_config(a, tmp_path / "eps", rms_norm_eps=1e-5)
    assert ModelConfig.from_pretrained(eps).fingerprint != fa


def test_fingerprint_sees_a_changed_weight_in_a_large_file(tmp_path: Path,
                                                          default_model_path: Path) -> None:
    # Weights over 8 MiB (the default model's, or these untied 49152-token embeddings) are
    # hashed by samples; flipping a sampled region must show.
    copy = make_tiny_checkpoint(tmp_path, "llama", tokenizer_dir=default_model_path, tie_word_embeddings=False)
    before = ModelConfig.from_pretrained(copy).fingerprint
    f = copy / "model.safetensors"
    size = f.stat().st_size
    assert size > 8 << 20  # the sampled path, not the whole-file hash
    with f.open("r+b") as fh:
        fh.seek(size - 100)
        tail = fh.read(4)
        fh.seek(size - 100)
        fh.write(bytes(b ^ 0xFF for b in tail))
    assert ModelConfig.from_pretrained(copy).fingerprint != before


_SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=100, max_position_embeddings=4096)


@pytest.mark.parametrize("hf,window,layers", [
    (dict(model_type="mistral", sliding_window=16), 16, (0, 1, 2)),
    (dict(model_type="mistral", sliding_window=None), None, ()),
    # transformers' Llama ignores the key: no layer slides.
    (dict(model_type="llama", sliding_window=16), None, ()),
    (dict(model_type="qwen2", use_sliding_window=False, sliding_window=16), None, ()),
    # Qwen2 slides from layer max_window_layers on, unless layer_types says which.
    (dict(model_type="qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1),
     16, (1, 2)),
    (dict(model_type="qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=5),
     None, ()),
    (dict(model_type="qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=0,
          layer_types=["sliding_attention", "full_attention", "sliding_attention"]), 16, (0, 2)),
])
def test_sliding_window_is_kept_per_layer_and_never_caps_the_length(hf, window, layers) -> None:
    cfg = ModelConfig.from_hf_dict({**_SIZES, **hf})
    assert (cfg.sliding_window, cfg.sliding_window_layers) == (window, layers)
    assert [cfg.layer_sliding_window(i) for i in range(3)] == [window if i in layers else None
                                                               for i in range(3)]
    assert cfg.max_model_len == 4096  # max_position_embeddings, whatever the window


def test_sliding_window_is_part_of_the_fingerprint() -> None:
    full = ModelConfig.from_hf_dict({**_SIZES, "model_type": "mistral", "sliding_window": None})
    w16, w32 = (ModelConfig.from_hf_dict({**_SIZES, "model_type": "mistral", "sliding_window": w})
                for w in (16, 32))
    assert len({full.fingerprint, w16.fingerprint, w32.fingerprint}) == 3


def test_bad_sliding_window_config_is_value_error() -> None:
    with pytest.raises(ValueError, match="sliding_window"):
        ModelConfig.from_hf_dict({**_SIZES, "model_type": "mistral", "sliding_window": "16"})
    with pytest.raises(ValueError, match="layer_types"):
        ModelConfig.from_hf_dict({**_SIZES, "model_type": "qwen2", "use_sliding_window": True,
                                  "sliding_window": 16, "layer_types": ["sliding_attention"]})


# ---------------------------------------------------------------- keys refused, never ignored

# Granite's multipliers on a checkpoint relabelled `llama`, and other keys that change the
# computation without any engine support: each is refused by name.
@pytest.mark.parametrize("key,value", [
    ("embedding_multiplier", 12.0), ("residual_multiplier", 0.22), ("attention_multiplier", 0.0078125),
    ("logits_scaling", 8.0), ("partial_rotary_factor", 0.5), ("quantization_config", {"quant_method": "awq"}),
    ("final_logit_softcapping", 30.0), ("query_pre_attn_scalar", 256),
])
def test_a_computation_key_the_engine_lacks_is_refused_by_name(key: str, value) -> None:
    with pytest.raises(ValueError, match=key):
        ModelConfig.from_hf_dict({**_SIZES, "model_type": "llama", key: value})


def test_inert_and_no_op_keys_are_accepted() -> None:
    base = ModelConfig.from_hf_dict({**_SIZES, "model_type": "llama"})
    same = ModelConfig.from_hf_dict({**_SIZES, "model_type": "llama", "partial_rotary_factor": 1.0,
                                     "attention_dropout": 0.1, "use_cache": False, "pad_token_id": 0,
                                     "initializer_range": 0.5, "pretraining_tp": 1})
    assert same.fingerprint == base.fingerprint


_GRANITE_MULTIPLIERS = {"embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                        "attention_multiplier": 0.0078125, "logits_scaling": 8.0}


def test_granite_is_read_as_granite_and_refused_relabelled_llama() -> None:
    granite = ModelConfig.from_hf_dict({**_SIZES, "model_type": "granite", "architectures": ["GraniteForCausalLM"],
                                        **_GRANITE_MULTIPLIERS, "attention_bias": True})
    assert (granite.embedding_scale, granite.residual_scale, granite.attention_scale,
            granite.final_logit_divisor) == (12.0, 0.22, 0.0078125, 8.0)
    assert granite.attention_bias and granite.attention_out_bias and not granite.mlp_bias
    # GraniteConfig's defaults: multipliers of 1, so scores scaled by 1, not head_dim ** -0.5.
    plain = ModelConfig.from_hf_dict({**_SIZES, "model_type": "granite"})
    assert (plain.embedding_scale, plain.residual_scale, plain.attention_scale,
            plain.final_logit_divisor) == (None, None, 1.0, None)
    # The same checkpoint relabelled llama: its multipliers are refused by name, not ignored.
    with pytest.raises(ValueError, match="embedding_multiplier"):
        ModelConfig.from_hf_dict({**_SIZES, "model_type": "llama", **_GRANITE_MULTIPLIERS})
    with pytest.raises(ValueError, match="GraniteForCausalLM.*llama"):
        ModelConfig.from_hf_dict({**_SIZES, "model_type": "llama", "architectures": ["GraniteForCausalLM"]})
    for bad in (0, -1.0, "8", True, float("nan")):
        with pytest.raises(ValueError, match="logits_scaling"):
            ModelConfig.from_hf_dict({**_SIZES, "model_type": "granite", "logits_scaling": bad})


def test_unknown_rope_parameters_and_mislabelled_architectures_are_refused() -> None:
    with pytest.raises(ValueError, match="LlamaForCausalLM.*qwen3|qwen3.*LlamaForCausalLM"):
        ModelConfig.from_hf_dict({**_SIZES, "model_type": "qwen3", "architectures": ["LlamaForCausalLM"]})
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
    with pytest.raises(ValueError, match="extrapolation_factor"):
        ModelConfig.from_hf_dict({**_SIZES, "model_type": "llama",
                                  "rope_parameters": {**yarn, "extrapolation_factor": 2.0}})


def test_existing_models_keep_their_fingerprints() -> None:
    """Ids of configs the engine ran before model families existed (weights identity ""):
    chunks they stored stay valid."""
    assert ModelConfig.from_hf_dict({**_SIZES, "model_type": "mistral", "sliding_window": 16}
                                    ).fingerprint == "479b6ef6fd9bd16f20699fa61e78d9ff"
    assert ModelConfig.from_hf_dict({**_SIZES, "model_type": "qwen2"}).fingerprint == "7407fb48274c1b93f987efdbeebb8802"
    llama3 = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 4.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    assert ModelConfig.from_hf_dict({**_SIZES, "model_type": "llama", "rope_parameters": llama3}
                                    ).fingerprint == "75e466c1fe295461f933ea6e0926add3"


_QWEN3_MOE = {**_SIZES, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
              "moe_intermediate_size": 32}


@pytest.mark.parametrize("base,change", [
    (_QWEN3_MOE, {"norm_topk_prob": True}),
    (_QWEN3_MOE, {"num_experts_per_tok": 1}),
    (_QWEN3_MOE, {"mlp_only_layers": [1]}),
    (_QWEN3_MOE, {"decoder_sparse_step": 2}),
    ({**_SIZES, "model_type": "llama"}, {"rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                                                            "original_max_position_embeddings": 256}}),
    ({**_SIZES, "model_type": "qwen3"}, {"attention_bias": True}),
    ({**_SIZES, "model_type": "olmo2"}, {"rms_norm_eps": 1e-5}),
    *(({**_SIZES, "model_type": "granite"}, {k: v}) for k, v in _GRANITE_MULTIPLIERS.items()),
])
def test_fingerprint_covers_each_computation_key(base, change) -> None:
    assert ModelConfig.from_hf_dict({**base, **change}).fingerprint != ModelConfig.from_hf_dict(base).fingerprint


def test_families_differ_by_fingerprint_at_equal_sizes() -> None:
    """Same sizes, different computation (q/k norm, norm layout, MoE): different ids."""
    prints = {ModelConfig.from_hf_dict({**_SIZES, "model_type": t}).fingerprint
              for t in ("llama", "qwen3", "olmo2", "phi3", "mixtral", "granite")}
    assert len(prints) == 6


def test_family_features_are_read_from_config() -> None:
    q3 = ModelConfig.from_hf_dict({**_SIZES, "model_type": "qwen3"})
    assert q3.qk_norm == "head" and q3.norm_layout == "pre" and q3.moe is None
    olmo = ModelConfig.from_hf_dict({**_SIZES, "model_type": "olmo2", "attention_bias": True})
    assert (olmo.qk_norm, olmo.norm_layout, olmo.attention_bias) == ("full", "post", True)
    assert olmo.attention_out_bias
    # Sparse where (i + 1) % 2 == 0, i.e. layer 1, which mlp_only_layers keeps dense: no MoE.
    assert ModelConfig.from_hf_dict({**_QWEN3_MOE, "decoder_sparse_step": 2, "mlp_only_layers": [1]}).moe is None
    moe = ModelConfig.from_hf_dict({**_QWEN3_MOE, "mlp_only_layers": [1]})
    assert moe.moe is not None and moe.moe.layers == (0, 2) and not moe.moe.norm_topk_prob
    mix = ModelConfig.from_hf_dict({**_SIZES, "model_type": "mixtral", "num_local_experts": 4})
    assert mix.moe is not None and mix.moe.norm_topk_prob and mix.moe.intermediate_size == 128
    phi = ModelConfig.from_hf_dict({**_SIZES, "model_type": "phi3", "max_position_embeddings": 8192,
                                    "rope_scaling": {"type": "su", "short_factor": [1.0] * 8,
                                                     "long_factor": [2.0] * 8}})
    assert phi.rope_scaling is not None and phi.rope_scaling["rope_type"] == "longrope"
    assert phi.rope_scaling["original_max_position_embeddings"] == 4096 and phi.rope_scaling["factor"] == 2.0
    with pytest.raises(ValueError, match="short_factor"):
        ModelConfig.from_hf_dict({**_SIZES, "model_type": "phi3", "rope_scaling": {
            "type": "longrope", "short_factor": [1.0] * 3, "long_factor": [2.0] * 8}})


def test_yarn_and_longrope_inv_freq_and_attention_factor_match_transformers() -> None:
    from transformers import LlamaConfig, Phi3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from engine.rotary import attention_factor

    yarn = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 4096,
            "beta_fast": 16, "mscale": 0.7, "mscale_all_dim": 1.0}
    hf_cfg = LlamaConfig(hidden_size=2048, num_attention_heads=16, head_dim=128, rope_parameters=yarn,
                         max_position_embeddings=16384)
    ref, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
    ours = ModelConfig.from_hf_dict({**_SIZES, "model_type": "llama", "head_dim": 128,
                                     "max_position_embeddings": 16384, "rope_parameters": yarn})
    got = compute_inv_freq(128, ours.rope_theta, ours.rope_scaling)
    torch.testing.assert_close(got, ref.float(), rtol=1e-6, atol=0)
    assert attention_factor(ours.rope_scaling) == pytest.approx(ref_factor, rel=1e-9)
    longrope = {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0 + i / 10 for i in range(48)],
                "long_factor": [2.0 + i / 5 for i in range(48)]}
    phi = Phi3Config(hidden_size=3072, num_attention_heads=32, max_position_embeddings=131072,
                     original_max_position_embeddings=4096, rope_parameters=longrope)
    ours = ModelConfig.from_hf_dict({**_SIZES, "model_type": "phi3", "hidden_size": 3072, "num_attention_heads": 32,
                                     "num_key_value_heads": 32, "max_position_embeddings": 131072,
                                     "original_max_position_embeddings": 4096, "rope_scaling": longrope})
    for long in (False, True):
        ref, ref_factor = ROPE_INIT_FUNCTIONS["longrope"](phi, "cpu", seq_len=5000 if long else None)
        got = compute_inv_freq(96, ours.rope_theta, ours.rope_scaling, long=long)
        torch.testing.assert_close(got, ref.float(), rtol=1e-6, atol=0)
        assert attention_factor(ours.rope_scaling) == pytest.approx(ref_factor, rel=1e-9)
