"""CacheBlend's forward passes, run with the model's own modules one layer at a time.

Every family of engine/models runs here through its own layer code: a decoder layer's two
halves (`DecoderLayer.attention_input`, `after_attention`: its norms, residual stream and MLP
or experts) around the attention's own `project_qkv` (q/k norms, RoPE) and `o_proj`; only
the attention itself is CacheBlend's (`_attend`: a subset of queries over given keys, with
the layer's scale, soft-cap and sliding window). That one implementation serves both:
- `compute_segment_kv`: a segment's standalone K/V (its own sequence, no paged cache);
- `blend_recompute`: the selective recompute over K/V already scattered into the paged cache
  (which also computes, in place, the segments that had no stored K/V).

Keys are stored after RoPE, so a segment computed at positions 0..n-1 is moved to its place
in a prompt by `rerotate_kv` (RoPE rotations compose additively), with each layer's own
frequencies (Gemma 3's local and global layers differ). `check_blendable` refuses a model
whose RoPE does not compose that way (longrope switches frequencies at a position).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from engine.kv_cache import request_slots
from engine.layers.attention import Attention
from engine.layers.decoder import DecoderLayer
from engine.model_config import ModelConfig
from engine.models.base import CausalLM
from engine.paged_attention import gather_kv, sdpa_gqa, write_kv
from engine.rotary import rerotate
from engine.softcap_attention import softcap


def check_rope_moves(config: ModelConfig) -> None:
    """Raises ValueError if stored keys of the model `config` describes cannot be moved to
    another position by a rotation: longrope uses other frequencies past a position."""
    for scaling in (config.rope_scaling, config.local_rope_scaling):
        if scaling is not None and scaling.get("rope_type") == "longrope":
            raise ValueError(f"CacheBlend cannot move stored keys of {config.architecture} with longrope "
                             "scaling: its rotary frequencies change at a position, so a re-rotation is not a "
                             "rotation by the shift")


def check_blendable(model: nn.Module | None) -> CausalLM:
    """Returns `model` as the engine's CausalLM CacheBlend can run layer by layer; raises
    TypeError for another module, ValueError as `check_rope_moves`."""
    if not isinstance(model, CausalLM):
        raise TypeError(f"CacheBlend needs the engine's own model (engine/models), got {type(model).__name__}")
    check_rope_moves(model.config)
    return model


def layer_inv_freqs(model: CausalLM) -> list[torch.Tensor]:
    """Returns each decoder layer's RoPE frequencies, in layer order (for `rerotate_kv`)."""
    return [layer.self_attn.rotary.inv_freq for layer in model.model.decoder_layers()]


