"""What vLLM's configuration means to the connector (connector/vllm/setup.py), the parts that
need no vLLM: hit sources for vLLM's per-tier counts, layer numbers from vLLM's layer names,
a multimodal checkpoint refused while vLLM takes images for it, the K/V dtypes it takes and how
chunks of each are keyed."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from connector.connector_config import ConnectorConfig
from connector.vllm.setup import VllmModel, VllmSetup, hit_sources, kv_cache_dtype, layer_index, refuse_image_input

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "real_configs"


def test_hit_sources_name_vllms_members_and_add_up() -> None:
    assert hit_sources({"0:cpu?budget=4GiB": 512, "1:disk:///var/kv": 256, "2:redis://h:6379/0": 256}, 1024) == {
        "HOST": 512, "DISK": 256, "EXTERNAL_UNSPECIFIED": 256}
    assert hit_sources({"0:kvtier://127.0.0.1:7000": 300}, 300) == {"EXTERNAL_UNSPECIFIED": 300}
    # what no tier accounts for (evicted since the lookup, a pending store) is unspecified
    assert hit_sources({"0:cpu": 256, "": 100}, 400) == {"HOST": 256, "EXTERNAL_UNSPECIFIED": 144}
    assert hit_sources({}, 0) == {}


def test_layer_index_reads_vllms_layer_names() -> None:
    assert layer_index("model.layers.3.self_attn.attn") == 3
    assert layer_index("language_model.model.layers.17.self_attn.attn") == 17
    for name in ("model.norm", "model.layers.1.mlp.experts.2.attn"):
        with pytest.raises(ValueError, match="layer number"):
            layer_index(name)


def test_vllm_taking_images_is_refused_for_a_multimodal_checkpoint(tmp_path: Path) -> None:
    def checkpoint(name: str, config: dict) -> Path:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        return tmp_path / name

    wrapped, text_only = (checkpoint(n, json.loads((CORPUS / f"google--gemma-3-{n}-it.json").read_text()))
                          for n in ("4b", "1b"))
    foreign = checkpoint("foreign", {"architectures": ["SomeVisionModel"], "model_type": "some_vision"})
    images, no_images = (SimpleNamespace(get_limit_per_prompt=lambda modality, n=n: n) for n in (999, 0))
    with pytest.raises(ValueError, match="Gemma3ForConditionalGeneration takes images.*--language-model-only"):
        refuse_image_input(wrapped, images)
    refuse_image_input(wrapped, no_images)  # vLLM's --language-model-only, or an image limit of 0
    refuse_image_input(text_only, images)  # a text checkpoint: no image placeholder to confuse
    refuse_image_input(wrapped, None)  # vLLM serves it as a text model
    with pytest.raises(ValueError, match="SomeVisionModel takes images"):  # an architecture only vLLM knows
        refuse_image_input(foreign, images)


def test_kv_cache_dtypes_taken_and_refused_by_name() -> None:
    cache = lambda name, **more: SimpleNamespace(cache_dtype=name, **more)  # noqa: E731
    assert [kv_cache_dtype(cache(n), "cpu") for n in ("auto", None, "fp8", "fp8_e4m3", "fp8_e5m2")] == [
        "auto", "auto", "fp8", "fp8_e4m3", "fp8_e5m2"]
    with pytest.raises(ValueError, match="'fp8' is not supported on vLLM's GPU backends"):
        kv_cache_dtype(cache("fp8"), "flash")
    with pytest.raises(ValueError, match="'int4_per_token_head' is not supported; use 'auto' or one of"):
        kv_cache_dtype(cache("int4_per_token_head"), "cpu")
    with pytest.raises(ValueError, match="calculate_kv_scales"):
        kv_cache_dtype(cache("fp8_e5m2", calculate_kv_scales=True), "cpu")


def test_fp8_chunks_are_keyed_by_their_format() -> None:
    def key_dtype(cache_dtype: str) -> str:
        setup = VllmSetup(ConnectorConfig(), VllmModel("m+vllm-cpu", 2, 2, 64), torch.bfloat16, 16, {},
                          loads=True, saves=True, events=False, cache_dtype=cache_dtype)
        return setup.keyspace().kv_dtype

    assert [key_dtype(n) for n in ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")] == [
        "bfloat16", "fp8_e4m3", "fp8_e4m3", "fp8_e5m2"]  # vLLM's "fp8" writes e4m3's bytes
