"""Copying a checkpoint's tensors into a model whose parameters may be fused or stacked.

A checkpoint tensor lands in a `Target`: a parameter, optionally one expert's slice of a
stacked expert parameter (dim 0), optionally one shard of a fused parameter (q/k/v in
`qkv_proj`, gate/up in `gate_up_proj`, along the output dim). A tensor naming the whole
parameter (Phi-3's fused `qkv_proj`, transformers 5's stacked experts) fills every slice at
once. Every (parameter, expert, shard) must be filled exactly by the end.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Target:
    param: str
    expert: int | None = None  # index along dim 0 of a stacked expert parameter
    shard: int | None = None  # which of the fused parameter's shards (see `shard_sizes`)


Slot = tuple[str, int | None, int | None]


def load_into(params: dict[str, torch.Tensor], weights: Iterable[tuple[str, torch.Tensor]],
              target: Callable[[str], Target | None], shard_sizes: Callable[[str], list[int] | None],
              num_experts: Callable[[str], int | None], architecture: str) -> None:
    """Copies each checkpoint tensor into `params` where `target(name)` says (None: the name is
    skipped on purpose). `shard_sizes(param)` gives a fused parameter's shard sizes, and
    `num_experts(param)` a stacked one's expert count (None for neither). Raises ValueError on
    a name with no place, a shape mismatch, or any slot left unloaded."""
    def slots(param: str, expert: int | None, shard: int | None) -> set[Slot]:
        sizes, n = shard_sizes(param), num_experts(param)
        experts = [expert] if expert is not None else (list(range(n)) if n else [None])
        shards = [shard] if shard is not None else (list(range(len(sizes))) if sizes else [None])
        return {(param, e, s) for e in experts for s in shards}

    expected: set[Slot] = set()
    for n in params:
        expected |= slots(n, None, None)
    loaded: set[Slot] = set()
    for name, tensor in weights:
        t = target(name)
        if t is None:
            continue
        param = params.get(t.param)
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r} has no place in {architecture}")
        dst = param if t.expert is None else param[t.expert]
        if t.shard is not None:
            sizes = shard_sizes(t.param)
            if sizes is None:
                raise ValueError(f"checkpoint tensor {name!r}: {t.param!r} is not a fused parameter")
            dst = dst.narrow(0, sum(sizes[:t.shard]), sizes[t.shard])
        if tensor.shape != dst.shape:
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(dst.shape)}")
        with torch.no_grad():
            dst.copy_(tensor)
        loaded |= slots(t.param, t.expert, t.shard)
    missing = sorted({n for n, _, _ in expected - loaded})
    if missing:
        raise ValueError(f"checkpoint is missing weights for {missing[:8]}")
