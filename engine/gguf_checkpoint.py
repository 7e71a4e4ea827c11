"""GGUF files as checkpoints: `--model path.gguf`, `LLM("x.gguf")`, and the bundled default model.

A GGUF is converted once into a Hugging Face checkpoint dir, then loaded like any other:
`config.json` from the file's metadata (engine/gguf_arch.py), `tokenizer.json` and
`tokenizer_config.json` (chat template included) from its `tokenizer.*` keys by transformers'
GGUF tokenizer builders, and the weights renamed to HF names, with llama.cpp's q/k permutation
and Gemma's norm offset undone. F32, F16 and BF16 tensors keep their type; every quantised type
the installed `gguf` package dequantises (Q4_0 ... Q8_0, the K-quants, the IQ types) becomes
float32, which holds the dequantised values exactly. A tensor of any other type is refused by
name before anything is written.

Conversions live under `$KVTIER_HOME/models/gguf/<stem>-<sha256 prefix>-v<converter>`: keyed by
the SHA-256 of the file's bytes, so an edited file converts anew and a copy elsewhere reuses
the conversion. The dir records that hash (`GGUF_SOURCE`), and the model's fingerprint names it
(engine/model_config.py), so a GGUF's chunks are never mixed with another file's, a safetensors
copy of the same model or a different quantisation of it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from engine.gguf_arch import ROPE_FREQS, GGUFArch, arch_for, changes_values, hf_config, hf_name, hf_values
from engine.model_cache import build_once, kvtier_home
from engine.model_config import GGUF_SOURCE

CONVERTER_VERSION = 1
# Bytes of converted weights per safetensors shard: what conversion holds in memory at once.
SHARD_BYTES = 2 << 30
_HASH_BLOCK = 8 << 20


def gguf_checkpoint(path: str | Path, home: Path | None = None, progress: bool | None = None) -> Path:
    """Returns the checkpoint dir converted from the GGUF file at `path`, converting it first
    if this file's bytes never were (one progress bar over its tensors, shown per `progress`,
    default engine/progress.py's rule). ValueError names what makes the file unreadable."""
    src = Path(path).expanduser()
    if not src.is_file():
        raise ValueError(f"GGUF file {str(path)!r} does not exist")
    digest = file_sha256(src)
    final = kvtier_home(home) / "models" / "gguf" / f"{src.stem}-{digest[:16]}-v{CONVERTER_VERSION}"
    return build_once(final, lambda out: convert_gguf(src, out, progress=progress, source_sha256=digest))


def file_sha256(path: Path) -> str:
    """Returns the SHA-256 hex digest of the file's bytes."""
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(_HASH_BLOCK):
            h.update(block)
    return h.hexdigest()


