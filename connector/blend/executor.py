"""CacheBlend's forward passes, run with the model's own modules one layer at a time.

One implementation of "run layer i for some tokens over a given K/V" (`_layer_qkv`, the
model's own `project_qkv`, then `_layer_attend_mlp`) serves both:
- `compute_segment_kv`: a segment's standalone K/V (its own sequence, no paged cache);
- `blend_recompute`: the selective recompute over K/V already scattered into the paged cache
  (which also computes, in place, the segments that had no stored K/V).

Keys are stored after RoPE, so a segment computed at positions 0..n-1 is moved to its place
in a prompt by `rerotate_kv` (RoPE rotations compose additively).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from engine.kv_cache import request_slots
from engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from engine.paged_attention import gather_kv, sdpa_gqa, write_kv
from engine.rotary import rerotate


def _layer_qkv(layer: LlamaDecoderLayer, h: torch.Tensor,
               positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns q `[T, Hq, D]`, k (after RoPE) and v `[T, Hkv, D]` of decoder `layer` for
    hidden states `h` `[T, hidden]` at `positions` `[T]` (the model's own projection)."""
    return layer.self_attn.project_qkv(layer.input_layernorm(h), positions)


# Query buckets of a subset attention: (first row, end row, keys read, mask [rows, keys]).
Buckets = list[tuple[int, int, int, torch.Tensor]]

_NUM_BUCKETS = 8  # more buckets skip more masked keys, at one SDPA call each


def _causal_buckets(q_positions: torch.Tensor) -> Buckets:
    """Returns query buckets for rows at sorted `q_positions`: each bucket reads keys only up
    to its last position (later keys are masked anyway), so a causal subset costs about half
    of attending to the whole context. Built once per selection, reused by every layer."""
    t = q_positions.numel()
    pos = q_positions.tolist()
    cuts = sorted({round(i * t / _NUM_BUCKETS) for i in range(_NUM_BUCKETS + 1)})
    out: Buckets = []
    for a, b in zip(cuts, cuts[1:]):
        kend = pos[b - 1] + 1
        mask = torch.arange(kend, device=q_positions.device).unsqueeze(0) <= q_positions[a:b].unsqueeze(1)
        out.append((a, b, kend, mask))
    return out


def _layer_attend_mlp(layer: LlamaDecoderLayer, h: torch.Tensor, q: torch.Tensor, keys: torch.Tensor,
                      values: torch.Tensor, buckets: Buckets | None) -> torch.Tensor:
    """Returns the layer's output for queries `q` over `keys`/`values` `[S, Hkv, D]`, causal by
    position: through `buckets` (`_causal_buckets`), or plain causal when None (T == S)."""
    attn = layer.self_attn
    kt, vt = keys.transpose(0, 1).to(q.dtype), values.transpose(0, 1).to(q.dtype)
    if buckets is None:
        o = sdpa_gqa(q.transpose(0, 1), kt, vt, attn.scale, causal=True).transpose(0, 1)
    else:
        o = torch.empty_like(q)
        for a, b, kend, mask in buckets:
            o[a:b] = sdpa_gqa(q[a:b].transpose(0, 1), kt[:, :kend], vt[:, :kend], attn.scale, mask=mask).transpose(0, 1)
    h = h + attn.o_proj(o.reshape(h.shape[0], attn.q_size))
    return h + layer.mlp(layer.post_attention_layernorm(h))


def _model_parts(model: LlamaForCausalLM) -> tuple[LlamaModel, torch.device, torch.dtype]:
    inner = model.model
    w = inner.embed_tokens.weight
    return inner, w.device, w.dtype


@torch.inference_mode()
def compute_segment_kv(model: LlamaForCausalLM, token_ids: Sequence[int] | torch.Tensor,
                       start_position: int = 0) -> torch.Tensor:
    """Returns the K/V `(num_layers, 2, T, Hkv, D)` (model dtype and device) of `token_ids`
    computed as a sequence of their own at positions `start_position..` (keys after RoPE)."""
    inner, dev, dtype = _model_parts(model)
    ids = torch.as_tensor(token_ids, dtype=torch.long, device=dev)
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError(f"token_ids must be a non-empty 1-D sequence, got shape {tuple(ids.shape)}")
    t = ids.numel()
    positions = torch.arange(start_position, start_position + t, device=dev)
    layers = inner.decoder_layers()
    attn0 = layers[0].self_attn
    out = torch.empty((len(layers), 2, t, attn0.num_kv_heads, attn0.head_size), dtype=dtype, device=dev)
    h = inner.embed_tokens(ids)
    last = len(layers) - 1
    for i, layer in enumerate(layers):
        q, k, v = _layer_qkv(layer, h, positions)
        out[i, 0], out[i, 1] = k, v
        if i == last:  # only this layer's K/V is wanted, not its output
            break
        h = _layer_attend_mlp(layer, h, q, k, v, None)
    return out


