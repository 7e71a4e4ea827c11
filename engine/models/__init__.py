"""Model registry: HF architecture name -> our implementation class."""

from __future__ import annotations

from engine.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}


def get_model_class(architecture: str) -> type[LlamaForCausalLM]:
    """Returns the class implementing `architecture`; ValueError naming it if unsupported."""
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: "
                         f"{sorted(MODEL_REGISTRY)}") from None


__all__ = ["MODEL_REGISTRY", "LlamaForCausalLM", "get_model_class"]
