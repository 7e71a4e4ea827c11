"""The keyspace: tokens in, chunk spans that carry their stored keys out (docs/architecture.md,
"Chunks, keys and codecs"; LMCache's token database plays this part).

A key names everything that makes stored K/V incompatible: model fingerprint, KV dtype,
layout version, chunk size, and the chained hash of the tokens up to and including the chunk,
`h_i = chain_hash(h_{i-1}, tokens_i)` from a fixed root (kvkeys/chain.py, the primitive the
engine's prefix cache chains too). A `Keyspace` is configured once per connector; every span
it returns carries its key and its chain hash, so nothing is ever parsed back from a key.

A request's `cache_salt` (kvkeys/tenants.py) gives it its own keyspace (`for_salt`): its
chains start from a salted root (prefix and CacheBlend segment chains alike), so no key is
shared across salts, and its keys start `kvtier:tenant-<tag>:` so every tier can find one
tenant's entries. Unsalted keys are unchanged.

In layerwise mode (`use_layerwise`) each layer of a chunk is its own stored value
`(1, 2, tokens, kv_heads, head_size)` under `<chunk key>@L<layer>` (LMCache's layerwise mode
does the same): each byte a load uses is covered by its own checksum, every codec works per
layer, and every tier serves a layer without a range read. A chunk counts as held only when
all its layers are.

Split by KV head (`heads`, vLLM's connector at any tensor-parallel size) each KV head of a chunk
is its own stored value `(layers, 2, tokens, 1, head_size)` under `<chunk key>@H<head>`, and a
keyspace covers the heads [lo, hi) its worker holds: a tensor-parallel rank stores and loads
exactly its own heads, and chunks stored at one TP size load at any other (docs/vllm.md,
"Parallel"). A chunk counts as held only when all its covered heads are.

Over a page layout moved as whole (block, KV head) tiles (connector/vllm/layouts.py,
`VllmTileLayout`) every span is a whole number of blocks (`token_multiple`, the block size):
a partial last chunk is cut back to its last whole block, so a stored value never holds half
a tile.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvkeys.chain import chain_hash, chain_prefixes, root_hash
from kvkeys.tenants import KEY_ROOT, salted_root, tenant_prefix, tenant_tag

LAYOUT_VERSION = 1
"""Bumped whenever the chunk tensor layout `(layers, 2, tokens, kv_heads, head_size)` changes."""

ROOT_HASH = root_hash(b"kvtier/chunk-root/v1")
"""The parent of a sequence's first chunk."""

SEGMENT_ROOTS = {
    "in_context": root_hash(b"kvtier/blend-segment-root/in-context/v1"),
    "standalone": root_hash(b"kvtier/blend-segment-root/v1"),
}
"""CacheBlend: the root a segment's chain starts from, per way of computing it
(`BlendConfig.segment_kv`). A segment is keyed by its own tokens only, whatever precedes it in
a prompt, and can never share a key with a prefix chain."""


@dataclass(frozen=True)
class Span:
    """One chunk of a token sequence: positions [start, end), its stored key and the chain
    hash through it (the next chunk's parent)."""

    start: int
    end: int
    key: str
    chain: bytes

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


