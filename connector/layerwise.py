"""How tiers address one layer of a chunk in layerwise mode (`use_layerwise`).

Each layer of a chunk is its own stored value `(1, 2, tokens, kv_heads, head_size)` under
`<chunk key>@L<layer>` (LMCache's layerwise mode does the same). Every layer value is a whole
self-describing value (kvstore/serde.py), so each byte a load uses is covered by its own
checksum (and MAC), every codec works per layer, and every tier (the cache server included)
serves layers without a range read. A chunk counts as held only when all its layers are.
The alternative, byte ranges of one layer-major value with per-layer checksums in its header,
needs a range read from every tier and works only for the raw codec;
benchmarks/bench_ttft.py measures what per-layer values cost against whole chunks.
"""

from __future__ import annotations

from collections.abc import Sequence


def layer_key(key: str, layer: int) -> str:
    """Returns the stored key of layer `layer` of the chunk stored as `key`."""
    return f"{key}@L{layer}"


def stored_keys(keys: Sequence[str], num_layers: int | None) -> list[str]:
    """Returns the stored keys of `keys`' chunks, chunk by chunk (`num_layers` per chunk in
    layerwise mode; None: one value per chunk, the keys themselves)."""
    if num_layers is None:
        return list(keys)
    return [layer_key(k, i) for k in keys for i in range(num_layers)]


def chunks_held(held: Sequence[bool], num_layers: int | None) -> list[bool]:
    """Returns per chunk whether all its stored values are held, given `held` per stored key
    in `stored_keys` order."""
    n = num_layers or 1
    return [all(held[i:i + n]) for i in range(0, len(held), n)]
