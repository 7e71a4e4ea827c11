"""Loading a checkpoint dir (safetensors, single or sharded) into our model, plus the
device/dtype resolution the rest of the engine shares."""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine import cpu_ops
from engine.engine_config import KERNELS
from engine.linear_backend import linear_packer
from engine.model_config import ModelConfig
from engine.models import get_model_class
from engine.models.base import CausalLM
from engine.models.multimodal import checkpoint_names
from engine.progress import progress_bar
from engine.tokenizer import Tokenizer, names_plain_backend, read_tokenizer_configs

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """Returns a concrete device: "auto" is CUDA when available, else CPU. ValueError for a
    device that is unknown or not present."""
    if isinstance(device, torch.device):
        device = str(device)
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"unknown device {device!r}") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {device!r}; use 'auto', 'cpu' or 'cuda[:N]'")
    return dev


def resolve_dtype(dtype: str | torch.dtype = "auto", device: torch.device | None = None) -> torch.dtype:
    """Returns a torch dtype: "auto" is float32 on CPU, bfloat16 on CUDA when supported else
    float16. ValueError for an unknown name."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; use float32, float16 or bfloat16")
        return dtype
    if dtype == "auto":
        if device is None or device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    try:
        return _DTYPES[str(dtype).removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use auto, float32, float16 or bfloat16") from None


def resolve_model_path(model: str | Path | None) -> Path:
    """Returns the checkpoint dir: None means the default model, a `.gguf` file its conversion
    (engine/gguf_checkpoint.py; both converted on first use)."""
    if model is None:
        from engine.default_model import ensure_default_model  # only when actually needed
        return ensure_default_model()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        from engine.gguf_checkpoint import gguf_checkpoint
        return gguf_checkpoint(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"model {str(model)!r} is not a local Hugging Face checkpoint dir or GGUF file "
                         "(expected config.json or a .gguf file; nothing is fetched from a hub)")
    return path


def _safetensors_files(path: Path) -> list[str]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no safetensors weights")
    return files


def iter_safetensors(path: Path, progress: bool | None = False,
                     rename: Callable[[str], str | None] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (name, tensor) for every tensor of the checkpoint, on CPU, one at a time; with
    `progress` (None: engine/progress.py's rule) a bar counts the checkpoint's bytes. With
    `rename`, each tensor is yielded under `rename(name)`, and one it maps to None is never
    read (a multimodal checkpoint's vision tower)."""
    files = _safetensors_files(path)
    total = sum((path / f).stat().st_size for f in files)
    with progress_bar(total, f"loading {path.name}", "B", enabled=progress) as bar:
        for fname in files:
            read = 0
            with safe_open(path / fname, framework="pt", device="cpu") as f:
                for name in f.keys():
                    target = name if rename is None else rename(name)
                    if target is None:
                        continue
                    tensor = f.get_tensor(name)
                    size = tensor.numel() * tensor.element_size()
                    read += size
                    bar.update(size)
                    yield target, tensor
            bar.update((path / fname).stat().st_size - read)  # its header and what was skipped


