"""What kvtier knows of the GGUF architectures it reads: the Hugging Face `config.json` a
file's metadata describes, the HF name of each tensor, and what llama.cpp's converter did to
tensor values (undone here).

llama.cpp names one architecture per family (`general.architecture`) and keeps its sizes under
`<arch>.*` keys. Its converter changes two things besides names: for `llama` (Llama, Mistral,
SmolLM) it permutes the q/k rows of each head so that its rope kernel can rotate adjacent pairs
(`permuted_qk`: the rows go back to HF's rotate-halves order here), and for Gemma it stores
each RMSNorm weight w as 1 + w (`norm_offset`: subtracted here). Llama 3's rope scaling is
no metadata key but a tensor of per-pair frequency divisors (`rope_freqs.weight`), read back
into the `llama3` rope parameters it was computed from. Where the file is silent, llama.cpp's
own assumption for the architecture is taken (Gemma's attention scale and sliding pattern),
since that is how the file's authors ran it.

As with `config.json` (engine/hf_config.py), nothing is ignored silently: an `<arch>.*` key
no rule here reads, unless known to leave the forward pass unchanged, is refused by name, and
so is a tensor with no HF name. Torch-free.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

# `<arch>.*` keys that never change the forward pass: the vocabulary size (the embedding's
# rows decide), whether rope scaling was fine-tuned, the weight layout of Meta's original
# checkpoints (llama.cpp reads nothing from it).
_INERT = frozenset({"vocab_size", "rope.scaling.finetuned", "tensor_data_layout"})


class GGUFMetadata:
    """A GGUF's metadata for one architecture; remembers which `<arch>.` keys were read."""

    def __init__(self, fields: dict[str, Any], arch: str) -> None:
        self.fields = fields
        self.arch = arch
        self._read: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:
        """Returns `<arch>.<key>` (`default` when absent) and marks it read."""
        self._read.add(key)
        return self.fields.get(f"{self.arch}.{key}", default)

    def positive_int(self, key: str, default: int | None = None) -> int:
        """Returns a positive integer; a per-layer array must hold one value. ValueError naming the key."""
        v = self.get(key, default)
        if isinstance(v, list) and v and all(x == v[0] for x in v):
            v = v[0]
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"GGUF metadata {self.arch}.{key} must be a positive integer, got {v!r}")
        return int(v)

    def number(self, key: str, default: float | None = None) -> float | None:
        """Returns a float key (`default` when absent), widened exactly from the file's float32."""
        v = self.get(key)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float, np.number)):
            raise ValueError(f"GGUF metadata {self.arch}.{key} must be a number, got {v!r}")
        return float(v)

    def refuse(self, key: str, value: Any) -> ValueError:
        return ValueError(f"GGUF metadata {self.arch}.{key}={value!r} changes the computation and is not "
                          f"implemented for GGUF architecture {self.arch!r}; refusing the file rather than "
                          "running it wrong")

    def check_all_read(self) -> None:
        """Raises ValueError naming every `<arch>.` key no rule read that is not known to be inert."""
        prefix = f"{self.arch}."
        left = sorted(k for k in self.fields if k.startswith(prefix)
                      and k[len(prefix):] not in self._read and k[len(prefix):] not in _INERT)
        if left:
            shown = ", ".join(f"{k}={self.fields[k]!r}"[:80] for k in left)
            raise ValueError(f"GGUF metadata {shown}: not understood for GGUF architecture {self.arch!r}; "
                             "refusing keys that may change the computation rather than ignoring them")


ConfigRule = Callable[[GGUFMetadata, dict[str, Any], set[str]], None]


@dataclass(frozen=True)
class GGUFArch:
    name: str  # general.architecture
    model_type: str
    architecture: str
    # The rule adding the family's own config keys (given the shared ones and the tensor names).
    config: ConfigRule
    permuted_qk: bool = False
    norm_offset: float = 0.0
    # Gemma's four norms per layer (before and after attention and the MLP), else Llama's two.
    sandwich_norms: bool = False


