"""Reading a Hugging Face `config.json`: typed keys, rope parameters, layer types, and the rule
that no key changing the computation goes unread.

`HFConfig` records every key a parser reads. After the shared keys and the family's own keys
are read (engine/model_config.py, engine/models/family_configs.py), any key left that is not
known to leave the forward pass unchanged (`INERT_KEYS`: ids, dropout, training and
generation settings) is refused by name: a Granite checkpoint relabelled `llama` names its
`embedding_multiplier` instead of running wrong. Torch-free, so parsing a config never
imports the model code.
"""

from __future__ import annotations

from typing import Any

# Keys that never change what the forward pass computes at inference: identity and metadata,
# token ids, dropout (off in eval), training-only losses and noise, generation defaults.
INERT_KEYS = frozenset({
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "_name_or_path",
    "_model_name_or_path", "unk_token_id",
    "use_cache", "initializer_range", "pretraining_tp", "tokenizer_class", "auto_map",
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    "attention_dropout", "hidden_dropout", "embd_pdrop", "resid_pdrop", "dropout",
    "output_attentions", "output_hidden_states", "return_dict", "torchscript", "use_bfloat16",
    "output_router_logits", "router_aux_loss_coef", "router_jitter_noise", "router_z_loss_coef",
    "id2label", "label2id", "problem_type", "finetuning_task", "task_specific_params", "prefix",
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
    "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
    "suppress_tokens", "begin_suppress_tokens", "chunk_size_feed_forward", "pruned_heads",
    "tf_legacy_loss", "is_decoder", "is_encoder_decoder", "add_cross_attention",
    "cross_attention_hidden_size", "tie_encoder_decoder",
    "transformers.js_config",  # settings of another runtime (transformers.js: its quantised files)
})


class HFConfig:
    """A parsed `config.json` for one architecture that remembers which keys were read."""

    def __init__(self, raw: dict[str, Any], architecture: str) -> None:
        self.raw = raw
        self.architecture = architecture
        self._read: set[str] = set()

    def __contains__(self, key: str) -> bool:
        return key in self.raw

    def get(self, key: str, default: Any = None) -> Any:
        """Returns the key's value (`default` when absent or null) and marks it read."""
        self._read.add(key)
        v = self.raw.get(key)
        return default if v is None else v

    def positive_int(self, key: str, default: int | None = None) -> int:
        """Returns a required (or defaulted) positive integer; ValueError naming the key."""
        v = self.get(key, default)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"config.json: {key!r} must be a positive integer, got {v!r}")
        return v

    def flag(self, key: str, default: bool = False) -> bool:
        return bool(self.get(key, default))

    def inert_unless(self, key: str, *noop_values: Any) -> None:
        """Reads a key the engine does not implement: fine when absent or one of `noop_values`
        (the value that leaves the computation unchanged), else ValueError naming it."""
        v = self.get(key)
        if v is not None and v not in noop_values:
            raise ValueError(self.refusal(key, v))

    def refusal(self, key: str, value: Any) -> str:
        return (f"config.json: {key}={value!r} changes the computation and is not implemented for "
                f"{self.architecture}; refusing the checkpoint rather than running it wrong")

    def check_all_read(self) -> None:
        """Raises ValueError naming every key no parser read that is not known to be inert."""
        left = sorted(k for k in self.raw if k not in self._read and k not in INERT_KEYS)
        if left:
            shown = ", ".join(f"{k}={self.raw[k]!r}"[:80] for k in left)
            raise ValueError(f"config.json: {shown}: not understood for {self.architecture}; "
                             "refusing keys that may change the computation rather than ignoring them")


