"""Engine configuration: one validated dataclass; every error names the offending key."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

_DEVICES = ("auto", "cpu", "cuda")
_DTYPES = ("auto", "float32", "float16", "bfloat16")


@dataclass
class EngineConfig:
    """Everything `LLM(...)` accepts besides the connector object.

    `num_gpu_blocks` fixes the KV pool size; otherwise it is derived from
    `kv_cache_memory_bytes` or, when that is None too, from `gpu_memory_utilization` of the
    free CUDA memory (CUDA) or a 1 GiB budget (CPU). `max_model_len` None means the model's
    `max_position_embeddings`.
    """

    model: str | None = None
    block_size: int = 16
    num_gpu_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.5
    enable_prefix_caching: bool = True
    device: str = "auto"
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    seed: int = 0

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
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.max_model_len is not None:
            _positive_int("max_model_len", self.max_model_len)
        _positive_int("max_num_seqs", self.max_num_seqs)
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")


def _positive_int(key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key} must be a positive int, got {value!r}")
