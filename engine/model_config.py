"""`ModelConfig`: what the engine needs to know about a Hugging Face checkpoint.

Built from the checkpoint's `config.json` (plus `generation_config.json` and the tokenizer
files for end-of-sequence ids). `fingerprint` names the model (architecture, every size and
the weights' identity) so that KV computed by one model can never be read by another.

Weights identity (cheap on every load, deterministic across processes and machines): for
each `*.safetensors` file, SHA-256 over its name, size, JSON header (tensor names, dtypes,
shapes, offsets) and 4 KiB samples at 33 evenly spaced offsets of its data region (the whole
file when it is at most 8 MiB). Reading ~130 KiB per shard costs milliseconds, needs no
sidecar file (checkpoint dirs may be read-only), and any fine-tune changes the sampled bytes.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# model_type -> the architecture our one Llama-family implementation registers for it.
SUPPORTED_MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

_SAMPLE_BYTES = 4096
_NUM_SAMPLES = 33
_HASH_WHOLE_FILE_BELOW = 8 << 20


@dataclass(frozen=True)
class ModelConfig:
    """Immutable description of one checkpoint; `fingerprint` is its stable hex identity."""

    architecture: str
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    # Normalised: None, or a dict with "rope_type" in SUPPORTED_ROPE_TYPES and its parameters.
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    # Bias on q/k/v projections (always for qwen2) and on o_proj (llama's attention_bias only).
    attention_bias: bool
    attention_out_bias: bool
    mlp_bias: bool
    eos_token_ids: list[int]
    bos_token_id: int | None
    # Mistral-style sliding window W: in the layers listed in `sliding_window_layers`, the
    # token at position i attends keys j with i - W < j <= i (transformers' convention); None
    # (and no layers) when every layer attends fully.
    sliding_window: int | None
    sliding_window_layers: tuple[int, ...]
    # The checkpoint's stored dtype name ("float32", "bfloat16", ...), informational.
    checkpoint_dtype: str
    fingerprint: str
    path: Path | None = field(default=None, compare=False)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_size

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_size

    @property
    def max_model_len(self) -> int:
        """Longest sequence this engine computes exactly (a sliding window does not cap it)."""
        return self.max_position_embeddings

    def layer_sliding_window(self, layer_idx: int) -> int | None:
        """Returns the window layer `layer_idx` attends over, or None for full attention."""
        return self.sliding_window if layer_idx in self.sliding_window_layers else None

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Reads a checkpoint dir; raises ValueError naming what is missing or unsupported."""
        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ValueError(f"{path}: not a Hugging Face checkpoint dir (no config.json)")
        hf = json.loads(cfg_file.read_text())
        _check_architecture(hf)  # before touching weights: the clearest error comes first
        eos = _collect_eos_ids(path, hf)
        return cls.from_hf_dict(hf, weights_identity=weights_identity(path), eos_token_ids=eos,
                                path=path)

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], weights_identity: str = "",
                     eos_token_ids: list[int] | None = None,
                     path: Path | None = None) -> ModelConfig:
        """Builds a config from a parsed HF `config.json` dict; validates every field we use."""
        model_type, arch = _check_architecture(hf)
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r} for {arch}; only 'silu'")
        hidden = _req_int(hf, "hidden_size")
        num_heads = _req_int(hf, "num_attention_heads")
        num_kv_heads = int(hf.get("num_key_value_heads") or num_heads)
        head_size = int(hf.get("head_dim") or hidden // num_heads)
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads {num_heads} is not a multiple of "
                             f"num_key_value_heads {num_kv_heads}")
        rope_theta, rope_scaling = _parse_rope(hf)
        if hf.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("partial_rotary_factor != 1 is not supported")
        is_qwen2 = model_type == "qwen2"
        attn_bias = True if is_qwen2 else bool(hf.get("attention_bias", False))
        num_layers = _req_int(hf, "num_hidden_layers")
        window, window_layers = _parse_sliding_window(hf, model_type, num_layers)
        eos = sorted(set(eos_token_ids if eos_token_ids is not None else _as_id_list(hf.get("eos_token_id"))))
        cfg: dict[str, Any] = dict(
            architecture=arch,
            model_type=model_type,
            hidden_size=hidden,
            intermediate_size=_req_int(hf, "intermediate_size"),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            vocab_size=_req_int(hf, "vocab_size"),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=attn_bias,
            attention_out_bias=attn_bias and not is_qwen2,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            eos_token_ids=eos,
            bos_token_id=hf.get("bos_token_id"),
            sliding_window=window,
            sliding_window_layers=window_layers,
            checkpoint_dtype=str(hf.get("dtype") or hf.get("torch_dtype") or "float32"),
        )
        return cls(**cfg, fingerprint=_fingerprint(cfg, weights_identity), path=path)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["path"] = str(self.path) if self.path else None
        return d


def _check_architecture(hf: dict[str, Any]) -> tuple[str, str]:
    """Returns (model_type, architecture); ValueError naming them if unsupported."""
    model_type = hf.get("model_type")
    archs = hf.get("architectures") or [SUPPORTED_MODEL_TYPES.get(model_type or "", "")]
    arch = archs[0]
    if model_type not in SUPPORTED_MODEL_TYPES or arch not in SUPPORTED_MODEL_TYPES.values():
        raise ValueError(
            f"unsupported architecture {arch!r} (model_type {model_type!r}); supported: "
            + ", ".join(f"{a} ({t})" for t, a in SUPPORTED_MODEL_TYPES.items()))
    return model_type, arch


