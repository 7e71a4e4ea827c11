"""Multimodal checkpoints run as their text part (issue #49): text-only prompts, images refused.

A wrapper checkpoint (Gemma 3's `Gemma3ForConditionalGeneration`) nests a supported text
model's config under `text_config` beside a vision tower and a projector. On a prompt without
images transformers' wrapper computes exactly its text model plus its own logits head, so the
engine runs the registry family of the text model (`text_part`) on the text tensors alone
(`checkpoint_names`); the vision tower and projector are never read from disk.

The outer keys are each read here: the image path's (vision config, image-token layout) are
inert for text, the logits head's tie flag is taken over, and any other key is refused by name
as for a text checkpoint. A `text_config` key that the wrapper's head ignores while the text
family's own head applies it is refused too (which one a checkpoint means is not knowable).
The image placeholder token id is kept so that a prompt holding it is refused (engine/llm_engine.py)
rather than run without its image. Torch-free, like every config hook.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.hf_config import HFConfig


@dataclass(frozen=True)
class Wrapper:
    """A multimodal architecture whose text part is a registry family's model, unchanged."""

    model_type: str
    architecture: str
    text_model_type: str  # the registry family that runs the text part
    # Outer keys only the image path reads (besides `vision_config`): inert for text prompts.
    image_keys: frozenset[str]
    image_token_key: str
    image_token_default: int
    tie_default: bool  # the wrapper config's tie_word_embeddings when absent (its head's)
    # text_config keys the text family's causal LM applies and the wrapper's head does not.
    head_keys: tuple[str, ...]
    # Checkpoint name prefix -> the text model's name prefix (both namings transformers
    # reads: the published `language_model.model.` and transformers 5's `model.language_model.`).
    renames: tuple[tuple[str, str], ...]
    # Prefixes of the image path's tensors: skipped unread.
    image_tensors: tuple[str, ...]

    def checkpoint_name(self, name: str) -> str | None:
        """Returns the text model's name of checkpoint tensor `name`, None for an image-path
        tensor (not to be read); a name under no known prefix is returned unchanged, so
        loading names it as having no place."""
        if name.startswith(self.image_tensors):
            return None
        for old, new in self.renames:
            if name.startswith(old):
                return new + name[len(old):]
        return name


# transformers' Gemma3Config: a SigLIP tower and an average-pool projector feed image
# embeddings in place of the image tokens; the head never soft-caps (Gemma3ForCausalLM's does).
GEMMA3 = Wrapper(
    model_type="gemma3", architecture="Gemma3ForConditionalGeneration", text_model_type="gemma3_text",
    image_keys=frozenset({"mm_tokens_per_image", "boi_token_index", "eoi_token_index", "boi_token_id",
                          "eoi_token_id"}),
    image_token_key="image_token_index", image_token_default=262_144, tie_default=True,
    head_keys=("final_logit_softcapping",),
    renames=(("language_model.model.", "model."), ("model.language_model.", "model."),
             ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head.")),
    image_tensors=("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                   "model.multi_modal_projector."),
)

WRAPPERS: dict[str, Wrapper] = {w.model_type: w for w in (GEMMA3,)}


@dataclass(frozen=True)
class TextPart:
    """A checkpoint's config as the text model the engine runs."""

    config: dict[str, Any]  # a registry family's config.json dict
    wrapper: Wrapper | None = None  # None: a text checkpoint, `config` is its own
    image_token_id: int | None = None


def wrapper_for(raw: dict[str, Any]) -> Wrapper | None:
    """Returns the wrapper a config.json dict is (its model_type and first architecture), or None."""
    model_type = raw.get("model_type")
    wrapper = WRAPPERS.get(model_type) if isinstance(model_type, str) else None
    archs = raw.get("architectures") or [wrapper.architecture if wrapper else None]
    return wrapper if wrapper is not None and archs[0] == wrapper.architecture else None


def text_part(raw: dict[str, Any]) -> TextPart:
    """Returns the text model's config of `raw`: `raw` itself for a text checkpoint; for a
    wrapper its `text_config` with the wrapper's head tie flag and token ids. ValueError names
    an outer key that is not understood, a text model type the wrapper does not run, or a text
    key the wrapper's head would ignore."""
    wrapper = wrapper_for(raw)
    if wrapper is None:
        return TextPart(raw)
    hf = HFConfig(raw, wrapper.architecture)
    text = hf.get("text_config", {})
    vision = hf.get("vision_config", {})  # the image path's tower: nothing of the text computation
    if not isinstance(text, dict) or not isinstance(vision, dict):
        raise ValueError(f"config.json: {wrapper.architecture}'s text_config and vision_config must be objects")
    text_type = text.get("model_type", wrapper.text_model_type)
    if text_type != wrapper.text_model_type:
        raise ValueError(f"config.json: text_config model_type {text_type!r} is not supported for "
                         f"{wrapper.architecture} (its text part runs as {wrapper.text_model_type!r})")
    for key in wrapper.head_keys:
        if text.get(key) is not None:
            raise ValueError(f"config.json: text_config {key}={text[key]!r}: {wrapper.architecture}'s head does "
                             f"not apply it while its text model's would; refusing the checkpoint rather "
                             f"than guessing which is meant")
    for key in wrapper.image_keys:
        hf.get(key)
    image_token = hf.get(wrapper.image_token_key, hf.get("image_token_id", wrapper.image_token_default))
    if isinstance(image_token, bool) or not isinstance(image_token, int):
        raise ValueError(f"config.json: {wrapper.image_token_key!r} must be a token id, got {image_token!r}")
    if "tie_word_embeddings" not in raw and text.get("tie_word_embeddings", wrapper.tie_default) != wrapper.tie_default:
        # transformers 5 ties by the wrapper's flag (here its default), 4.x by text_config's.
        raise ValueError(f"config.json: text_config tie_word_embeddings={text['tie_word_embeddings']!r} without the "
                         f"{wrapper.architecture} flag: transformers versions differ on whether the head is tied; "
                         "set tie_word_embeddings beside text_config")
    out = {**text, "model_type": wrapper.text_model_type,
           # The wrapper owns the logits head (transformers 5 ties it by the wrapper's flag); its
           # text model has none, so text_config's flag is moot.
           "tie_word_embeddings": hf.flag("tie_word_embeddings", wrapper.tie_default)}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # the outer ids generation uses
        if hf.get(key) is not None:
            out[key] = raw[key]
    for key in ("torch_dtype", "dtype"):  # the stored dtype, where only the outer config says it
        if key in raw and key not in text:
            out[key] = raw[key]
    hf.check_all_read()
    return TextPart(out, wrapper, image_token)


def checkpoint_names(architecture: str | None) -> Callable[[str], str | None] | None:
    """Returns the checkpoint-to-text-model tensor naming of wrapper `architecture` (see
    `Wrapper.checkpoint_name`), None for a text checkpoint (names are the model's own)."""
    for wrapper in WRAPPERS.values():
        if wrapper.architecture == architecture:
            return wrapper.checkpoint_name
    return None