def _layer_qkv(layer: DecoderLayer, x: torch.Tensor, residual: torch.Tensor | None,
               positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns q `[T, Hq, D]`, k (after RoPE), v `[T, Hkv, D]` and the residual stream of
    decoder `layer` for the previous layer's (output `x`, stream `residual`) at `positions`."""
    h, stream = layer.attention_input(x, residual)
    q, k, v = layer.self_attn.project_qkv(h, positions)
    return q, k, v, stream


# Query buckets of a subset attention: (first row, end row, keys read, mask [rows, keys]).
Buckets = list[tuple[int, int, int, torch.Tensor]]

_NUM_BUCKETS = 8  # more buckets skip more masked keys, at one attention call each


def _visible(q_positions: torch.Tensor, num_keys: int, window: int | None) -> torch.Tensor:
    """Returns the bool mask `[rows, num_keys]` of keys each query sees: j <= p, and
    p - window < j under a sliding window (transformers' convention)."""
    keys = torch.arange(num_keys, device=q_positions.device).unsqueeze(0)
    p = q_positions.unsqueeze(1)
    mask = keys <= p
    return mask if window is None else mask & (keys > p - window)


def _causal_buckets(q_positions: torch.Tensor, window: int | None) -> Buckets:
    """Returns query buckets for rows at sorted `q_positions`: each bucket reads keys only up
    to its last position (later keys are masked anyway), so a causal subset costs about half
    of attending to the whole context. Built once per selection and window, reused by every
    layer."""
    t = q_positions.numel()
    pos = q_positions.tolist()
    cuts = sorted({round(i * t / _NUM_BUCKETS) for i in range(_NUM_BUCKETS + 1)})
    out: Buckets = []
    for a, b in zip(cuts, cuts[1:]):
        kend = pos[b - 1] + 1
        out.append((a, b, kend, _visible(q_positions[a:b], kend, window)))
    return out


def _attend(attn: Attention, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
            mask: torch.Tensor | None) -> torch.Tensor:
    """Returns the attention output `[T, Hq, D]` of queries `q` `[T, Hq, D]` over `keys` /
    `values` `[S, Hkv, D]` with `attn`'s scale and soft-cap: through the bool `mask`
    `[T, S]` (True: attend), or plain causal when None (T == S, no window)."""
    qt, kt, vt = q.transpose(0, 1), keys.transpose(0, 1).to(q.dtype), values.transpose(0, 1).to(q.dtype)
    cap = attn.logit_softcap
    if cap is None:
        return sdpa_gqa(qt, kt, vt, attn.scale, mask=mask, causal=mask is None).transpose(0, 1)
    # Soft-capped scores (SDPA has no cap): explicit scores, softmax in float32 (as the engine).
    h_kv, s, d = kt.shape
    h_q, t, _ = qt.shape
    if mask is None:
        mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(s - t)
    scores = softcap(torch.matmul(qt.view(h_kv, h_q // h_kv, t, d), kt[:, None].transpose(-1, -2)) * attn.scale, cap)
    probs = torch.softmax(scores.masked_fill_(~mask, float("-inf")), dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, vt[:, None]).view(h_q, t, d).transpose(0, 1)


def _attend_buckets(attn: Attention, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    buckets: Buckets) -> torch.Tensor:
    """Returns `_attend` of each bucket's queries over its keys, stacked `[T, Hq, D]`."""
    o = torch.empty_like(q)
    for a, b, kend, mask in buckets:
        o[a:b] = _attend(attn, q[a:b], keys[:kend], values[:kend], mask)
    return o


def _after_attention(layer: DecoderLayer, o: torch.Tensor,
                     stream: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns the layer's (output, residual stream) for its attention output `o` `[T, Hq, D]`."""
    attn = layer.self_attn
    return layer.after_attention(attn.o_proj(o.reshape(o.shape[0], attn.q_size)), stream)


@torch.inference_mode()
def compute_segment_kv(model: CausalLM, token_ids: Sequence[int] | torch.Tensor,
                       start_position: int = 0) -> torch.Tensor:
    """Returns the K/V `(num_layers, 2, T, Hkv, D)` (model dtype and device) of `token_ids`
    computed as a sequence of their own at positions `start_position..` (keys after RoPE)."""
    inner = model.model
    w = inner.embed_tokens.weight
    ids = torch.as_tensor(token_ids, dtype=torch.long, device=w.device)
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError(f"token_ids must be a non-empty 1-D sequence, got shape {tuple(ids.shape)}")
    t = ids.numel()
    positions = torch.arange(start_position, start_position + t, device=w.device)
    layers = inner.decoder_layers()
    attn0 = layers[0].self_attn
    out = torch.empty((len(layers), 2, t, attn0.num_kv_heads, attn0.head_size), dtype=w.dtype, device=w.device)
    x, stream = inner.embed(ids), None
    last = len(layers) - 1
    masks: dict[int, torch.Tensor] = {}  # per sliding window that bites
    for i, layer in enumerate(layers):
        q, k, v, stream = _layer_qkv(layer, x, stream, positions)
        out[i, 0], out[i, 1] = k, v
        if i == last:  # only this layer's K/V is wanted, not its output
            break
        window = layer.self_attn.sliding_window
        mask = None
        if window is not None and window < t:
            if window not in masks:
                masks[window] = _visible(torch.arange(t, device=w.device), t, window)
            mask = masks[window]
        x, stream = _after_attention(layer, _attend(layer.self_attn, q, k, v, mask), stream)
    return out


def rerotate_kv(kv: torch.Tensor, shift: int, inv_freq: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    """Returns a copy of chunk `kv` `(L, 2, T, H, D)` whose keys are moved `shift` positions
    later (values unchanged), with one `inv_freq` for every layer or one per layer
    (`layer_inv_freqs`)."""
    out = kv.clone()
    if not shift:
        return out
    layers, _two, t, h, d = kv.shape
    per_layer = [inv_freq] * layers if isinstance(inv_freq, torch.Tensor) else list(inv_freq)
    if len(per_layer) != layers:
        raise ValueError(f"{len(per_layer)} inv_freq tensors for {layers} layers")
    groups: dict[int, list[int]] = {}  # layers sharing one frequency tensor move together
    for i, f in enumerate(per_layer):
        groups.setdefault(id(f), []).append(i)
    for idx in groups.values():
        sel = torch.tensor(idx, device=kv.device)
        keys = kv[sel, 0].reshape(len(idx) * t, h, d)
        zero = torch.zeros(len(idx) * t, dtype=torch.long, device=kv.device)
        out[sel, 0] = rerotate(keys, zero, zero + shift, per_layer[idx[0]]).view(len(idx), t, h, d)
    return out


def _num_selected(ratio: float, n: int) -> int:
    # ceil: any ratio > 0 recomputes at least one token, ratio 1 recomputes all of them.
    return min(n, math.ceil(ratio * n - 1e-9))


@torch.inference_mode()
def blend_recompute(model: CausalLM, kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int],
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
    layers, attending over the whole context with an exact causal mask (and each layer's
    window), their fresh K/V overwriting the cache. `token_ids` are the tokens of [start, end).
    Returns how many tokens reached the last layer; with nothing missing, ratio 0 changes
    nothing (plain reuse) and ratio 1 equals a full prefill; with everything missing, any
    ratio is a full prefill.
    """
    n = end - start
    if n <= 0:
        return 0
    inner = model.model
    dev = inner.embed_tokens.weight.device
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
    buckets: dict[int | None, Buckets] = {}  # per window, for the current rows
    x, stream = inner.embed(ids), None
    layers = inner.decoder_layers()
    last = len(layers) - 1
    for i, (layer, kv_cache) in enumerate(zip(layers, kv_caches)):
        q, k, v, stream = _layer_qkv(layer, x, stream, positions[rows])
        if i in keep_at:
            flat = kv_cache.view(2, -1, *kv_cache.shape[-2:])
            old = flat.index_select(1, slots[rows]).to(k.dtype)
            deviation = (k - old[0]).float().pow(2).sum((1, 2)) + (v - old[1]).float().pow(2).sum((1, 2))
            deviation[missing[rows]] = math.inf  # nothing cached to fall back on
            # Every row's fresh K/V at this layer is already computed: keep it all.
            write_kv(kv_cache, k, v, slots[rows])
            keep = min(rows.numel(), _num_selected(keep_at[i], n - num_missing) + num_missing)
            top = deviation.topk(keep).indices.sort().values
            rows, stream, q, k, v = rows[top], stream[top], q[top], k[top], v[top]
            if keep == 0:
                break
            buckets.clear()
        else:
            write_kv(kv_cache, k, v, slots[rows])
        if i == last:
            break
        window = layer.self_attn.sliding_window
        window = window if window is not None and window < end else None
        if window not in buckets:
            buckets[window] = _causal_buckets(positions[rows], window)
        keys, values = gather_kv(kv_cache, table, end)
        x, stream = _after_attention(layer, _attend_buckets(layer.self_attn, q, keys, values, buckets[window]), stream)
    return int(rows.numel())
