"""Engine configuration: one validated dataclass whose fields carry their help (the CLI's
flags are built from it); every error names the offending key. Each field is declared with
`kvsettings.opt`, the one mechanism every config uses; its flag spelling is read by
kvtier/engine_args.py.

Only the standard library is imported here: the CLI reads this table on start-up."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from kvsettings import opt

_DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "float16", "bfloat16")
KERNELS = ("auto", "torch")


@dataclass
class EngineConfig:
    """Everything `LLM(...)` accepts besides the connector object; each field's metadata says
    what it means (one row per setting, shared by the CLI flags and their help).

    `num_gpu_blocks` fixes the KV pool size; otherwise it is derived from
    `kv_cache_memory_bytes` or, when that is None too, from `gpu_memory_utilization` of the
    free CUDA memory (CUDA) or a 1 GiB budget (CPU). `max_model_len` None means the model's
    `max_position_embeddings`.
    """

    model: str | None = field(default=None, metadata=opt(
        "local Hugging Face checkpoint dir or GGUF file (default: the bundled SmolLM2-135M-Instruct)", "PATH"))
    device: str = field(default="auto", metadata=opt(
        "auto (CUDA when available), cpu, cuda or cuda:N", "DEVICE"))
    dtype: str = field(default="auto", metadata=opt(
        "weights and KV dtype (default: auto = float32 on CPU, the checkpoint's on CUDA)", choices=DTYPES))
    block_size: int = field(default=16, metadata=opt("tokens per KV block", "N"))
    num_gpu_blocks: int | None = field(default=None, metadata=opt(
        "KV pool size in blocks (default: from --gpu-memory-utilization on CUDA, 1 GiB on CPU)", "N"))
    kv_cache_memory_bytes: int | None = field(default=None, metadata=opt(
        "KV pool size in bytes, when --num-gpu-blocks is not given", "N"))
    gpu_memory_utilization: float = field(default=0.5, metadata=opt(
        "fraction of free CUDA memory for the KV pool", "X"))
    max_model_len: int | None = field(default=None, metadata=opt(
        "longest prompt + output in tokens (default: the model's limit)", "N"))
    kernels: str = field(default="auto", metadata=opt(
        "auto: on CPU, linear layers on packed weights (kvtier's panel kernel in float32, oneDNN "
        "otherwise) and attention read in place from the KV blocks by compiled kernels (built "
        "once); torch: PyTorch's own ops only, "
        "the reference path (the only one on CUDA)", choices=KERNELS))
    max_num_seqs: int = field(default=64, metadata=opt("most requests in one batch", "N"))
    max_num_batched_tokens: int = field(default=2048, metadata=opt(
        "token budget of one step; longer prefills are chunked", "N"))
    enable_prefix_caching: bool = field(default=True, metadata=opt(
        "turn off the engine's automatic prefix caching (default: prefix caching on)", flag="--no-prefix-caching"))
    # Not a CLI flag: `kvtier generate --seed` is the requests' own sampling seed.
    seed: int = field(default=0, metadata=opt("seeds the sampling of requests that bring no seed", "N", flag=None))

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Returns a config from keyword arguments; unknown keys are a ValueError naming them."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine option(s): {', '.join(unknown)}")
        return cls(**kwargs)

    def validate(self) -> None:
        """Raises ValueError naming the first invalid key."""
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"model must be a path string or None, got {self.model!r}")
        _positive_int("block_size", self.block_size)
        if self.num_gpu_blocks is not None:
            _positive_int("num_gpu_blocks", self.num_gpu_blocks)
        if self.kv_cache_memory_bytes is not None:
            _positive_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes)
        if (
            isinstance(self.gpu_memory_utilization, bool)
            or not isinstance(self.gpu_memory_utilization, (int, float))
            or not 0.0 < self.gpu_memory_utilization <= 1.0
        ):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}")
        if self.device not in _DEVICES and not (isinstance(self.device, str) and self.device.startswith("cuda:")):
            raise ValueError(f"device must be one of {_DEVICES} or 'cuda:N', got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {KERNELS}, got {self.kernels!r}")
        if self.max_model_len is not None:
            _positive_int("max_model_len", self.max_model_len)
        _positive_int("max_num_seqs", self.max_num_seqs)
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")


def _positive_int(key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key} must be a positive int, got {value!r}")
