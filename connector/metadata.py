"""What crosses from the connector's scheduler side to its worker side each step: one
`KVTierMeta` (it pickles; the halves may live in different processes, as in vLLM)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvkeys.keyspace import Span


@dataclass
class LoadSpec:
    """Load positions [start, end) of a request into its fresh blocks, from `spans` (in order,
    covering [start, end); the first may begin before `start`, its head is not written)."""

    request_id: str
    start: int
    end: int
    spans: list[Span]
    block_ids: list[list[int]]  # per KV cache group
    layerwise: bool = False  # this step's forward waits for it layer by layer; else background


@dataclass
class SaveSpec:
    """Store `spans` of a request, gathered from `block_ids`; with `release` the request has
    finished and its blocks are freed once this save no longer reads them."""

    request_id: str
    block_ids: list[list[int]]  # per KV cache group
    spans: list[Span]
    release: bool = False
    cache_salt: str | None = None  # the spans' keyspace's (its key family: connector/key_families.py)


@dataclass
class KVTierMeta:
    """One step's instructions for the worker side."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    # the extension's work items for this step (connector/extension.py; CacheBlend's BlendSpecs)
    extension_work: list[Any] = field(default_factory=list)
