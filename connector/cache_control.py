"""Operating the cache for one prompt: what each tier holds of its chunks (inspect), and the
operator's pins of its prefix in one tier (pin, unpin); and one tier's limits changed at run
time (set_budget). The routes `/kv/inspect`, `/kv/pin`, `/kv/unpin` and `/kv/budget` of
`kvtier serve` answer from here (docs/serving.md, "Operating the cache").

A prompt is taken as the request would take it: its tokens are cut into chunk spans by the
request's keyspace (its cache_salt's: connector/keyspace.py), and a chunk is held by a tier
when every stored value of it is (its layers, its KV heads). Pins are the tiers' own
(kvstore/pin_set.py): all of a prefix's values or none.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from connector.keyspace import Keyspace, Span
from kvstore.backend import EntryInfo
from kvstore.pin_set import PinError
from kvstore.storage_manager import StorageManager


def _merge(infos: Sequence[EntryInfo | None]) -> dict[str, Any] | None:
    """Returns one chunk's figures from its stored values' (None unless every value is held):
    bytes summed, the oldest age, the latest use, pinned only if every value is, the soonest
    pin expiry."""
    if not infos or any(i is None for i in infos):
        return None
    held = [i for i in infos if i is not None]
    sizes = [i.nbytes for i in held]
    ages = [i.age_s for i in held]
    idles = [i.idle_s for i in held]
    expiries = [i.pin_expires_in_s for i in held if i.pin_expires_in_s is not None]
    pinned = all(i.pinned for i in held)
    return {"bytes": None if None in sizes else sum(s for s in sizes if s is not None),
            "age_s": None if None in ages else round(max(a for a in ages if a is not None), 3),
            "idle_s": None if None in idles else round(min(a for a in idles if a is not None), 3),
            "pinned": pinned,
            "pin_expires_in_s": round(min(expiries), 3) if pinned and expiries else None}


def inspect(storage: StorageManager, keyspace: Keyspace, token_ids: Sequence[int],
            tenants: str | None | bool = True) -> dict[str, Any]:
    """Returns the prompt's chunks (positions, key, per tier holding it its figures) and per
    tier its totals: entries, bytes, budget, pins, and per tenant tag its (entries, bytes) where
    the tier can tell (`tenants`: True every tenant, False none, a tag only that one)."""
    spans = keyspace.spans(token_ids)
    per_value = keyspace.values_per_chunk
    described = storage.describe(keyspace.stored_keys(spans))
    chunks = []
    for c, span in enumerate(spans):
        where = {name: _merge(infos[c * per_value:(c + 1) * per_value]) for name, infos in described.items()}
        chunks.append({"index": c, "start": span.start, "end": span.end, "key": span.key,
                       "tiers": {name: figures for name, figures in where.items() if figures is not None}})
    return {"num_tokens": len(token_ids), "chunk_size": keyspace.chunk_size, "chunks": chunks,
            "tiers": tier_totals(storage, tenants)}


def tier_totals(storage: StorageManager, tenants: str | None | bool = True) -> dict[str, dict[str, Any]]:
    """Returns per tier name its entries, bytes, budget, pins, and `by_tenant` (tag -> entries,
    bytes; None where the tier cannot tell) filtered as `inspect` says."""
    usage = storage.tenant_usage() if tenants is not False else {}
    out: dict[str, dict[str, Any]] = {}
    for name, stats in storage.stats().items():
        b = stats.backend
        by_tenant = usage.get(name)
        if by_tenant is not None and isinstance(tenants, str):
            by_tenant = {tag: v for tag, v in by_tenant.items() if tag == tenants}
        out[name] = {"healthy": stats.healthy, "entries": b.entries, "bytes": b.bytes_used,
                     "byte_budget": b.byte_budget, "can_pin": b.can_pin, "pinned_entries": b.pinned_entries,
                     "pinned_bytes": b.pinned_bytes, "pin_budget": b.pin_budget,
                     "by_tenant": None if by_tenant is None else
                     {tag: {"entries": n, "bytes": nbytes} for tag, (n, nbytes) in sorted(by_tenant.items())}}
    return out


def _prefix(storage: StorageManager, keyspace: Keyspace, token_ids: Sequence[int], tier: int
            ) -> tuple[list[Span], int]:
    """Returns the prompt's spans and how many of them, from the start, tier `tier` holds whole."""
    spans = keyspace.spans(token_ids)
    return spans, storage.held_prefix(tier, keyspace.stored_keys(spans)) // keyspace.values_per_chunk


def pin(storage: StorageManager, keyspace: Keyspace, token_ids: Sequence[int], tier: str | None = None,
        ttl_s: float | None = None) -> dict[str, Any]:
    """Pins the leading chunks of the prompt that tier `tier` (None: the fastest) holds, all
    or none; returns what was pinned and the tier's pins now. PinError (nothing pinned) when
    the tier holds none of them, cannot pin, or the pins would pass its pin budget; ValueError
    for an unknown tier."""
    i = storage.tier_named(tier)
    name = storage.names[i]
    storage.flush()  # chunks queued for a slower tier land first
    spans, held = _prefix(storage, keyspace, token_ids, i)
    if not held:
        raise PinError(f"tier {name} holds none of this prompt's {len(spans)} chunk(s) (for its cache_salt); "
                       "nothing was pinned (run the prompt first)")
    new_bytes = storage.pin_tier(i, keyspace.stored_keys(spans[:held]), ttl_s)
    return {"tier": name, "chunks": held, "of_chunks": len(spans), "tokens": spans[held - 1].end,
            "new_bytes": new_bytes, "ttl_s": ttl_s, **_pins_now(storage, i)}


def unpin(storage: StorageManager, keyspace: Keyspace, token_ids: Sequence[int], tier: str | None = None
          ) -> dict[str, Any]:
    """Releases the pins of every chunk of the prompt in tier `tier` (None: the fastest);
    returns how many chunk values were pinned and the tier's pins now."""
    i = storage.tier_named(tier)
    spans = keyspace.spans(token_ids)
    released = storage.unpin_tier(i, keyspace.stored_keys(spans))
    return {"tier": storage.names[i], "released": released, **_pins_now(storage, i)}


def set_budget(storage: StorageManager, tier: str | None = None, byte_budget: int | None = None,
               pin_budget: int | None = None, tenant_quota: int | None = None) -> dict[str, Any]:
    """Returns tier `tier`'s (None: the fastest) name and figures once it met the limits given
    (None: unchanged); BudgetError or ValueError (`StorageManager.set_tier_budget`) otherwise."""
    name = storage.set_tier_budget(tier, byte_budget, pin_budget, tenant_quota)
    return {"tier": name, **tier_totals(storage)[name]}


def _pins_now(storage: StorageManager, tier: int) -> dict[str, Any]:
    b = storage.stats()[storage.names[tier]].backend
    return {"pinned_entries": b.pinned_entries, "pinned_bytes": b.pinned_bytes, "pin_budget": b.pin_budget}