# rope type -> the parameters it requires and those it may have (besides rope_theta).
ROPE_TYPES: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "default": (frozenset(), frozenset()),
    "linear": (frozenset({"factor"}), frozenset()),
    "llama3": (frozenset({"factor", "low_freq_factor", "high_freq_factor",
                          "original_max_position_embeddings"}), frozenset()),
    "yarn": (frozenset({"factor", "original_max_position_embeddings"}),
             frozenset({"attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                        "truncate"})),
}
# Phi-3's: its config maps "su" and "yarn" to longrope.
LONGROPE_TYPES: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "default": ROPE_TYPES["default"],
    "longrope": (frozenset({"short_factor", "long_factor", "factor", "original_max_position_embeddings"}),
                 frozenset({"attention_factor"})),
}
# Scaled rope types whose original context defaults to max_position_embeddings, and whose
# factor defaults to the ratio of the two (transformers' standardize_rope_params and rope
# functions).
_CONTEXT_DEFAULTS = ("yarn", "longrope")


def parse_rope(hf: HFConfig, params: dict[str, Any] | None = None,
               rope_types: dict[str, tuple[frozenset[str], frozenset[str]]] = ROPE_TYPES,
               aliases: dict[str, str] | None = None,
               original_max_default: int | None = None) -> tuple[float, dict[str, Any] | None]:
    """Returns (rope_theta, normalised scaling or None) from HF 5.x `rope_parameters` (or
    `params`, one layer type's entry) or the legacy `rope_theta` / `rope_scaling` keys. The
    scaling dict holds "rope_type" (after `aliases`) and its parameters, yarn's and longrope's
    original context and factor filled in as transformers defaults them; ValueError for an
    unsupported type, a missing parameter, or one the engine would ignore."""
    if params is None:
        params = hf.get("rope_parameters")
        if isinstance(params, dict) and "full_attention" in params:  # per-layer-type form
            params = params["full_attention"]
    legacy_theta = hf.get("rope_theta", 10000.0)
    if params:
        theta = params.get("rope_theta", legacy_theta)
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        hf.get("rope_scaling")  # superseded by rope_parameters
    else:  # transformers reads legacy rope_scaling as rope_parameters, rope_theta included
        scaling = dict(hf.get("rope_scaling") or {})
        theta = scaling.pop("rope_theta", legacy_theta)
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    rope_type = (aliases or {}).get(rope_type, rope_type)
    if rope_type in _CONTEXT_DEFAULTS:
        max_pos = hf.get("max_position_embeddings", 2048)
        # A top-level key (Phi-3's, defaulting to `original_max_default`) wins.
        orig = hf.get("original_max_position_embeddings", original_max_default)
        if orig is not None or scaling.get("original_max_position_embeddings") is None:
            scaling["original_max_position_embeddings"] = orig if orig is not None else max_pos
        if scaling.get("factor") is None:
            scaling["factor"] = max_pos / scaling["original_max_position_embeddings"]
    if scaling.get("partial_rotary_factor", 1.0) == 1.0:
        scaling.pop("partial_rotary_factor", None)
    if rope_type not in rope_types:
        raise ValueError(f"unsupported rope type {rope_type!r} for {hf.architecture}; "
                         f"supported: {tuple(rope_types)}")
    required, optional = rope_types[rope_type]
    for k in sorted(required - set(scaling)):
        raise ValueError(f"rope type {rope_type!r} needs {k!r}")
    for k in sorted(set(scaling) - required - optional):
        raise ValueError(f"rope parameter {k}={scaling[k]!r} (rope type {rope_type!r}) is not "
                         f"implemented for {hf.architecture}")
    if rope_type == "default":
        return float(theta), None
    return float(theta), {"rope_type": rope_type, **scaling}


def parse_layer_types(hf: HFConfig, num_layers: int,
                      default: list[str]) -> list[str]:
    """Returns each layer's type ("full_attention" or "sliding_attention") from `layer_types`,
    else `default`; ValueError if the list is malformed."""
    types = hf.get("layer_types", default)
    if (not isinstance(types, list) or len(types) != num_layers
            or not set(types) <= {"full_attention", "sliding_attention"}):
        raise ValueError(f"config.json: 'layer_types' must name 'full_attention' or "
                         f"'sliding_attention' for each of {num_layers} layers, got {types!r}")
    return types