class RequestSpans:
    """One request's spans in its keyspace, extended as its tokens grow: each whole chunk is
    hashed once for the request's life, so hashing is linear in its tokens however often it is
    looked up or planned; a partial last chunk is hashed again only when its end moved. A
    request's tokens only ever grow (its prompt, then what it generated)."""

    def __init__(self, keyspace: Keyspace) -> None:
        self.keyspace = keyspace
        self._whole: list[Span] = []
        self._tail: Span | None = None  # the last partial span asked for

    def spans(self, tokens: Sequence[int] | Any, unfull: bool = True) -> list[Span]:
        """Returns `Keyspace.spans(tokens, unfull)` for a prefix of the request's tokens."""
        ks = self.keyspace
        whole_end = len(tokens) // ks.chunk_size * ks.chunk_size
        have = len(self._whole) * ks.chunk_size
        if whole_end > have:
            parent = self._whole[-1].chain if self._whole else None
            self._whole += ks.spans(tokens[have:whole_end], unfull=False, parent=parent, start=have)
        out = self._whole[:whole_end // ks.chunk_size]
        if not unfull or whole_end == len(tokens):
            return out
        tail = self._tail
        end = whole_end + (len(tokens) - whole_end) // ks.token_multiple * ks.token_multiple
        if tail is None or (tail.start, tail.end) != (whole_end, end):
            parent = out[-1].chain if out else None
            found = ks.spans(tokens[whole_end:end], unfull=True, parent=parent, start=whole_end)
            if not found:
                return out
            tail = self._tail = found[0]
        return [*out, tail]


def dtype_name(dtype: torch.dtype | str) -> str:
    """Returns the short name of a KV dtype ("float16", "bfloat16", ...)."""
    return str(dtype).removeprefix("torch.")


def chunk_key(model: str, kv_dtype: str, chunk_size: int, chain: bytes,
              layout_version: int = LAYOUT_VERSION, tenant: str | None = None) -> str:
    """Returns `kvtier:<model>:<dtype>:v<layout>:c<chunk_size>:<hash hex>` (ASCII, no spaces),
    for a tenant `kvtier:tenant-<tag>:<model>:...`."""
    head = tenant_prefix(tenant) if tenant is not None else KEY_ROOT
    return f"{head}{model}:{kv_dtype}:v{layout_version}:c{chunk_size}:{chain.hex()}"


def layer_key(key: str, layer: int) -> str:
    """Returns the stored key of layer `layer` of the chunk stored as `key`."""
    return f"{key}@L{layer}"


def head_key(key: str, head: int) -> str:
    """Returns the stored key of KV head `head` of the chunk stored as `key`."""
    return f"{key}@H{head}"


class Keyspace:
    """Turns tokens into chunk spans with their keys, for one model, KV dtype and chunk size.
    Pure: no I/O, no state beyond its configuration."""

    def __init__(self, model: str, kv_dtype: torch.dtype | str, chunk_size: int, num_layers: int,
                 layerwise: bool = False, cache_salt: str | None = None,
                 heads: tuple[int, int] | None = None, token_multiple: int = 1) -> None:
        for name, value in (("model", model), ("kv_dtype", dtype_name(kv_dtype))):
            if not isinstance(value, str) or ":" in value or any(c.isspace() for c in value):
                raise ValueError(f"keyspace {name} must be a str without ':' or spaces, got {value!r}")
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
        if token_multiple <= 0 or chunk_size % token_multiple:
            raise ValueError(f"chunk_size {chunk_size} must be a multiple of the tokens of one tile "
                             f"({token_multiple}, the block size where pages move as whole tiles)")
        if num_layers <= 0:
            raise ValueError(f"num_layers must be > 0, got {num_layers}")
        if heads is not None and not 0 <= heads[0] < heads[1]:
            raise ValueError(f"heads must be a range [lo, hi) with 0 <= lo < hi, got {heads}")
        if heads is not None and layerwise:
            raise ValueError("a keyspace is split by layer (use_layerwise) or by KV head, not both")
        self.model = model
        self.kv_dtype = dtype_name(kv_dtype)
        self.chunk_size = chunk_size
        self.num_layers = num_layers
        self.layerwise = layerwise
        self.token_multiple = token_multiple  # every span's length is a multiple of it
        self.heads: tuple[int, int] | None = (heads[0], heads[1]) if heads is not None else None
        self.cache_salt = cache_salt  # hashed, never put in a key: any string is safe here
        self.tenant = tenant_tag(cache_salt) if cache_salt is not None else None
        self.root = salted_root(ROOT_HASH, cache_salt)
        self.layout_version = LAYOUT_VERSION
        self._segment_roots = {kind: salted_root(r, cache_salt) for kind, r in SEGMENT_ROOTS.items()}
        self._salted: dict[str, Keyspace] = {}
        self._ranges: dict[tuple[int, int], Keyspace] = {}  # for_heads' answers (a few TP ranks)

    def for_salt(self, cache_salt: str | None) -> Keyspace:
        """Returns the keyspace of requests with `cache_salt` (None: unsalted), otherwise
        configured as this one."""
        if cache_salt == self.cache_salt:
            return self
        if cache_salt is None:
            return self._like(None, self.heads)
        ks = self._salted.get(cache_salt)
        if ks is None:
            if len(self._salted) >= 4096:  # a bound, not a policy: rebuilt on demand
                self._salted.clear()
            ks = self._salted[cache_salt] = self._like(cache_salt, self.heads)
        return ks

    def for_heads(self, lo: int, hi: int) -> Keyspace:
        """Returns this keyspace covering KV heads [lo, hi) (a tensor-parallel rank's), split
        by head; otherwise configured as this one. Built once per range: the scheduler asks
        it of every rank at every lookup."""
        ks = self._ranges.get((lo, hi))
        if ks is None:
            ks = self._ranges[(lo, hi)] = self._like(self.cache_salt, (lo, hi))
        return ks

    def _like(self, cache_salt: str | None, heads: tuple[int, int] | None) -> Keyspace:
        return Keyspace(self.model, self.kv_dtype, self.chunk_size, self.num_layers, self.layerwise, cache_salt, heads,
                        self.token_multiple)

    @property
    def identity(self) -> str:
        """Returns what keyspaces that key the same chunks alike share, their salt and covered
        heads aside: two roles (or processes) whose identities differ must not trust each
        other's answers about keys."""
        split = "layers" if self.layerwise else "heads" if self.heads is not None else "chunks"
        return (f"{self.model}:{self.kv_dtype}:v{self.layout_version}:c{self.chunk_size}:t{self.token_multiple}:"
                f"L{self.num_layers}:{split}")

    def rooted(self, root: bytes, tenant: str | None, layout_version: int = LAYOUT_VERSION) -> Keyspace:
        """Returns this keyspace with its chains from `root`, its keys `tenant`'s (a tag) and of
        `layout_version`: a salt's keyspace known only by its root and tag, as a key family's
        index record keeps it (connector/key_families.py)."""
        ks = self._like(None, self.heads)
        ks.root, ks.tenant, ks.layout_version = root, tenant, layout_version
        return ks

    def key(self, chain: bytes) -> str:
        """Returns the stored key of the chunk whose chain hash is `chain`."""
        return chunk_key(self.model, self.kv_dtype, self.chunk_size, chain, self.layout_version, self.tenant)

    def spans(self, tokens: Sequence[int] | Any, unfull: bool = True, parent: bytes | None = None,
              start: int = 0) -> list[Span]:
        """Returns each `chunk_size` slice of `tokens` as a span, chained from `parent`
        (default: this keyspace's root), positions counted from `start` (where `tokens[0]`
        sits); the last, shorter slice only if `unfull`, cut back to a multiple of
        `token_multiple` (none if that leaves nothing)."""
        out: list[Span] = []
        n = len(tokens) // self.token_multiple * self.token_multiple
        chain = self.root if parent is None else parent
        for i in range(0, n, self.chunk_size):
            j = min(i + self.chunk_size, n)
            if j - i < self.chunk_size and not unfull:
                break
            chain = chain_hash(chain, tokens[i:j])
            out.append(Span(start + i, start + j, self.key(chain), chain))
        return out

    def partial_spans(self, tokens: Sequence[int] | Any, start: int, parent: bytes) -> list[Span]:
        """Returns, for m = 1 .. len(tokens) - 1 (multiples of `token_multiple`), the span
        `tokens[:m]` would be as the partial last chunk of a sequence whose chunk starting at
        `start` (after `parent`) ends there: how a chunk stored partial, that later grew, is
        found again."""
        step = self.token_multiple
        return [Span(start, start + m, self.key(h), h)
                for m, h in enumerate(chain_prefixes(parent, tokens[:-1]), start=1) if m % step == 0]

    def segment_spans(self, tokens: Sequence[int] | Any, segment_kv: str) -> list[Span]:
        """Returns a CacheBlend segment's spans (positions relative to the segment), keyed from
        the root of `segment_kv` so they depend on its tokens alone, never on its position."""
        return self.spans(tokens, unfull=True, parent=self._segment_roots[segment_kv])

    @property
    def values_per_chunk(self) -> int:
        """How many stored values make one chunk (its layers in layerwise mode, its covered
        heads when split by head, else 1)."""
        if self.heads is not None:
            return self.heads[1] - self.heads[0]
        return self.num_layers if self.layerwise else 1

    def stored_keys(self, spans: Sequence[Span]) -> list[str]:
        """Returns the stored keys of `spans`' chunks, chunk by chunk (`values_per_chunk` each)."""
        if self.heads is not None:
            return [head_key(sp.key, h) for sp in spans for h in range(*self.heads)]
        if not self.layerwise:
            return [sp.key for sp in spans]
        return [layer_key(sp.key, i) for sp in spans for i in range(self.num_layers)]

    def probe_keys(self, spans: Sequence[Span]) -> list[str]:
        """Returns one stored key per chunk, a cheap probe for the whole chunk: its last
        layer's in layerwise mode (written last), its last covered head's when split by head,
        else the chunk's own."""
        if self.heads is not None:
            return [head_key(sp.key, self.heads[1] - 1) for sp in spans]
        if not self.layerwise:
            return [sp.key for sp in spans]
        return [layer_key(sp.key, self.num_layers - 1) for sp in spans]

    def chunk_values(self, key: str, kv: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """Returns the stored values, with their keys, of the whole chunk `kv` `(layers, 2,
        tokens, covered heads, head_size)` stored as `key` (not layerwise): one view of `kv`
        per head when split by head (not contiguous: the store queue copies them out on its
        own thread), else the chunk itself."""
        if self.heads is None:
            return [(key, kv)]
        return [(head_key(key, h), kv[:, :, :, i:i + 1]) for i, h in enumerate(range(*self.heads))]

    def chunk_tiers(self, where: Sequence[int | None]) -> list[int | None]:
        """Returns per chunk the slowest tier among its stored values (a load must reach it),
        None unless all are held, given `where` per stored key in `stored_keys` order (the
        fastest tier holding each, None: none)."""
        n = self.values_per_chunk
        out: list[int | None] = []
        for i in range(0, len(where), n):
            values = where[i:i + n]
            out.append(None if None in values else max(t for t in values if t is not None))
        return out

    def chunks_held(self, held: Sequence[bool]) -> list[bool]:
        """Returns per chunk whether all its stored values are held, given `held` per stored
        key in `stored_keys` order."""
        return [t is not None for t in self.chunk_tiers([0 if h else None for h in held])]