def convert_gguf(src: Path, out: Path, progress: bool | None = None, source_sha256: str | None = None) -> None:
    """Writes the HF checkpoint the GGUF file `src` holds into the new dir `out` (see the module
    docstring); with `source_sha256` the dir records it as the weights' source. Raises
    ValueError naming an unsupported architecture, metadata key, tensor or tensor type."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from engine.progress import progress_bar

    reader = GGUFReader(src)
    fields = {k: _field_value(f) for k, f in reader.fields.items()}
    if int(fields.get("split.count", 1)) > 1:
        raise ValueError(f"{src.name}: a split GGUF ({fields['split.count']} files) cannot be read; "
                         "merge it first (llama-gguf-split --merge)")
    arch = arch_for(fields.get("general.architecture"))
    _check_types(src, reader.tensors)
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}
    freqs = next((dequantize(t.data, t.tensor_type) for t in reader.tensors if t.name == ROPE_FREQS), None)
    cfg = hf_config(arch, fields, shapes, freqs)
    weights = [t for t in reader.tensors if hf_name(arch, t.name) is not None]  # every name before any work
    out.mkdir(parents=True)
    total = sum(int(t.n_bytes) for t in weights)
    with progress_bar(total, f"kvtier: converting {src.name}", "B", enabled=progress) as bar:
        cfg["dtype"] = _write_weights(weights, arch, cfg, out, bar)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    _save_tokenizer(arch, reader.fields, fields, out)
    if source_sha256 is not None:
        record = {"sha256": source_sha256, "file": src.name, "converter": CONVERTER_VERSION}
        (out / GGUF_SOURCE).write_text(json.dumps(record, indent=2) + "\n")


# Reading a whole vocabulary (and merges, scores) into Python is only done for the tokenizer.
_TOKENIZER_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                     "tokenizer.ggml.scores", "tokenizer.ggml.precompiled_charsmap")


def _field_value(field: Any) -> Any:
    """Returns a metadata value as Python (numpy scalars widened exactly), tokenizer arrays
    as their length."""
    if field.name in _TOKENIZER_ARRAYS:
        return len(field.data)
    v = field.contents()
    return v.item() if isinstance(v, np.generic) else v


def _check_types(src: Path, tensors: list[Any]) -> None:
    """Raises ValueError naming the first tensor whose type the installed gguf package cannot
    dequantise (probed once per type on a zero block)."""
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    ok: dict[Any, bool] = {}
    for t in tensors:
        qtype = t.tensor_type
        if qtype not in ok:
            try:
                dequantize(np.zeros((1, GGML_QUANT_SIZES[qtype][1]), np.uint8), qtype)
                ok[qtype] = True
            except (NotImplementedError, KeyError):
                ok[qtype] = False
        if not ok[qtype]:
            raise ValueError(f"{src.name}: tensor {t.name!r} is stored as {qtype.name}, which kvtier cannot "
                             "dequantise (it reads F32, F16, BF16 and the quantised types the gguf package "
                             "dequantises: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K-Q6_K, the IQ and TQ types)")


def _write_weights(tensors: list[Any], arch: GGUFArch, cfg: dict[str, Any], out: Path, bar: Any) -> str:
    """Writes every tensor under its HF name into safetensors shards of at most SHARD_BYTES
    (one `model.safetensors` when they fit, else numbered shards and their index); returns the
    dtype name of the embedding as stored."""
    import torch
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize
    from safetensors.torch import save_file

    floats = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}

    def dtype(t: Any) -> torch.dtype:
        # A float tensor keeps its type unless its values change (a Gemma norm's offset);
        # dequantised values are exact in float32, not in a half type.
        return floats.get(t.tensor_type, torch.float32) if not changes_values(arch, t.name) else torch.float32

    shards: list[list[Any]] = [[]]
    size = 0
    for t in tensors:  # planned up front, so each shard is written once, under its final name
        n = int(np.prod([int(d) for d in t.shape])) * dtype(t).itemsize
        if shards[-1] and size + n > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += n
    files = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map: dict[str, str] = {}
    embedding_dtype = "float32"
    for fname, shard in zip(files, shards):
        state: dict[str, torch.Tensor] = {}
        for t in shard:
            values = hf_values(arch, t.name, dequantize(t.data, t.tensor_type), cfg)
            name = hf_name(arch, t.name)
            assert name is not None  # the caller passes weights only
            state[name] = torch.from_numpy(np.array(values, dtype=np.float32, copy=True)).to(dtype(t))
            weight_map[name] = fname
            if t.name == "token_embd.weight":
                embedding_dtype = str(state[name].dtype).removeprefix("torch.")
            bar.update(int(t.n_bytes))
        save_file(state, str(out / fname), metadata={"format": "pt"})
    if len(files) > 1:
        index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return embedding_dtype


def _save_tokenizer(arch: GGUFArch, reader_fields: dict[str, Any], fields: dict[str, Any], out: Path) -> None:
    """Saves the tokenizer the file's `tokenizer.*` keys describe (tokenizer.json,
    tokenizer_config.json, chat_template.jinja), built as transformers builds it for a GGUF."""
    from transformers import TokenizersBackend
    from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    def value(key: str) -> Any:
        return reader_fields[key].contents() if key in _TOKENIZER_ARRAYS else fields[key]

    groups = {group: {name: value(f"tokenizer.{key}") for key, name in renames.items()
                      if f"tokenizer.{key}" in fields}
              for group, renames in GGUF_TOKENIZER_MAPPING.items()}
    tokenizer, config = groups["tokenizer"], groups["tokenizer_config"]
    if "tokens" not in tokenizer:
        raise ValueError("GGUF file has no tokenizer (tokenizer.ggml.tokens)")
    if tokenizer.get("tokenizer_type") == "llama":
        config.setdefault("add_bos_token", True)  # llama.cpp's default for a sentencepiece vocabulary
    for special in ("bos", "eos", "unk", "pad"):
        key = "padding" if special == "pad" else ("unknown" if special == "unk" else special)
        token_id = fields.get(f"tokenizer.ggml.{key}_token_id")
        config[f"{special}_token"] = tokenizer["tokens"][token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(arch.name, tokenizer)
    TokenizersBackend(tokenizer_object=backend, **config, **extra).save_pretrained(str(out))