def _llama(md: GGUFMetadata, cfg: dict[str, Any], names: set[str]) -> None:
    cfg["attention_bias"] = "blk.0.attn_q.bias" in names
    cfg["mlp_bias"] = "blk.0.ffn_up.bias" in names


def _qwen(md: GGUFMetadata, cfg: dict[str, Any], names: set[str]) -> None:
    """Qwen2 (q/k/v bias always) and Qwen3 (q/k norms; bias only with attention_bias): llama.cpp
    runs both with full attention in every layer."""
    if cfg["model_type"] == "qwen3":
        cfg["attention_bias"] = "blk.0.attn_q.bias" in names


def _gemma(md: GGUFMetadata, cfg: dict[str, Any], big_model_layers: int) -> None:
    """Gemma 2 and 3: gelu-tanh MLP, the attention scale llama.cpp uses (`attention.scale` when
    written, else by model size: its 27B models scale by hidden/heads, the others by head_dim)."""
    cfg["hidden_activation"] = "gelu_pytorch_tanh"
    del cfg["hidden_act"]
    scale = md.number("attention.scale")
    if scale is not None:
        cfg["query_pre_attn_scalar"] = scale ** -2
    elif cfg["num_hidden_layers"] == big_model_layers:
        cfg["query_pre_attn_scalar"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    else:
        cfg["query_pre_attn_scalar"] = cfg["head_dim"]


def _gemma2(md: GGUFMetadata, cfg: dict[str, Any], names: set[str]) -> None:
    """Gemma 2: every other layer slides (layer 0 first); score and logit caps, absent keys
    taking llama.cpp's (and transformers') 50 and 30."""
    _gemma(md, cfg, big_model_layers=46)
    cfg["attn_logit_softcapping"] = md.number("attn_logit_softcapping", 50.0)
    cfg["final_logit_softcapping"] = md.number("final_logit_softcapping", 30.0)
    cfg["sliding_window"] = md.positive_int("attention.sliding_window", 4096)
    cfg["layer_types"] = ["full_attention" if i % 2 else "sliding_attention"
                          for i in range(cfg["num_hidden_layers"])]


def _gemma3(md: GGUFMetadata, cfg: dict[str, Any], names: set[str]) -> None:
    """Gemma 3 (text): five sliding layers per global one unless `attention.sliding_window_pattern`
    says (a period or a per-layer list), none without a window; the global layers' RoPE is the
    shared one, the sliding layers' base `rope.freq_base_swa` (llama.cpp's default 1e4)."""
    _gemma(md, cfg, big_model_layers=62)
    n = cfg["num_hidden_layers"]
    window = md.get("attention.sliding_window")
    pattern = md.get("attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):
        if len(pattern) != n:
            raise md.refuse("attention.sliding_window_pattern", pattern)
        sliding = [bool(x) for x in pattern]
    else:
        period = md.positive_int("attention.sliding_window_pattern", 6)
        sliding = [(i + 1) % period != 0 for i in range(n)]
    if not window:
        sliding = [False] * n
    else:
        cfg["sliding_window"] = md.positive_int("attention.sliding_window")
    cfg["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
    final_cap = md.number("final_logit_softcapping")
    cfg["final_logit_softcapping"] = final_cap
    local = {"rope_type": "default", "rope_theta": md.number("rope.freq_base_swa", 10_000.0)}
    cfg["rope_parameters"] = {"full_attention": cfg["rope_parameters"], "sliding_attention": local}


ARCHS: dict[str, GGUFArch] = {a.name: a for a in (
    GGUFArch("llama", "llama", "LlamaForCausalLM", _llama, permuted_qk=True),
    GGUFArch("qwen2", "qwen2", "Qwen2ForCausalLM", _qwen),
    GGUFArch("qwen3", "qwen3", "Qwen3ForCausalLM", _qwen),
    GGUFArch("gemma2", "gemma2", "Gemma2ForCausalLM", _gemma2, norm_offset=1.0, sandwich_norms=True),
    GGUFArch("gemma3", "gemma3_text", "Gemma3ForCausalLM", _gemma3, norm_offset=1.0, sandwich_norms=True),
)}


def arch_for(name: Any) -> GGUFArch:
    """Returns the GGUFArch of a `general.architecture` value; ValueError naming it if unsupported."""
    arch = ARCHS.get(name) if isinstance(name, str) else None
    if arch is None:
        raise ValueError(f"unsupported GGUF architecture {name!r}; supported: {', '.join(ARCHS)}")
    return arch


def hf_config(arch: GGUFArch, fields: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]],
              rope_freqs: np.ndarray | None = None) -> dict[str, Any]:
    """Returns the `config.json` dict the metadata `fields`, the tensors (GGUF name -> shape,
    numpy order) and the `rope_freqs.weight` values if any describe; ValueError naming any key
    that is malformed, unimplemented or not understood."""
    md = GGUFMetadata(fields, arch.name)
    names = set(tensor_shapes)
    if "token_embd.weight" not in tensor_shapes:
        raise ValueError("GGUF file has no token_embd.weight tensor")
    hidden = md.positive_int("embedding_length")
    heads = md.positive_int("attention.head_count")
    head_dim = md.positive_int("attention.key_length", hidden // heads)
    for key in ("attention.value_length", "rope.dimension_count"):  # partial rotary, MLA-style values
        if md.positive_int(key, head_dim) != head_dim:
            raise md.refuse(key, md.get(key))
    theta = md.number("rope.freq_base", 10_000.0)
    cfg: dict[str, Any] = {
        "architectures": [arch.architecture],
        "model_type": arch.model_type,
        "hidden_size": hidden,
        "intermediate_size": md.positive_int("feed_forward_length"),
        "num_hidden_layers": md.positive_int("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": md.positive_int("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": md.number("attention.layer_norm_rms_epsilon", 1e-6),
        "max_position_embeddings": md.positive_int("context_length", 2048),
        "vocab_size": tensor_shapes["token_embd.weight"][0],
        "tie_word_embeddings": "output.weight" not in names,
        "hidden_act": "silu",
        "rope_parameters": {"rope_type": "default", "rope_theta": theta, **_rope_scaling(md)},
        **_token_ids(fields),
    }
    if rope_freqs is not None:
        if not arch.permuted_qk:  # only llama.cpp's `llama` architecture writes it so
            raise ValueError(f"GGUF tensor 'rope_freqs.weight' has no place in {arch.architecture}")
        cfg["rope_parameters"] = _llama3_rope(cfg["rope_parameters"], rope_freqs, head_dim)
    if md.get("expert_count", 0):
        raise md.refuse("expert_count", md.get("expert_count"))
    if md.get("attention.causal", True) is not True:
        raise md.refuse("attention.causal", md.get("attention.causal"))
    arch.config(md, cfg, names)
    md.check_all_read()
    return cfg


def _rope_scaling(md: GGUFMetadata) -> dict[str, Any]:
    """Returns the rope_parameters entries of the file's rope scaling (none or linear)."""
    kind = md.get("rope.scaling.type")
    md.get("rope.scaling.original_context_length")  # only yarn's frequencies use it
    factor = md.number("rope.scaling.factor")
    legacy = md.number("rope.scale_linear")  # the key older files wrote for linear scaling
    if kind in (None, "none") and legacy in (None, 1.0):
        return {}
    if kind in (None, "linear") and (legacy or factor):
        return {"rope_type": "linear", "factor": legacy or factor}
    raise md.refuse("rope.scaling.type", kind)


# Llama 3.1-3.3's rope scaling but for its factor: what `rope_freqs.weight` is read back as.
_LLAMA3 = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _llama3_rope(rope: dict[str, Any], divisors: np.ndarray, head_dim: int) -> dict[str, Any]:
    """Returns the `llama3` rope parameters whose frequencies are the base ones divided by
    `divisors` (llama.cpp's `rope_freqs.weight`, one per rotated pair): Llama 3's band limits
    and original context, the factor the largest divisor. ValueError unless they reproduce
    every divisor (another rope scaling stored this way)."""
    if rope.get("rope_type", "default") != "default":
        raise ValueError("GGUF file has both rope scaling metadata and a 'rope_freqs.weight' tensor")
    params = {**rope, "rope_type": "llama3", "factor": float(divisors.max()), **_LLAMA3}
    inv_freq = params["rope_theta"] ** -(np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    orig, low, high = (params[k] for k in ("original_max_position_embeddings", "low_freq_factor", "high_freq_factor"))
    smooth = np.clip((orig / wavelen - low) / (high - low), 0.0, 1.0)
    expected = 1 / ((1 - smooth) / params["factor"] + smooth)
    if divisors.shape != expected.shape or not np.allclose(divisors, expected, rtol=1e-5, atol=0):
        raise ValueError("GGUF tensor 'rope_freqs.weight' holds rope frequency divisors that are not "
                         f"Llama 3's scaling (factor {params['factor']:g}, low/high frequency factors 1/4, "
                         "original context 8192); refusing the file rather than running it wrong")
    return params


def _token_ids(fields: dict[str, Any]) -> dict[str, Any]:
    """Returns the config's bos/eos/pad ids. The end-of-turn and end-of-message tokens count as
    end of sequence too, as llama.cpp stops on them (Llama 3's <|eot_id|>, Gemma's <end_of_turn>)."""
    def ids(*keys: str) -> list[int]:
        return [int(fields[f"tokenizer.ggml.{k}"]) for k in keys if f"tokenizer.ggml.{k}" in fields]

    eos = sorted(set(ids("eos_token_id", "eot_token_id", "eom_token_id")))
    out: dict[str, Any] = {"bos_token_id": next(iter(ids("bos_token_id")), None),
                           "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
                           "pad_token_id": next(iter(ids("padding_token_id")), None)}
    return {k: v for k, v in out.items() if v is not None}


_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_PRE_NORMS = {"ffn_norm": "post_attention_layernorm"}
_SANDWICH_NORMS = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                   "post_ffw_norm": "post_feedforward_layernorm"}
_NAME = re.compile(r"(?:blk\.(\d+)\.)?(\w+)\.(weight|bias)")
ROPE_FREQS = "rope_freqs.weight"


def hf_name(arch: GGUFArch, gguf_name: str) -> str | None:
    """Returns the Hugging Face name of a GGUF tensor, None for one read into config.json
    (`rope_freqs.weight`); ValueError naming one it has no place for."""
    if gguf_name == ROPE_FREQS and arch.permuted_qk:
        return None
    m = _NAME.fullmatch(gguf_name)
    layer, leaf, kind = m.groups() if m else (None, "", "")
    if m and layer is None and leaf in _TOP:
        return f"{_TOP[leaf]}.{kind}"
    names = {**_LAYER, **(_SANDWICH_NORMS if arch.sandwich_norms else _PRE_NORMS)}
    if m and layer is not None and leaf in names:
        return f"model.layers.{layer}.{names[leaf]}.{kind}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no place in {arch.architecture} "
                     f"(GGUF architecture {arch.name!r}); refusing the file rather than dropping it")


def changes_values(arch: GGUFArch, gguf_name: str) -> bool:
    """Returns whether `hf_values` changes this tensor's values (not only their order)."""
    return bool(arch.norm_offset) and gguf_name.split(".")[-2].endswith("norm")


def hf_values(arch: GGUFArch, gguf_name: str, values: np.ndarray, cfg: dict[str, Any]) -> np.ndarray:
    """Returns the tensor as the HF checkpoint holds it, undoing llama.cpp's converter: the q/k
    rows of each head back from adjacent pairs to halves, a Gemma norm's unit offset removed."""
    leaf = gguf_name.split(".")[-2]
    if arch.permuted_qk and leaf in ("attn_q", "attn_k"):
        heads = cfg["num_attention_heads"] if leaf == "attn_q" else cfg["num_key_value_heads"]
        # llama.cpp's rows per head are (pair j, member t); HF's are (half t, index j).
        rest = values.shape[1:]
        values = values.reshape(heads, -1, 2, *rest).swapaxes(1, 2).reshape(-1, *rest)
    if changes_values(arch, gguf_name):
        values = values.astype(np.float32) - np.float32(arch.norm_offset)
    return values