def rerotate_kv(kv: torch.Tensor, shift: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """Returns a copy of chunk `kv` `(L, 2, T, H, D)` whose keys are moved `shift` positions
    later (values unchanged)."""
    out = kv.clone()
    if shift:
        layers, _two, t, h, d = kv.shape
        keys = kv[:, 0].reshape(layers * t, h, d)
        zero = torch.zeros(layers * t, dtype=torch.long, device=kv.device)
        out[:, 0] = rerotate(keys, zero, zero + shift, inv_freq).view(layers, t, h, d)
    return out


def _num_selected(ratio: float, n: int) -> int:
    # ceil: any ratio > 0 recomputes at least one token, ratio 1 recomputes all of them.
    return min(n, math.ceil(ratio * n - 1e-9))


@torch.inference_mode()
def blend_recompute(model: LlamaForCausalLM, kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int],
                    block_size: int, token_ids: Sequence[int] | torch.Tensor, start: int, end: int,
                    ratio: float, check_layer: int = 1,
                    narrowing: Sequence[tuple[int, float]] = (),
                    missing: torch.Tensor | None = None) -> int:
    """Selectively recomputes positions [start, end) of a request whose paged cache already
    holds exact K/V for [0, start) and cached (re-rotated) K/V for [start, end), except at
    the `missing` positions (bool `[end - start]`), which hold nothing usable.

    Layers up to `check_layer` are recomputed for every token; at `check_layer` (and at each
    `narrowing` layer) the cached tokens whose fresh K/V deviate most from what the cache holds
    are kept (`ratio` of them), and every missing one; past it only those go through the
    layers, attending over the whole context with an exact causal mask, their fresh K/V
    overwriting the cache. `token_ids` are the tokens of [start, end). Returns how many tokens
    reached the last layer; with nothing missing, ratio 0 changes nothing (plain reuse) and
    ratio 1 equals a full prefill; with everything missing, any ratio is a full prefill.
    """
    n = end - start
    if n <= 0:
        return 0
    inner, dev, _dtype = _model_parts(model)
    missing = torch.zeros(n, dtype=torch.bool, device=dev) if missing is None else missing.to(dev)
    if missing.shape != (n,):
        raise ValueError(f"missing has shape {tuple(missing.shape)}, expected ({n},)")
    num_missing = int(missing.sum())
    if _num_selected(ratio, n - num_missing) + num_missing == 0:
        return 0
    ids = torch.as_tensor(token_ids, dtype=torch.long, device=dev)
    if ids.numel() != n:
        raise ValueError(f"{ids.numel()} token ids for positions [{start}, {end})")
    table = torch.as_tensor(list(block_ids)[: -(-end // block_size)], dtype=torch.long, device=dev)
    slots = request_slots(block_ids, block_size, start, end, device=dev)
    positions = torch.arange(start, end, device=dev)
    keep_at = {check_layer: ratio, **dict(narrowing)}
    rows = torch.arange(n, device=dev)  # tokens still recomputed, relative to `start`
    buckets = _causal_buckets(positions)
    h = inner.embed_tokens(ids)
    layers = inner.decoder_layers()
    last = len(layers) - 1
    for i, (layer, kv_cache) in enumerate(zip(layers, kv_caches)):
        q, k, v = _layer_qkv(layer, h, positions[rows])
        if i in keep_at:
            flat = kv_cache.view(2, -1, *kv_cache.shape[-2:])
            old = flat.index_select(1, slots[rows]).to(k.dtype)
            deviation = (k - old[0]).float().pow(2).sum((1, 2)) + (v - old[1]).float().pow(2).sum((1, 2))
            deviation[missing[rows]] = math.inf  # nothing cached to fall back on
            # Every row's fresh K/V at this layer is already computed: keep it all.
            write_kv(kv_cache, k, v, slots[rows])
            keep = min(rows.numel(), _num_selected(keep_at[i], n - num_missing) + num_missing)
            top = deviation.topk(keep).indices.sort().values
            rows, h, q, k, v = rows[top], h[top], q[top], k[top], v[top]
            if keep == 0:
                break
            buckets = _causal_buckets(positions[rows])
        else:
            write_kv(kv_cache, k, v, slots[rows])
        if i == last:
            break
        keys, values = gather_kv(kv_cache, table, end)
        h = _layer_attend_mlp(layer, h, q, keys, values, buckets)
    return int(rows.numel())
