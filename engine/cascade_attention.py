"""Decode attention over a prefix that several sequences share (cascade attention).

When consecutive decode rows' block tables begin with the same blocks (requests over one
document, parallel samples of one prompt), the decode kernel would read those K/V once per
row. Instead the shared prefix is attended once for the whole group, by the prefill kernel's
register tiles with the group's rows times query heads as one tile's rows, not causally
(`paged_prefix_attention`, engine/csrc/paged_prefill_attention.cpp), and each row's own keys
after it by the decode kernel, which merges the two softmaxes by their log-sum-exp.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from engine.cpu_ops import paged_prefix_attention

# A group needs this many rows and shared keys before the prefix pays for its own kernel call:
# against each row reading the prefix itself, fewer rows or a shorter prefix did not pay, more
# rows and longer prefixes gain more (benchmarks/bench_kernels.py measures it).
MIN_ROWS = 8
MIN_PREFIX = 1024


@dataclass
class SharedPrefixes:
    """Groups of consecutive decode rows whose first keys are the same blocks: per group its
    first row, its number of rows, the shared key count and a block table row naming them."""

    tables: torch.Tensor  # [groups, max_blocks] int64
    first_rows: torch.Tensor  # [groups]
    num_rows: torch.Tensor  # [groups]
    prefix_lens: torch.Tensor  # [groups]


def find_shared_prefixes(tables: torch.Tensor, lens: list[int],
                         block_size: int) -> tuple[SharedPrefixes | None, list[int]]:
    """Returns the groups of rows sharing a prefix worth attending once (None if there are
    none) and each row's first key of its own: its group's prefix length, else 0. `tables`
    `[B, max_blocks]` are the rows' block tables, `lens` the keys each row attends. A prefix is
    whole blocks and leaves every row at least one key of its own."""
    rows = len(lens)
    starts = [0] * rows
    if rows < MIN_ROWS:
        return None, starts
    # Leading block ids each row has in common with the next one.
    same = (tables[1:] == tables[:-1]).to(torch.int32).cumprod(dim=1).sum(dim=1).tolist()
    min_blocks = -(-MIN_PREFIX // block_size)
    groups: list[tuple[int, int, int]] = []  # (first row, rows, prefix length)
    i = 0
    while i < rows:
        j, blocks = i, tables.shape[1]
        while j + 1 < rows and same[j] >= min_blocks:
            blocks = min(blocks, same[j])
            j += 1
        n = j - i + 1
        prefix = min(blocks * block_size, (min(lens[i:j + 1]) - 1) // block_size * block_size)
        if n >= MIN_ROWS and prefix >= MIN_PREFIX:
            groups.append((i, n, prefix))
            starts[i:j + 1] = [prefix] * n
        i = j + 1
    if not groups:
        return None, starts
    first, num, prefix_lens = (torch.tensor(col) for col in zip(*groups))
    return SharedPrefixes(tables.index_select(0, first).contiguous(), first, num, prefix_lens), starts


def shared_prefix_attention(ops: ModuleType, q: torch.Tensor, kv_cache: torch.Tensor, shared: SharedPrefixes,
                            scale: float, softcap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (output `[B, Hq, D]`, log-sum-exp `[B, Hq]`) of the decode rows `q` `[B, Hq, D]`
    over their groups' shared prefixes (rows in no group: 0, -inf), for the decode kernel to
    merge with each row's own keys."""
    return paged_prefix_attention(ops, q.float(), kv_cache, shared.tables, shared.first_rows, shared.num_rows,
                                  shared.prefix_lens, scale, softcap)
