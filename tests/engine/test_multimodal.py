"""A multimodal checkpoint run as its text part (engine/models/multimodal.py): Gemma 3's
image-text config read as transformers builds its text model, the outer keys inert or refused
by name, a fingerprint that is the text model's, both tensor namings loaded (the vision tower
never read), and image input refused by name. The published configs' shrink-and-compare proof
against transformers is tests/engine/test_real_configs.py's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.model_config import ModelConfig
from engine.model_loader import iter_safetensors, load_model
from engine.models.multimodal import GEMMA3, checkpoint_names
from harness.model import make_checkpoint
from harness.paged import PagedDriver, hf_logits

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "real_configs"
IMAGE = 999  # the tiny checkpoint's image placeholder, inside its 1000-token vocabulary


def published(name: str = "google--gemma-3-4b-it") -> dict[str, Any]:
    return json.loads((CORPUS / f"{name}.json").read_text())


@pytest.mark.parametrize("name", ["google--gemma-3-4b-it", "google--gemma-3-27b-it"])
def test_the_text_part_is_transformers_text_config(name: str) -> None:
    from transformers import AutoConfig

    raw = published(name)
    text = AutoConfig.for_model("gemma3", **{k: v for k, v in raw.items() if k != "model_type"}).text_config
    cfg = ModelConfig.from_hf_dict(raw)
    assert (cfg.architecture, cfg.checkpoint_architecture) == ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_size,
            cfg.vocab_size, cfg.max_position_embeddings, cfg.rms_norm_eps, cfg.sliding_window) == (
        text.hidden_size, text.intermediate_size, text.num_hidden_layers, text.num_attention_heads,
        text.num_key_value_heads, text.head_dim, text.vocab_size, text.max_position_embeddings, text.rms_norm_eps,
        text.sliding_window)
    assert cfg.sliding_window_layers == tuple(i for i, t in enumerate(text.layer_types) if t == "sliding_attention")
    full, local = text.rope_parameters["full_attention"], text.rope_parameters["sliding_attention"]
    assert (cfg.rope_theta, cfg.rope_scaling) == (full["rope_theta"], {"rope_type": "linear", "factor": full["factor"]})
    assert (cfg.local_rope_theta, cfg.local_rope_scaling) == (local["rope_theta"], None)
    assert cfg.attention_scale == text.query_pre_attn_scalar ** -0.5 and cfg.tie_word_embeddings
    assert (cfg.image_token_id, cfg.eos_token_ids, cfg.checkpoint_dtype) == (262144, [1, 106], "bfloat16")


def test_the_fingerprint_is_the_text_models() -> None:
    raw = published()
    text = {**raw["text_config"], "architectures": ["Gemma3ForCausalLM"], "eos_token_id": [1, 106]}

    def fingerprint(config: dict[str, Any]) -> str:
        return ModelConfig.from_hf_dict(config, weights_identity="w").fingerprint

    assert fingerprint(raw) == fingerprint(text)
    # The image path changes nothing the text computes; the text model's sizes do.
    assert fingerprint({**raw, "vision_config": {**raw["vision_config"], "num_hidden_layers": 2},
                        "mm_tokens_per_image": 64, "image_token_index": 7}) == fingerprint(raw)
    assert fingerprint({**raw, "text_config": {**raw["text_config"], "sliding_window": 512}}) != fingerprint(raw)
    assert fingerprint({**raw, "tie_word_embeddings": False}) != fingerprint(raw)  # the wrapper's head decides


@pytest.mark.parametrize("change,named", [
    ({"projector_scale": 2.0}, "projector_scale"),  # an outer key no one reads
    ({"text_config": {"model_type": "gemma2"}}, "text_config model_type 'gemma2'"),
    ({"text_config": {"final_logit_softcapping": 30.0}}, "final_logit_softcapping"),
    ({"text_config": {"attn_logit_softcapping": 50.0}}, "attn_logit_softcapping.*Gemma3ForConditionalGeneration"),
    ({"image_token_index": "<image>"}, "image_token_index"),
    # untied by text_config alone: transformers 4 unties, 5 ties (the wrapper's default)
    ({"text_config": {"tie_word_embeddings": False}}, "tie_word_embeddings"),
], ids=["outer", "text-type", "logit-cap", "score-cap", "image-token", "tie"])
def test_what_changes_the_text_computation_is_refused_by_name(change: dict[str, Any], named: str) -> None:
    raw = published()
    if "text_config" in change:
        change = {"text_config": {**raw["text_config"], **change["text_config"]}}
    with pytest.raises(ValueError, match=named):
        ModelConfig.from_hf_dict({**raw, **change})


def test_checkpoint_names_map_both_namings_and_skip_the_image_path() -> None:
    name = GEMMA3.checkpoint_name
    for old in ("language_model.model.layers.0.mlp.up_proj.weight", "model.language_model.layers.0.mlp.up_proj.weight"):
        assert name(old) == "model.layers.0.mlp.up_proj.weight"
    assert name("language_model.lm_head.weight") == name("lm_head.weight") == "lm_head.weight"
    for image in ("vision_tower.encoder.layers.0.mlp.fc1.weight", "model.vision_tower.embeddings.patch_embedding.bias",
                  "multi_modal_projector.mm_input_projection_weight",
                  "model.multi_modal_projector.mm_soft_emb_norm.weight"):
        assert name(image) is None
    assert name("model.unknown.weight") == "model.unknown.weight"  # loading names it as having no place
    assert checkpoint_names("Gemma3ForCausalLM") is None


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, default_model_path: Path) -> tuple[Path, Path, Any]:
    """(a tiny untied Gemma3ForConditionalGeneration as transformers saves it, the same with
    transformers 5's module naming, transformers' model)."""
    from transformers import AutoModelForCausalLM

    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=1000, query_pre_attn_scalar=24, sliding_window=8,
                layer_types=["sliding_attention", "full_attention"])
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    tmp = tmp_path_factory.mktemp("gemma3mm")
    saved = make_checkpoint(tmp / "saved", {"model_type": "gemma3", "text_config": text, "vision_config": vision,
                                            "mm_tokens_per_image": 4, "image_token_index": IMAGE,
                                            "tie_word_embeddings": False},
                            tokenizer_dir=default_model_path, keep_config=False)
    renamed = tmp / "renamed"
    shutil.copytree(saved, renamed)
    tensors = load_file(saved / "model.safetensors")
    assert "language_model.lm_head.weight" in tensors  # transformers 5.24 saves the published naming
    new = {}
    for k, v in tensors.items():
        k = k.replace("language_model.model.", "model.language_model.").replace("language_model.lm_head.", "lm_head.")
        new[k if k.startswith(("model.", "lm_head.")) else "model." + k] = v
    save_file(new, renamed / "model.safetensors", metadata={"format": "pt"})
    hf = AutoModelForCausalLM.from_pretrained(str(saved), dtype=torch.float32).eval()
    return saved, renamed, hf


def test_both_namings_load_as_transformers_text_only_run(tiny) -> None:
    saved, renamed, hf = tiny
    ids = [5, 17, 300, 12, 9, 44, 800, 3, 3, 61, 2, 77]  # past the 8-token window
    ref = hf_logits(hf, ids)
    for ckpt in (saved, renamed):
        ours, cfg = load_model(ckpt, torch.device("cpu"), torch.float32)
        assert not cfg.tie_word_embeddings and cfg.image_token_id == IMAGE
        torch.testing.assert_close(PagedDriver(ours, num_blocks=8).step([(0, ids)])[0], ref, atol=1e-4, rtol=0)
        names = [n for n, _ in iter_safetensors(ckpt, rename=checkpoint_names(cfg.checkpoint_architecture))]
        assert "lm_head.weight" in names and not any("vision" in n or "projector" in n for n in names)


def test_image_input_is_refused_by_name(tiny) -> None:
    saved, _, _ = tiny
    llm = LLM(str(saved), device="cpu", dtype="float32", num_gpu_blocks=8)
    params = SamplingParams(temperature=0.0, max_tokens=2)
    try:
        with pytest.raises(ValueError, match=f"token {IMAGE}, Gemma3ForConditionalGeneration's image placeholder"):
            llm.generate([{"prompt_token_ids": [5, IMAGE, 7]}], params)
        with pytest.raises(ValueError, match="multi_modal_data: image"):
            llm.generate([{"prompt": "hi", "multi_modal_data": {"image": object()}}], params)
        assert len(llm.generate([{"prompt_token_ids": [5, 6, 7]}], params)[0].outputs[0].token_ids) == 2
    finally:
        llm.shutdown()

