"""The model registry: one entry per supported family, model_type -> architecture -> class.

Each `ModelFamily` names the transformers architecture it runs, the module under engine/models
that implements it (`impl`), the hook that reads the family's own `config.json` keys
(engine/models/family_configs.py) and its rope parser (the rope types it accepts). ModelConfig parsing and
model loading both read this one table, so what parses is what runs. A multimodal checkpoint
whose text part is one of these families runs as that family (engine/models/multimodal.py).

Model classes are named here and imported when a model is built (`get_model_class`): the
model modules import ModelConfig, which parses through this table, and reading a config (the
connector, vLLM's processes) needs no torch module of any family. Adding a Llama-like family
is an entry here, a hook for its keys and a few lines under engine/models.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.hf_config import HFConfig, parse_rope
from engine.models import family_configs as fc
from engine.models import gemma_config
from engine.models.multimodal import WRAPPERS

ConfigHook = Callable[[HFConfig, dict[str, Any]], None]
RopeParser = Callable[[HFConfig], tuple[float, dict[str, Any] | None]]


@dataclass(frozen=True)
class ModelFamily:
    model_type: str
    architecture: str
    # "<module>.<class>": engine.models.<module> defines the class that runs it.
    impl: str
    # Reads the family's keys into the ModelConfig fields dict (shared keys already there).
    parse: ConfigHook
    # Reads (rope_theta, normalised scaling) and so decides the rope types the family accepts.
    parse_rope: RopeParser = parse_rope
    # transformers' defaults of shared keys where they differ from the shared parser's: a key
    # absent from config.json takes these (Gemma 3's sparse text_config relies on them).
    defaults: dict[str, Any] | None = None


MODEL_REGISTRY: dict[str, ModelFamily] = {f.model_type: f for f in (
    ModelFamily("llama", "LlamaForCausalLM", "llama.LlamaForCausalLM", fc.llama),
    ModelFamily("mistral", "MistralForCausalLM", "llama.LlamaForCausalLM", fc.mistral),
    ModelFamily("qwen2", "Qwen2ForCausalLM", "llama.LlamaForCausalLM", fc.qwen2),
    ModelFamily("gemma2", "Gemma2ForCausalLM", "gemma.GemmaForCausalLM", gemma_config.gemma2),
    ModelFamily("gemma3_text", "Gemma3ForCausalLM", "gemma.GemmaForCausalLM", gemma_config.gemma3_text,
                defaults=gemma_config.GEMMA3_TEXT_DEFAULTS),
    ModelFamily("qwen3", "Qwen3ForCausalLM", "qwen3.Qwen3ForCausalLM", fc.qwen3),
    ModelFamily("qwen3_moe", "Qwen3MoeForCausalLM", "moe.Qwen3MoeForCausalLM", fc.qwen3_moe),
    ModelFamily("mixtral", "MixtralForCausalLM", "moe.MixtralForCausalLM", fc.mixtral),
    ModelFamily("phi3", "Phi3ForCausalLM", "phi3.Phi3ForCausalLM", fc.phi3, fc.phi3_rope),
    ModelFamily("olmo2", "Olmo2ForCausalLM", "olmo2.Olmo2ForCausalLM", fc.olmo2),
    ModelFamily("granite", "GraniteForCausalLM", "granite.GraniteForCausalLM", fc.granite),
)}


def supported() -> str:
    """Returns the supported families as 'Architecture (model_type)', comma-separated, then the
    multimodal ones run as their text part (engine/models/multimodal.py)."""
    return ", ".join([f"{f.architecture} ({t})" for t, f in MODEL_REGISTRY.items()]
                     + [f"{w.architecture} ({t}, text only)" for t, w in WRAPPERS.items()])


def family_for(hf: dict[str, Any]) -> ModelFamily:
    """Returns the family of a parsed `config.json`; ValueError naming its architecture and
    model_type when no family runs that pair."""
    model_type = hf.get("model_type")
    family = MODEL_REGISTRY.get(model_type) if isinstance(model_type, str) else None
    archs = hf.get("architectures") or [family.architecture if family else None]
    if family is None or archs[0] != family.architecture:
        raise ValueError(f"unsupported architecture {archs[0]!r} (model_type {model_type!r}); "
                         f"supported: {supported()}")
    return family


def get_model_class(architecture: str) -> type[Any]:
    """Returns the class implementing `architecture` (importing its module); ValueError naming
    it if unsupported."""
    for f in MODEL_REGISTRY.values():
        if f.architecture == architecture:
            module, name = f.impl.rsplit(".", 1)
            cls: type[Any] = getattr(importlib.import_module(f"engine.models.{module}"), name)
            return cls
    raise ValueError(f"unsupported architecture {architecture!r}; supported: {supported()}")


__all__ = ["MODEL_REGISTRY", "ModelFamily", "family_for", "get_model_class", "supported"]