def load_model(model: str | Path | None, device: torch.device, dtype: torch.dtype,
               kernels: str = "auto") -> tuple[CausalLM, ModelConfig]:
    """Returns (model in eval mode on `device` in `dtype`, its ModelConfig). Every parameter
    comes from the checkpoint (ValueError if any is missing or misshapen). With `kernels`
    "auto", its linears run packed (kvtier's panel kernel, else oneDNN) and its decode
    attention, RoPE, norms and MLP activation on the compiled CPU kernels where each can
    (engine/linear_backend.py, engine/cpu_ops.py);
    "torch": PyTorch ops only."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {KERNELS}, got {kernels!r}")
    path = resolve_model_path(model)
    config = ModelConfig.from_pretrained(path)
    cls = get_model_class(config.architecture)
    with torch.device("meta"):  # skip random init: every weight is overwritten below
        net: CausalLM = cls(config)
    # to_empty() would do this with empty_like, which on meta tensors runs torch._refs and
    # imports sympy (~0.4 s of every engine start); every parameter is contiguous.
    net = net.to(dtype)._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    net.load_weights(iter_safetensors(path, progress=None, rename=checkpoint_names(config.checkpoint_architecture)))
    net = net.eval().requires_grad_(False)
    if kernels == "auto":
        ops = cpu_ops.load() if device.type == "cpu" else None
        packer = linear_packer(device, dtype, ops)
        if packer is not None:
            net.pack_linears(packer)
        if ops is not None:
            net.enable_cpu_ops(ops)
    return net, config


def load_tokenizer(path: str | Path) -> Any:
    """Returns the checkpoint's tokenizer (local files only): kvtier's `tokenizers`-only
    Tokenizer where transformers' would be the plain tokenizer.json (the same ids, text and chat
    prompts without importing transformers: engine/tokenizer.py), else what AutoTokenizer returns."""
    plain = _plain_tokenizer(str(path), _tokenizer_files_stamp(Path(path)))
    if plain is not None:
        return plain
    if _is_plain_tokenizers_backend(Path(path)):
        from transformers import TokenizersBackend

        return TokenizersBackend.from_pretrained(str(path), local_files_only=True)
    from transformers import AutoTokenizer  # imports transformers.models (see tokenizer_mapped_model_types)

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


@functools.lru_cache(maxsize=8)
def _plain_tokenizer(path: str, stamp: tuple[tuple[str, int, int], ...]) -> Tokenizer | None:
    """Returns `Tokenizer.from_pretrained(path)`, one per process while the files in `stamp`
    are unchanged (a Tokenizer is immutable; a process builds engines for one checkpoint often)."""
    return Tokenizer.from_pretrained(path, tokenizer_mapped_model_types())


def _tokenizer_files_stamp(path: Path) -> tuple[tuple[str, int, int], ...]:
    """Returns (name, mtime_ns, size) of each file in `path` a tokenizer is read from."""
    try:
        entries = [e for e in os.scandir(path)
                   if e.name == "config.json" or e.name.startswith(("tokenizer", "chat_template", "additional_chat"))]
        return tuple(sorted((e.name, (st := e.stat()).st_mtime_ns, st.st_size) for e in entries))
    except OSError:
        return ()


def _is_plain_tokenizers_backend(path: Path) -> bool:
    """Returns whether AutoTokenizer would load `path` as a TokenizersBackend without needing
    the model's config: tokenizer_config.json names that class, no remote code is declared,
    and transformers maps the model_type to no tokenizer class of its own (the default model,
    Llama). AutoTokenizer first builds the config object, and importing the model's config
    class pulls in torch.distributed and sympy (~1 s of every engine start)."""
    try:
        from transformers import TokenizersBackend  # noqa: F401  (transformers >= 5 only)
    except ImportError:
        return False
    configs = read_tokenizer_configs(path)  # None: AutoTokenizer decides, and reports what is wrong
    return configs is not None and names_plain_backend(*configs, tokenizer_mapped_model_types())


@functools.lru_cache(maxsize=1)
def tokenizer_mapped_model_types() -> frozenset[str]:
    """Returns the model types transformers' AutoTokenizer maps to a tokenizer class of their
    own (`TOKENIZER_MAPPING_NAMES`' keys), read from its source without importing
    `transformers.models`: that import scans every model file (a large part of each process
    start), or even transformers itself. Any other shape of that source: the imported mapping's keys."""
    spec = importlib.util.find_spec("transformers")
    keys = None
    if spec is not None and spec.origin is not None:
        source = Path(spec.origin).parent / "models" / "auto" / "tokenization_auto.py"
        try:
            keys = _mapping_keys(ast.parse(source.read_text()))
        except (OSError, SyntaxError, ValueError):
            pass
    if keys is None:
        from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

        return frozenset(TOKENIZER_MAPPING_NAMES)
    return keys


def _mapping_keys(tree: ast.Module) -> frozenset[str] | None:
    """Returns the keys `TOKENIZER_MAPPING_NAMES` gets in tokenization_auto.py: its literal
    list's first items and `MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS` (added to it by a loop);
    None unless both are found as literals."""
    listed: set[str] | None = None
    added: set[str] | None = None
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        else:
            continue
        if not isinstance(target, ast.Name):
            continue
        name = target.id
        if name == "TOKENIZER_MAPPING_NAMES" and isinstance(value, ast.Call) and value.args:
            pairs = value.args[0]
            if isinstance(pairs, ast.List):
                firsts = [e.elts[0] if isinstance(e, ast.Tuple) and e.elts else None for e in pairs.elts]
                keys = [f.value for f in firsts if isinstance(f, ast.Constant) and isinstance(f.value, str)]
                listed = set(keys) if keys and len(keys) == len(firsts) else None
        elif name == "MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS" and isinstance(value, ast.Set):
            consts = [e.value for e in value.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            added = set(consts) if len(consts) == len(value.elts) else None
    return None if listed is None or added is None else frozenset(listed | added)
