"""Paged KV cache writes and attention over block tables, in plain PyTorch SDPA.

Cache layout per layer: `(2, num_blocks, block_size, num_kv_heads, head_size)` (NHD); token
at logical position p of a sequence lives in slot `block_table[p // bs] * bs + p % bs`.

`build_plan` turns one step's `AttentionMetadata` into device tensors once per forward; every
layer then reuses it. With engine/cpu_ops.py's compiled kernels (CPU, float32), a prefill the
window does not bite (fresh, or 8+ new tokens over cached context) is read in place from the
blocks by the tiled prefill kernel. Otherwise three paths, chosen per sequence:
- fresh prefill (no cached context): causal SDPA over the new k/v directly, no gather;
- prefill with cached context: gather its blocks (one `index_select`); when the context is
  at most half of 1k+ new tokens, front-pad the queries with `context_len` zero rows so SDPA's
  top-left causal alignment becomes the bottom-right one we need and the flash kernel runs
  (an explicit mask forces the slow math path); otherwise, with engine/cpu_ops.py's compiled
  kernel (CPU), each new token is a query row of the decode kernel below, else an explicit
  causal mask offset by the context length;
- decode (query_len 1): with the compiled kernel, read in place from the blocks (a prefix
  that 8+ consecutive rows share is attended once for all of them, engine/cascade_attention.py);
  otherwise all such sequences in ONE SDPA call, gathered and padded to the longest context
  with a key mask.

Sliding window W (Mistral, Qwen2's sliding layers; transformers' convention): the query at
position i attends keys j with i - W < j <= i. A plan is built per distinct window, and a
sequence no longer than W takes exactly the paths above (the window cannot bite). A longer
prefill (fresh or over cached context) becomes query tiles, each gathering only the blocks
from its first query's window start, with a causal-and-window mask; a longer decode reads
only its last W keys. Blocks that fell out of the window are NOT freed: the block manager
and the prefix cache stay window-agnostic (a cached prefix must hold every block to be
reusable by a longer prompt), attention just never reads them.

Soft-capped scores (Gemma 2's `cap * tanh(scale * q.k / cap)`): SDPA cannot cap, so every
path above keeps its keys and masks but computes the scores explicitly
(engine/softcap_attention.py); the compiled kernels cap their own scores.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from engine.attention_metadata import AttentionMetadata
from engine.cascade_attention import SharedPrefixes, find_shared_prefixes, shared_prefix_attention
from engine.cpu_ops import paged_decode_attention, paged_prefill_attention
from engine.softcap_attention import capped_decode, capped_prefill


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Stores `k`, `v` `[T, Hkv, D]` at flat `slot_mapping` `[T]` slots of `kv_cache` in place."""
    flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])
    flat[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def gather_kv(kv_cache: torch.Tensor, block_ids: torch.Tensor, num_tokens: int,
              out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns the first `num_tokens` K and V `[num_tokens, Hkv, D]` of the sequence whose
    blocks are `block_ids` (a copy, into `out` `(2, n, bs, Hkv, D)` when given; the cache is
    not modified)."""
    blocks = torch.index_select(kv_cache, 1, block_ids, out=out) if out is not None \
        else kv_cache.index_select(1, block_ids)  # (2, n, bs, H, D)
    kv = blocks.flatten(1, 2)[:, :num_tokens]
    return kv[0], kv[1]


@dataclass
class _Prefill:
    start: int
    end: int
    # Cached-context prefills and window tiles only: the block ids to gather, and either `pad`
    # (front-pad the queries with that many zero rows and run causal SDPA) or an additive
    # mask [q_len, seq_len] over the gathered keys (causal: query i sees keys 0..context_len
    # + i; window tile: also none at or before i - W).
    block_ids: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    seq_len: int = 0  # keys gathered: the first seq_len tokens of `block_ids`' blocks
    pad: int = 0
    # `mask` tiled for the query heads folded per kv head; made by the first layer, reused.
    folded_mask: torch.Tensor | None = None
    # The gathered context, allocated by the first layer and refilled by the others: a fresh
    # multi-MB tensor per layer costs page faults that took longer than the copy itself.
    kv_buf: torch.Tensor | None = None


@dataclass
class AttentionPlan:
    """Per-step tensors derived from AttentionMetadata, shared by every layer."""

    num_tokens: int
    prefills: list[_Prefill]
    # Decode group: flat-batch rows (a slice when contiguous), the cache slot of every key
    # position `[B * max_len]` (padding repeats the sequence's first slot, so padded keys are
    # finite: masked garbage could be NaN, and 0 * NaN poisons the output), additive key mask
    # `[B, 1, 1, max_len]`.
    decode_rows: torch.Tensor | slice | None = None
    decode_slots: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None
    decode_batch: int = 0
    decode_len: int = 0
    decode_buf: torch.Tensor | None = None  # the decode keys' K/V, refilled by every layer
    # The compiled kernel's inputs instead (then no slots, mask nor buffer): its module, and per
    # row (a decode, or a new token of a prefill over cached context) its sequence's block
    # table row and the range of positions it attends over.
    decode_ops: ModuleType | None = None
    decode_tables: torch.Tensor | None = None
    decode_starts: torch.Tensor | None = None
    decode_lens: torch.Tensor | None = None
    decode_shared: SharedPrefixes | None = None  # prefixes rows share, attended once (cascade)
    # Prefills the compiled prefill kernel answers (then not in `prefills`): its module, and
    # per prefill its block table row, first flat row, new tokens and cached context.
    tiled_ops: ModuleType | None = None
    tiled_tables: torch.Tensor | None = None
    tiled_starts: torch.Tensor | None = None
    tiled_lens: torch.Tensor | None = None
    tiled_ctx: torch.Tensor | None = None


def build_plan(meta: AttentionMetadata, device: torch.device,
               dtype: torch.dtype = torch.float32,
               sliding_window: int | None = None,
               cpu_ops: ModuleType | None = None) -> AttentionPlan:
    """Returns the plan for one step (masks in `dtype`, the model's) of layers attending over
    `sliding_window` keys (None: full causal attention); decodes and most prefills use
    `cpu_ops`' kernels when given and the device is a CPU. Raises ValueError if the metadata
    is inconsistent, before anything is written to the cache."""
    qsl, seq_lens, bs = meta.query_start_loc, meta.seq_lens, meta.block_size
    if len(qsl) != len(seq_lens) + 1:
        raise ValueError(f"query_start_loc has {len(qsl)} entries for {len(seq_lens)} sequences")
    plan = AttentionPlan(num_tokens=qsl[-1], prefills=[])
    if meta.slot_mapping.shape[0] != plan.num_tokens:
        raise ValueError(f"slot_mapping has {meta.slot_mapping.shape[0]} entries for "
                         f"{plan.num_tokens} tokens")
    if seq_lens and max(seq_lens) > meta.block_tables.shape[1] * bs:
        raise ValueError(f"block_tables has {meta.block_tables.shape[1]} blocks per sequence, "
                         f"too few for seq_len {max(seq_lens)} at block_size {bs}")
    kernel = cpu_ops is not None and device.type == "cpu"
    # Float32 prefills the window does not bite go through the tiled prefill kernel, faster
    # than the flash SDPA on a fresh prompt and than the decode kernel's rows from 8 new tokens
    # over cached context; the decode kernel's rows keep fewer (docs/results.md).
    tiled_kernel = kernel and dtype == torch.float32
    tiled: list[tuple[int, int, int, int]] = []  # (sequence, first row, new tokens, context)
    # Rows attended one query at a time over their sequence's blocks: every decode, and with
    # the compiled kernel every prefill over cached context the tiled kernel does not take
    # (bf16, windowed, or fewer than 8 new tokens) but the padded one: faster than the masked
    # SDPA over shared cached keys, equal when each sequence has its own context.
    row_seqs: list[int] = []  # each row's sequence
    rows: list[int] = []  # its flat row
    lens: list[int] = []  # the keys it sees: its position + 1
    for i, seq_len in enumerate(seq_lens):
        start, end = qsl[i], qsl[i + 1]
        q_len = end - start
        ctx = seq_len - q_len
        if q_len <= 0 or ctx < 0:
            raise ValueError(f"sequence {i}: query_len {q_len} and seq_len {seq_len} are inconsistent")
        windowed = sliding_window is not None and seq_len > sliding_window
        padded = q_len >= _PAD_MIN_QUERY and 2 * ctx <= q_len and not windowed
        if tiled_kernel and q_len >= (2 if ctx == 0 else _TILED_MIN_QUERY) and not windowed:
            tiled.append((i, start, q_len, ctx))
        elif ctx > 0 and (q_len == 1 or (kernel and not padded)):
            row_seqs += [i] * q_len
            rows += range(start, end)
            lens += range(ctx + 1, seq_len + 1)
        elif windowed:
            assert sliding_window is not None  # windowed implies a window (for the type checker)
            plan.prefills += _window_tiles(meta.block_tables[i], start, ctx, seq_len,
                                           sliding_window, bs, device, dtype)
        elif ctx == 0:
            plan.prefills.append(_Prefill(start, end))
        else:
            n_blocks = -(-seq_len // bs)
            block_ids = meta.block_tables[i, :n_blocks].to(device)
            if padded:
                plan.prefills.append(_Prefill(start, end, block_ids, None, seq_len, pad=ctx))
                continue
            q_pos = torch.arange(ctx, seq_len, device=device).unsqueeze(1)
            future = torch.arange(seq_len, device=device).unsqueeze(0) > q_pos
            mask = _additive(future, dtype)
            plan.prefills.append(_Prefill(start, end, block_ids, mask, seq_len))
    if tiled:
        seqs = torch.tensor([t[0] for t in tiled], device=meta.block_tables.device)
        plan.tiled_ops = cpu_ops
        plan.tiled_tables = meta.block_tables.index_select(0, seqs).contiguous()
        plan.tiled_starts, plan.tiled_lens, plan.tiled_ctx = (torch.tensor(col) for col in list(zip(*tiled))[1:])
    if rows:
        contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
        plan.decode_rows = (slice(rows[0], rows[0] + len(rows)) if contiguous
                            else torch.tensor(rows, device=device))
        idx = torch.tensor(row_seqs, device=meta.block_tables.device)
        plan.decode_batch = len(rows)
        if kernel:
            plan.decode_ops = cpu_ops
            plan.decode_tables = meta.block_tables.index_select(0, idx).contiguous()
            plan.decode_lens = torch.tensor(lens)
            starts = [0 if sliding_window is None else max(0, n - sliding_window) for n in lens]
            if sliding_window is None and dtype == torch.float32:  # the prefix kernel's case
                plan.decode_shared, starts = find_shared_prefixes(plan.decode_tables, lens, bs)
            plan.decode_starts = torch.tensor(starts)
            return plan
        if sliding_window is not None and max(lens) > sliding_window:
            slots, valid = _window_decode_slots(meta.block_tables.index_select(0, idx), lens,
                                                sliding_window, bs, device)
        else:
            max_blocks = -(-max(lens) // bs)
            n = max(lens)
            tables = meta.block_tables.index_select(0, idx)[:, :max_blocks].to(device)
            offsets = torch.arange(bs, device=device)
            slots = (tables.unsqueeze(-1) * bs + offsets).flatten(1)[:, :n]  # [B, n]
            valid = torch.arange(n, device=device) < torch.tensor(lens, device=device).unsqueeze(1)
            slots = torch.where(valid, slots, slots[:, :1])
        n = slots.shape[1]
        plan.decode_slots = slots.reshape(-1)
        plan.decode_len = n
        plan.decode_mask = _additive(~valid, dtype).view(len(lens), 1, 1, n)
    return plan


# New tokens over cached context from which the tiled prefill kernel beats the decode kernel's
# rows (docs/results.md, "Measurements behind the code's choices").
_TILED_MIN_QUERY = 8


# Padding wastes ~context_len**2 / 2 of attention work; the masked path materialises the
# [q_len, seq_len] scores. On CPU padding wins from about 1k new tokens with context <= half
# of them, the mask below that and when context >= new tokens (docs/results.md).
_PAD_MIN_QUERY = 1024


# Query rows per tile of a windowed prefill: a tile costs rows x (rows + window) scores, so
# small tiles approach the q_len x window minimum, at one SDPA call per tile and layer.
_WINDOW_TILE = 512


def _window_tiles(table: torch.Tensor, start: int, ctx: int, seq_len: int, window: int,
                  bs: int, device: torch.device, dtype: torch.dtype) -> list[_Prefill]:
    """Returns the prefill of positions `ctx..seq_len - 1` (flat rows from `start`; their K/V
    already in the blocks of `table`) under a sliding `window`, as query tiles of at most
    `_WINDOW_TILE` rows. A tile gathers the blocks from the one holding its first query's
    window start (a block-aligned key range) and masks every key outside i - W < j <= i."""
    tiles = []
    for a in range(ctx, seq_len, _WINDOW_TILE):
        b = min(a + _WINDOW_TILE, seq_len)
        first_block = max(0, a - window + 1) // bs
        key0 = first_block * bs
        q_pos = torch.arange(a, b, device=device).unsqueeze(1)
        k_pos = torch.arange(key0, b, device=device).unsqueeze(0)
        blocked = (k_pos > q_pos) | (k_pos <= q_pos - window)
        block_ids = table[first_block:-(-b // bs)].to(device)
        tiles.append(_Prefill(start + a - ctx, start + b - ctx, block_ids,
                              _additive(blocked, dtype), seq_len=b - key0))
    return tiles


def _window_decode_slots(tables: torch.Tensor, lens: list[int], window: int, bs: int,
                         device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (slots `[B, n]`, valid `[B, n]`) of the keys the decode queries at positions
    `lens[b] - 1` see under a sliding `window`: only the last min(len, window) positions, so
    nothing before the window is read. Padding repeats the first slot (finite, masked)."""
    tables = tables.to(device)
    seq_lens = torch.tensor(lens, device=device).unsqueeze(1)
    first = (seq_lens - window).clamp(min=0)
    n = min(max(lens), window)
    pos = first + torch.arange(n, device=device)
    valid = pos < seq_lens
    pos = torch.where(valid, pos, first)
    return tables.gather(1, pos // bs) * bs + pos % bs, valid


def _additive(blocked: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Returns a 0 / -inf mask of `dtype`; built once per step, since SDPA would convert a
    bool mask again in every layer."""
    zeros = torch.zeros(blocked.shape, dtype=dtype, device=blocked.device)
    return zeros.masked_fill(blocked, float("-inf"))


def sdpa_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
             mask: torch.Tensor | None = None, causal: bool = False) -> torch.Tensor:
    """Returns the attention output of `q` `[(B,) Hq, Lq, D]` over `k`/`v` `[(B,) Hkv, Lk, D]`,
    shaped like `q`, where Hq is a multiple of Hkv (GQA). `mask` (bool, True = attend; or
    additive) and `causal` mean what they mean in `F.scaled_dot_product_attention`."""
    if q.dim() == 3:  # the CPU flash kernel needs a batch dim (3-D falls back to math)
        return sdpa_gqa(q[None], k[None], v[None], scale, mask, causal)[0]
    groups = q.shape[-3] // k.shape[-3]
    if groups > 1:
        # On CPU expanding kv heads beats enable_gqa=True (docs/results.md).
        k = k.repeat_interleave(groups, dim=-3)
        v = v.repeat_interleave(groups, dim=-3)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    kv_cache: torch.Tensor, plan: AttentionPlan, scale: float,
                    softcap: float | None = None) -> torch.Tensor:
    """Attention of the step's new tokens over their full context: softmax of `scale * q.k`
    (capped to `softcap * tanh(scale * q.k / softcap)` when `softcap` is given) times v.

    `q` `[T, Hq, D]`, `k`/`v` `[T, Hkv, D]` (already written to `kv_cache`). Returns `[T, Hq, D]`.
    """
    only_fresh = (not plan.decode_batch and plan.tiled_ops is None and len(plan.prefills) == 1
                  and plan.prefills[0].block_ids is None)
    if only_fresh and softcap is None:  # the common single-prompt prefill: no output copy
        return sdpa_gqa(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale,
                        causal=True).transpose(0, 1)
    out = torch.empty_like(q)
    if plan.tiled_ops is not None:
        assert plan.tiled_tables is not None and plan.tiled_starts is not None
        assert plan.tiled_lens is not None and plan.tiled_ctx is not None
        paged_prefill_attention(plan.tiled_ops, q, kv_cache, plan.tiled_tables, plan.tiled_starts,
                                plan.tiled_lens, plan.tiled_ctx, scale, softcap, out)
    for p in plan.prefills:
        qs = q[p.start:p.end].transpose(0, 1)
        if p.block_ids is None:
            ks, vs = k[p.start:p.end].transpose(0, 1), v[p.start:p.end].transpose(0, 1)
            o = (sdpa_gqa(qs, ks, vs, scale, causal=True) if softcap is None
                 else capped_prefill(qs, ks, vs, scale, softcap))
        else:
            if p.kv_buf is None:
                p.kv_buf = kv_cache.new_empty((2, p.block_ids.numel(), *kv_cache.shape[2:]))
            ks, vs = gather_kv(kv_cache, p.block_ids, p.seq_len, out=p.kv_buf)
            ks, vs = ks.transpose(0, 1).to(q.dtype), vs.transpose(0, 1).to(q.dtype)
            if softcap is not None:  # the mask (if any) is bottom-right aligned, as it expects
                o = capped_prefill(qs, ks, vs, scale, softcap, p.mask)
            elif p.mask is not None:
                o = _masked_gqa(qs, ks, vs, scale, p)
            else:  # query j of the padded batch is position j: exactly causal over the keys
                padded = torch.cat([qs.new_zeros(qs.shape[0], p.pad, qs.shape[2]), qs], dim=1)
                o = sdpa_gqa(padded, ks, vs, scale, causal=True)[:, p.pad:]
        out[p.start:p.end] = o.transpose(0, 1)
    if plan.decode_batch:
        o = _decode_attention(q[plan.decode_rows], kv_cache, plan, scale, softcap)
        if plan.decode_batch == plan.num_tokens:  # decode-only step: no output copy
            return o
        if isinstance(plan.decode_rows, slice):
            out[plan.decode_rows] = o
        else:
            assert plan.decode_rows is not None  # build_plan sets it with decode_batch
            out.index_copy_(0, plan.decode_rows, o)
    return out


def _masked_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                p: _Prefill) -> torch.Tensor:
    """Masked attention of `q` `[Hq, Lq, D]` over `k`/`v` `[Hkv, L, D]`; returns `[Hq, Lq, D]`.

    The G query heads sharing a kv head become G x Lq query rows of that head (the mask is
    the same for every head), so K/V are never expanded: for a long cached context that
    expansion copied G times the context's K/V in every layer.
    """
    h_kv, (h_q, l_q, d) = k.shape[0], q.shape
    groups = h_q // h_kv
    if p.folded_mask is None:
        assert p.mask is not None  # build_plan gives every masked prefill its mask
        p.folded_mask = p.mask.repeat(groups, 1)
    o = F.scaled_dot_product_attention(q.reshape(1, h_kv, groups * l_q, d), k[None], v[None],
                                       attn_mask=p.folded_mask, scale=scale)
    return o.view(h_q, l_q, d)


def _decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, plan: AttentionPlan,
                      scale: float, softcap: float | None) -> torch.Tensor:
    """One SDPA call for all decode rows `q` `[B, Hq, D]`; returns `[B, Hq, D]`.

    With one query per sequence, the G query heads sharing a kv head can ride along as G
    query "positions" of that kv head (`[B, Hkv, G, D]`): GQA without expanding K/V.
    """
    if plan.decode_ops is not None:
        assert plan.decode_tables is not None and plan.decode_starts is not None and plan.decode_lens is not None
        prior = (None if plan.decode_shared is None else
                 shared_prefix_attention(plan.decode_ops, q, kv_cache, plan.decode_shared, scale, softcap))
        return paged_decode_attention(plan.decode_ops, q.contiguous(), kv_cache, plan.decode_tables,
                                      plan.decode_starts, plan.decode_lens, scale, softcap, prior)
    b, n = plan.decode_batch, plan.decode_len
    h_kv, d = kv_cache.shape[-2:]
    flat = kv_cache.view(2, -1, h_kv, d)
    assert plan.decode_slots is not None  # build_plan sets it with decode_batch
    if plan.decode_buf is None:
        plan.decode_buf = flat.new_empty((2, plan.decode_slots.numel(), h_kv, d))
    kv = torch.index_select(flat, 1, plan.decode_slots, out=plan.decode_buf)
    kv = kv.view(2, b, n, h_kv, d).transpose(2, 3)
    qg = q.reshape(b, h_kv, -1, d)
    ks, vs = kv[0].to(q.dtype), kv[1].to(q.dtype)
    if softcap is not None:
        return capped_decode(qg, ks, vs, scale, softcap, plan.decode_mask).reshape(b, -1, d)
    o = F.scaled_dot_product_attention(qg, ks, vs, attn_mask=plan.decode_mask, scale=scale)
    return o.reshape(b, -1, d)