def _req_int(hf: dict[str, Any], key: str) -> int:
    v = hf.get(key)
    if not isinstance(v, int) or v <= 0:
        raise ValueError(f"config.json: {key!r} must be a positive integer, got {v!r}")
    return v


def _parse_rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, normalised scaling) from HF 5.x `rope_parameters` or legacy keys."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # per-layer-type form
        params = params["full_attention"]
    if params:
        theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = hf.get("rope_theta", 10000.0)
        scaling = dict(hf.get("rope_scaling") or {})
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
    if rope_type == "default":
        return float(theta), None
    if "factor" not in scaling:
        raise ValueError(f"rope type {rope_type!r} needs a 'factor'")
    if rope_type == "llama3":
        for k in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if k not in scaling:
                raise ValueError(f"rope type 'llama3' needs {k!r}")
    return float(theta), {"rope_type": rope_type, **scaling}


def _parse_sliding_window(hf: dict[str, Any], model_type: str,
                          num_layers: int) -> tuple[int | None, tuple[int, ...]]:
    """Returns (window, the layers using it) exactly as transformers' modeling applies them:
    Mistral slides in every layer; Qwen2 only with `use_sliding_window`, in the layers its
    `layer_types` mark "sliding_attention" (default: index >= `max_window_layers`); Llama
    ignores the key. (None, ()) when no layer slides."""
    window = hf.get("sliding_window")
    if model_type == "llama" or not window:
        return None, ()
    if not isinstance(window, int) or window <= 0:
        raise ValueError(f"config.json: 'sliding_window' must be a positive integer, got {window!r}")
    if model_type != "qwen2":
        return window, tuple(range(num_layers))
    if not hf.get("use_sliding_window", False):
        return None, ()
    types = hf.get("layer_types")
    if types is None:
        first = int(hf.get("max_window_layers", 28))
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    if len(types) != num_layers or not set(types) <= {"full_attention", "sliding_attention"}:
        raise ValueError(f"config.json: 'layer_types' must name 'full_attention' or "
                         f"'sliding_attention' for each of {num_layers} layers, got {types!r}")
    layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    return (window, layers) if layers else (None, ())


def _as_id_list(v: Any) -> list[int]:
    if v is None:
        return []
    return [int(x) for x in v] if isinstance(v, list) else [int(v)]


def _collect_eos_ids(path: Path, hf: dict[str, Any]) -> list[int]:
    """Union of eos ids in config.json, generation_config.json and the tokenizer's eos token."""
    ids = set(_as_id_list(hf.get("eos_token_id")))
    gen = path / "generation_config.json"
    if gen.is_file():
        ids.update(_as_id_list(json.loads(gen.read_text()).get("eos_token_id")))
    tok_cfg, tok_json = path / "tokenizer_config.json", path / "tokenizer.json"
    if tok_cfg.is_file() and tok_json.is_file():
        eos = json.loads(tok_cfg.read_text()).get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str):
            tok = json.loads(tok_json.read_text())
            added = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
            vocab = (tok.get("model") or {}).get("vocab")
            if eos in added:
                ids.add(int(added[eos]))
            elif isinstance(vocab, dict) and eos in vocab:
                ids.add(int(vocab[eos]))
    return sorted(ids)


def weights_identity(path: Path) -> str:
    """SHA-256 hex over the checkpoint's safetensors files (see module docstring)."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors weights found")
    h = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        h.update(f.name.encode() + b"\0" + str(size).encode() + b"\0")
        with f.open("rb") as fh:
            if size <= _HASH_WHOLE_FILE_BELOW:
                h.update(fh.read())
                continue
            (header_len,) = struct.unpack("<Q", fh.read(8))
            h.update(fh.read(header_len))
            start = 8 + header_len
            span = max(size - start - _SAMPLE_BYTES, 0)
            for i in range(_NUM_SAMPLES):
                fh.seek(start + span * i // (_NUM_SAMPLES - 1))
                h.update(fh.read(_SAMPLE_BYTES))
    return h.hexdigest()


def _fingerprint(cfg: dict[str, Any], weights_id: str) -> str:
    """128-bit hex id of everything that makes two models' KV incompatible."""
    keys = ("architecture", "model_type", "hidden_size", "intermediate_size", "num_layers",
            "num_heads", "num_kv_heads", "head_size", "vocab_size", "rms_norm_eps",
            "rope_theta", "rope_scaling", "tie_word_embeddings", "attention_bias",
            "attention_out_bias", "mlp_bias")
    ident = {k: cfg[k] for k in keys}
    if cfg["sliding_window"] is not None:
        # The window changes the KV of every layer after the first sliding one. Named only
        # when set, so full-attention models keep the fingerprints (and stored chunks) they had.
        ident["sliding_window"] = [cfg["sliding_window"], list(cfg["sliding_window_layers"])]
    for k, v in ident.items():  # floats through repr so 1e5 and 100000.0 hash alike
        if isinstance(v, float) and math.isfinite(v):
            ident[k] = repr(v)
    ident["weights"] = weights_id
    blob = json.dumps(ident, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]
