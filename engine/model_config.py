"""`ModelConfig`: what the engine needs to know about a Hugging Face checkpoint.

Built from the checkpoint's `config.json` (the keys every family shares here, each family's
own by its hook in the registry, engine/models; `generation_config.json` and the tokenizer
files add end-of-sequence ids). `fingerprint` names the model (architecture, every size and
the weights' identity) so that KV computed by one model can never be read by another.

Weights identity (cheap on every load, deterministic across processes and machines): for
each `*.safetensors` file, SHA-256 over its name, size, JSON header (tensor names, dtypes,
shapes, offsets) and 4 KiB samples at 33 evenly spaced offsets of its data region (the whole
file when it is at most 8 MiB). Reading ~130 KiB per shard costs milliseconds, needs no
sidecar file (checkpoint dirs may be read-only), and any fine-tune changes the sampled bytes.
A dir converted from a GGUF file (engine/gguf_checkpoint.py) records the SHA-256 of the file's
bytes in `GGUF_SOURCE`, and the identity names it too: two quantisations of one model (which
may differ in a few tensors the samples miss) never share an identity, nor a GGUF its
safetensors original.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import struct
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from engine.hf_config import HFConfig
from engine.models import family_for
from engine.models.multimodal import text_part

_SAMPLE_BYTES = 4096
_NUM_SAMPLES = 33
_HASH_WHOLE_FILE_BELOW = 8 << 20
# In a dir converted from GGUF: {"sha256": <the GGUF file's>, ...}.
GGUF_SOURCE = "gguf_source.json"


@dataclass(frozen=True)
class MoEConfig:
    """Routed experts of a sparse MLP (Mixtral, Qwen3-MoE)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    # Renormalise the top-k router probabilities to sum to 1 (Mixtral always; Qwen3-MoE's
    # norm_topk_prob); else they stay the softmax over all experts.
    norm_topk_prob: bool
    # The layers whose MLP is sparse; the others use the dense MLP of `intermediate_size`.
    layers: tuple[int, ...]


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
    # Normalised: None, or a dict with "rope_type" (engine/hf_config.py ROPE_TYPES) and its
    # parameters.
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    # Bias on q/k/v projections and on o_proj.
    attention_bias: bool
    attention_out_bias: bool
    mlp_bias: bool
    eos_token_ids: list[int]
    bos_token_id: int | None
    # Sliding window W: in the layers listed in `sliding_window_layers`, the token at position
    # i attends keys j with i - W < j <= i (transformers' convention); None (and no layers)
    # when every layer attends fully.
    sliding_window: int | None
    sliding_window_layers: tuple[int, ...]
    # The checkpoint's stored dtype name ("float32", "bfloat16", ...), informational.
    checkpoint_dtype: str
    fingerprint: str
    path: Path | None = field(default=None, compare=False)
    # Family features. Each default is the Llama computation; `_fingerprint` names a feature
    # only when it differs from its default, so the models that predate it keep their ids.
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" or "gelu_pytorch_tanh"
    # Scores are scale * q.k; None: head_size ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5,
    # Granite: attention_multiplier).
    attention_scale: float | None = None
    # q/k RMSNorm before RoPE: "head" (per head over head_size, Qwen3), "full" (over the whole
    # projection, OLMo 2), None.
    qk_norm: str | None = None
    # Where the decoder layer's norms sit (engine/layers/decoder.py): "pre" (Llama), "post"
    # (OLMo 2: after each sub-layer), "sandwich" (Gemma 2/3: before and after each).
    norm_layout: str = "pre"
    norm_unit_offset: bool = False  # RMSNorm scales by (1 + weight) (Gemma)
    # Embeddings multiplied by this (Gemma: sqrt(hidden); Granite: embedding_multiplier).
    embedding_scale: float | None = None
    # Each branch output (attention, MLP) multiplied by this before it joins the residual
    # stream (Granite's residual_multiplier).
    residual_scale: float | None = None
    attn_logit_softcap: float | None = None  # cap * tanh(score / cap) on attention scores
    final_logit_softcap: float | None = None  # the same on the final logits
    final_logit_divisor: float | None = None  # the final logits divided by this (Granite's logits_scaling)
    # RoPE of the sliding layers when it differs from the full layers' (Gemma 3's local base).
    local_rope_theta: float | None = None
    local_rope_scaling: dict[str, Any] | None = None
    moe: MoEConfig | None = None
    # A multimodal checkpoint run as its text part (engine/models/multimodal.py): the
    # checkpoint's own architecture, whose tensor naming loading follows, and the image
    # placeholder token a prompt may not hold. Neither changes the text computation, so the
    # fingerprint (which names the text model above) leaves them out.
    checkpoint_architecture: str | None = None
    image_token_id: int | None = None

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

    def layer_rope(self, layer_idx: int) -> tuple[float, dict[str, Any] | None]:
        """Returns (theta, scaling) of the RoPE layer `layer_idx` applies."""
        if self.local_rope_theta is not None and layer_idx in self.sliding_window_layers:
            return self.local_rope_theta, self.local_rope_scaling
        return self.rope_theta, self.rope_scaling

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Reads a checkpoint dir; raises ValueError naming what is missing or unsupported."""
        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ValueError(f"{path}: not a Hugging Face checkpoint dir (no config.json)")
        hf = json.loads(cfg_file.read_text())
        text = text_part(hf).config  # a multimodal checkpoint's ids are its text part's
        family_for(text)  # before touching weights: the clearest error comes first
        eos = _collect_eos_ids(path, text)
        return cls.from_hf_dict(hf, weights_identity=weights_identity(path), eos_token_ids=eos,
                                path=path)

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], weights_identity: str = "",
                     eos_token_ids: list[int] | None = None,
                     path: Path | None = None) -> ModelConfig:
        """Builds a config from a parsed HF `config.json` dict: the keys every family shares
        here, the family's own keys by its registry hook (engine/models); a multimodal
        checkpoint's as its text part's. Raises ValueError naming a bad value, an unsupported
        architecture, or any key that may change the computation and that no parser read."""
        part = text_part(raw)
        family = family_for(part.config)
        raw = {**(family.defaults or {}), **part.config}
        where = f"{part.wrapper.architecture}'s text_config" if part.wrapper else family.architecture
        hf = HFConfig(raw, where)
        num_heads = hf.positive_int("num_attention_heads")
        num_kv_heads = hf.positive_int("num_key_value_heads", num_heads)
        hidden = hf.positive_int("hidden_size")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads {num_heads} is not a multiple of "
                             f"num_key_value_heads {num_kv_heads}")
        rope_theta, rope_scaling = family.parse_rope(hf)
        hf.inert_unless("partial_rotary_factor", 1.0)
        eos = sorted(set(eos_token_ids if eos_token_ids is not None else _as_id_list(hf.get("eos_token_id"))))
        cfg: dict[str, Any] = dict(
            architecture=family.architecture,
            model_type=family.model_type,
            hidden_size=hidden,
            intermediate_size=hf.positive_int("intermediate_size"),
            num_layers=hf.positive_int("num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_size=hf.positive_int("head_dim", hidden // num_heads),
            vocab_size=hf.positive_int("vocab_size"),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=hf.flag("tie_word_embeddings"),
            attention_bias=False,
            attention_out_bias=False,
            mlp_bias=False,
            eos_token_ids=eos,
            bos_token_id=hf.get("bos_token_id"),
            sliding_window=None,
            sliding_window_layers=(),
            checkpoint_dtype=str(hf.get("dtype") or hf.get("torch_dtype") or "float32"),
            hidden_act=hf.get("hidden_act", "silu"),
        )
        if part.wrapper is not None:
            cfg["checkpoint_architecture"] = part.wrapper.architecture
            cfg["image_token_id"] = part.image_token_id
        family.parse(hf, cfg)
        if isinstance(cfg.get("moe"), dict):
            cfg["moe"] = _moe_config(cfg["moe"], cfg["num_layers"])
        if cfg["hidden_act"] not in _ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {cfg['hidden_act']!r} for {family.architecture}; "
                             f"supported: {_ACTIVATIONS}")
        hf.check_all_read()
        return cls(**cfg, fingerprint=_fingerprint(cfg, weights_identity), path=path)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["path"] = str(self.path) if self.path else None
        return d


_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


def _moe_config(args: dict[str, Any], num_layers: int) -> MoEConfig:
    """Returns the MoEConfig a family hook described; ValueError for inconsistent sizes."""
    moe = MoEConfig(**args)
    if not 0 < moe.top_k <= moe.num_experts:
        raise ValueError(f"config.json: num_experts_per_tok {moe.top_k} must be in 1..{moe.num_experts} "
                         "(the number of experts)")
    if any(not 0 <= i < num_layers for i in moe.layers):
        raise ValueError(f"config.json: sparse layers {moe.layers} outside 0..{num_layers - 1}")
    return moe


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
            stat = tok_json.stat()
            tid = _token_id(tok_json, stat.st_mtime_ns, stat.st_size, eos)
            if tid is not None:
                ids.add(tid)
    return sorted(ids)


@functools.lru_cache(maxsize=16)
def _token_id(tok_json: Path, mtime_ns: int, size: int, token: str) -> int | None:
    """Returns `token`'s id in tokenizer.json (an added token's, else the vocabulary's), or
    None. Cached by the file's mtime and size: parsing the file is most of a config's read, and
    a process builds engines for one checkpoint many times."""
    tok = json.loads(tok_json.read_text())
    added = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
    vocab = (tok.get("model") or {}).get("vocab")
    if token in added:
        return int(added[token])
    if isinstance(vocab, dict) and token in vocab:
        return int(vocab[token])
    return None


def weights_identity(path: Path) -> str:
    """SHA-256 hex over the checkpoint's safetensors files, and the GGUF file it was converted
    from if any (see module docstring)."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors weights found")
    h = hashlib.sha256()
    source = path / GGUF_SOURCE
    if source.is_file():
        h.update(b"gguf\0" + str(json.loads(source.read_text())["sha256"]).encode() + b"\0")
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


# The features added after the first fingerprints: named in the id only when they differ from
# their default (the Llama computation), so existing models keep their ids and stored chunks.
_FEATURE_DEFAULTS = {f.name: f.default for f in fields(ModelConfig)
                     if f.name not in ("path", "checkpoint_architecture", "image_token_id")
                     and f.default is not MISSING}


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
    for k, default in _FEATURE_DEFAULTS.items():
        v = cfg.get(k, default)
        if v != default:
            ident[k] = asdict(v) if isinstance(v, MoEConfig) else v
    for k, v in ident.items():  # floats through repr so 1e5 and 100000.0 hash alike
        if isinstance(v, float) and math.isfinite(v):
            ident[k] = repr(v)
    ident["weights"] = weights_id
    blob = json.dumps(ident, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]
