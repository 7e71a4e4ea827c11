"""Operating the cache: what each tier holds of a prompt's chunks (inspect), the operator's pins
of its prefix in one tier (pin, unpin), copies of its prefix between tiers (prefetch into a
faster tier, move, drop), removals (one tenant's entries, one model's, every chunk, the chunks
unused for a while) and one tier's limits changed at run time (set_budget). The routes
`/kv/inspect`, `/kv/pin`, `/kv/unpin`, `/kv/prefetch`, `/kv/move`, `/kv/drop`, `/kv/clear` and
`/kv/budget` of `kvtier serve` answer from here (docs/serving.md, "Operating the cache"), and
so do the same routes of `vllm serve` through connector/vllm/control_ops.py.

A prompt is taken as the request would take it: its tokens are cut into chunk spans by the
request's keyspace (its cache_salt's: kvkeys/keyspace.py), and a chunk is held by a tier
when every stored value of it is (its layers, its KV heads). Pins are the tiers' own
(kvstore/pin_set.py): all of a prefix's values or none.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from connector.key_families import FamilyIndex
from kvkeys.families import Family
from kvkeys.keyspace import Keyspace, Span
from kvkeys.stored_keys import UsageGroup
from kvkeys.tenants import tenant_prefix, tenant_tag
from kvstore.backend import EntryInfo
from kvstore.budget import sum_usage
from kvstore.capabilities import LOCAL_TIERS
from kvstore.pin_set import PinError
from kvstore.storage_manager import StorageManager


def merge_figures(infos: Sequence[EntryInfo | None]) -> dict[str, Any] | None:
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
    described = storage.operations.describe(keyspace.stored_keys(spans))
    chunks = []
    for c, span in enumerate(spans):
        where = {name: merge_figures(infos[c * per_value:(c + 1) * per_value]) for name, infos in described.items()}
        chunks.append({"index": c, "start": span.start, "end": span.end, "key": span.key,
                       "tiers": {name: figures for name, figures in where.items() if figures is not None}})
    return {"num_tokens": len(token_ids), "chunk_size": keyspace.chunk_size, "chunks": chunks,
            "tiers": tier_totals(storage, tenants)}


def tier_totals(storage: StorageManager, tenants: str | None | bool = True) -> dict[str, dict[str, Any]]:
    """Returns per tier name its entries, bytes, budget, pins, `by_tenant` (tag -> entries,
    bytes) filtered as `inspect` says, and with every tenant's usage `by_model` (key family:
    model, dtype, layout, chunk size -> entries, bytes); None where the tier cannot tell."""
    ops = storage.operations
    usage = ops.usage() if tenants is not False else {}
    out: dict[str, dict[str, Any]] = {}
    for name, stats in storage.stats().items():
        b = stats.backend
        groups = usage.get(name)
        by_tenant = _by(groups, 0)
        if by_tenant is not None and isinstance(tenants, str):
            by_tenant = {tag: v for tag, v in by_tenant.items() if tag == tenants}
        out[name] = {"healthy": stats.healthy, "entries": b.entries, "bytes": b.bytes_used,
                     "byte_budget": b.byte_budget, "can_pin": b.can_pin, "pinned_entries": b.pinned_entries,
                     "pinned_bytes": b.pinned_bytes, "pin_budget": b.pin_budget,
                     "by_tenant": _counts(by_tenant),
                     "by_model": _counts(_by(groups, 1) if tenants is True else None)}
    return out


def _by(groups: dict[UsageGroup, tuple[int, int]] | None, field: int) -> dict[str, tuple[int, int]] | None:
    """Returns a tier's usage summed per tenant (`field` 0; unsalted keys not counted) or per key
    family (1), None when the tier cannot tell."""
    if groups is None:
        return None
    return sum_usage((label, counts) for group, counts in groups.items() if (label := group[field]) is not None)


def _counts(usage: dict[str, tuple[int, int]] | None) -> dict[str, dict[str, int]] | None:
    return None if usage is None else {k: {"entries": n, "bytes": b} for k, (n, b) in sorted(usage.items())}


def _leading_held(storage: StorageManager, keyspace: Keyspace, spans: Sequence[Span], tier: str) -> int:
    """Returns how many of `spans`, from the start, tier `tier` holds whole."""
    return storage.operations.held_prefix(tier, keyspace.stored_keys(spans)) // keyspace.values_per_chunk


def pin(storage: StorageManager, keyspace: Keyspace, token_ids: Sequence[int], tier: str | None = None,
        ttl_s: float | None = None) -> dict[str, Any]:
    """Pins the leading chunks of the prompt that tier `tier` (None: the fastest) holds, all
    or none; returns what was pinned and the tier's pins now. PinError (nothing pinned) when
    the tier holds none of them, cannot pin, or the pins would pass its pin budget; ValueError
    for an unknown tier."""
    name = storage.operations.name(tier)
    storage.flush()  # chunks queued for a slower tier land first
    spans = keyspace.spans(token_ids)
    held = _leading_held(storage, keyspace, spans, name)
    if not held:
        raise PinError(f"tier {name} holds none of this prompt's {len(spans)} chunk(s) (for its cache_salt); "
                       "nothing was pinned (run the prompt first)")
    new_bytes = storage.operations.pin(name, keyspace.stored_keys(spans[:held]), ttl_s)
    return {"tier": name, "chunks": held, "of_chunks": len(spans), "tokens": spans[held - 1].end,
            "new_bytes": new_bytes, "ttl_s": ttl_s, **_pins_now(storage, name)}


def unpin(storage: StorageManager, keyspace: Keyspace, token_ids: Sequence[int], tier: str | None = None
          ) -> dict[str, Any]:
    """Releases the pins of every chunk of the prompt in tier `tier` (None: the fastest);
    returns how many chunk values were pinned and the tier's pins now."""
    name = storage.operations.name(tier)
    released = storage.operations.unpin(name, keyspace.stored_keys(keyspace.spans(token_ids)))
    return {"tier": name, "released": released, **_pins_now(storage, name)}


def set_budget(storage: StorageManager, tier: str | None = None, byte_budget: int | None = None,
               pin_budget: int | None = None, tenant_quota: int | None = None) -> dict[str, Any]:
    """Returns tier `tier`'s (None: the fastest) name and figures once it met the limits given
    (None: unchanged); BudgetError or ValueError (`TierOperations.set_budget`) otherwise."""
    name = storage.operations.set_budget(tier, byte_budget, pin_budget, tenant_quota)
    return {"tier": name, **tier_totals(storage)[name]}


def _pins_now(storage: StorageManager, tier: str) -> dict[str, Any]:
    b = storage.stats()[tier].backend
    return {"pinned_entries": b.pinned_entries, "pinned_bytes": b.pinned_bytes, "pin_budget": b.pin_budget}


def _held_chunks(storage: StorageManager, keyspace: Keyspace, spans: Sequence[Span]) -> dict[str, list[bool]]:
    """Returns per tier name (fastest first) per chunk whether the tier holds every value of it."""
    per_value = keyspace.values_per_chunk
    described = storage.operations.describe(keyspace.stored_keys(spans))
    return {name: [all(i is not None for i in infos[c * per_value:(c + 1) * per_value]) for c in range(len(spans))]
            for name, infos in described.items()}


def prefetch(storage: StorageManager, keyspace: Keyspace, token_ids: Sequence[int], tier: str | None = None
             ) -> dict[str, Any]:
    """Copies into tier `tier` (None: the fastest) the prompt's leading chunks it lacks, each
    from the fastest other tier holding it; stops at the first chunk no tier holds (a later
    chunk is of no use without it). Returns the chunks copied per source tier, those the target
    held already, and the leading tokens the target holds now. ValueError for an unknown tier."""
    ops = storage.operations
    t = ops.name(tier)
    storage.flush()
    spans = keyspace.spans(token_ids)
    held = _held_chunks(storage, keyspace, spans)
    copied: dict[str, int] = {}
    already = 0
    for c, span in enumerate(spans):
        if held[t][c]:
            already += 1
            continue
        source = next((name for name in held if name != t and held[name][c]), None)
        if source is None:
            break
        keys = keyspace.stored_keys([span])
        if ops.copy(source, t, keys) < len(keys):
            break  # the source lost it meanwhile, or the target refused it
        copied[source] = copied.get(source, 0) + 1
    return {"tier": t, "of_chunks": len(spans), "held_before": already, "copied": copied,
            "held_tokens": _held_tokens(storage, keyspace, spans, t)}


def move(storage: StorageManager, keyspace: Keyspace, token_ids: Sequence[int], src: str, dst: str
         ) -> dict[str, Any]:
    """Moves the prompt's chunks tier `src` holds into tier `dst`: each is copied, then removed
    from `src` (a chunk `dst` already holds is only removed from `src`; one `dst` refuses stays
    where it is). Returns the chunks moved and refused, and the leading tokens each tier holds
    now. ValueError for an unknown tier or `src` equal to `dst`."""
    ops = storage.operations
    s, d = ops.name(src), ops.name(dst)
    if s == d:
        raise ValueError(f"move: source and target are the same tier ({s})")
    storage.flush()
    spans = keyspace.spans(token_ids)
    held = _held_chunks(storage, keyspace, spans)
    moved = refused = 0
    for c, span in enumerate(spans):
        if not held[s][c]:
            continue
        keys = keyspace.stored_keys([span])
        if not held[d][c] and ops.copy(s, d, keys) < len(keys):
            refused += 1
            continue
        ops.delete(s, keys)
        moved += 1
    return {"from": s, "to": d, "moved": moved, "refused": refused,
            "held_tokens": {name: _held_tokens(storage, keyspace, spans, name) for name in (s, d)}}


def drop(storage: StorageManager, keyspace: Keyspace, token_ids: Sequence[int], tier: str | None = None
         ) -> dict[str, Any]:
    """Removes every chunk of the prompt from tier `tier` (None: the fastest), pinned or not;
    returns how many stored values it held. ValueError for an unknown tier."""
    t = storage.operations.name(tier)
    removed = storage.operations.delete(t, keyspace.stored_keys(keyspace.spans(token_ids)))
    return {"tier": t, "removed": removed}


def _held_tokens(storage: StorageManager, keyspace: Keyspace, spans: Sequence[Span], tier: str) -> int:
    """Returns the leading tokens tier `tier` holds whole chunks of."""
    held = _leading_held(storage, keyspace, spans, tier)
    return spans[held - 1].end if held else 0


class NoSuchModel(LookupError):
    """A clear by model that matches no stored key family: nothing was removed."""


def clear_model(storage: StorageManager, model: str) -> tuple[dict[str, int], dict[str, str]]:
    """Removes from every tier the values of each key family of model `model` (its key's model
    field, or that field's name before the `+engine` tag) that some tier's families index
    lists (connector/key_families.py: a shared tier's index, this process's own for the cpu and
    device tiers), and drops those families from the indexes. Returns (per tier the values
    removed, per tier that failed its error); NoSuchModel, naming the models stored, when no
    family is of `model`."""
    index = FamilyIndex.of(storage)

    def match(f: Family) -> bool:
        return model in (f.model, f.model.partition("+")[0])

    listed = [f for name in storage.names for f in index.listed(name)]
    prefixes = sorted({f.id for f in listed if match(f)})
    if not prefixes:
        stored = sorted({f.model for f in listed})
        raise NoSuchModel(f"no tier holds chunks of model {model!r} (a key's model field, as inspect's by_model "
                          f"names it); stored: {', '.join(stored) or 'none'}")
    removed: dict[str, int] = dict.fromkeys(storage.names, 0)
    errors: dict[str, str] = {}
    for prefix in prefixes:
        got, failed = storage.operations.delete_prefix(prefix)
        for name, n in got.items():
            removed[name] += n
        errors.update(failed)
    index.forget(match)
    return removed, errors
# ---- removals ---------------------------------------------------------------------------
def forget_tenant(storage: StorageManager, cache_salt: str) -> tuple[dict[str, int], dict[str, str]]:
    """Removes every stored value of `cache_salt`'s requests from every tier (and the tenant
    from the shared tiers' family index); returns (per tier removed, per tier that failed)."""
    tag = tenant_tag(cache_salt)
    FamilyIndex.of(storage).forget_tenant(tag)
    return storage.operations.delete_prefix(tenant_prefix(tag))


def clear_tiers(storage: StorageManager, local_only: bool = False) -> dict[str, int]:
    """Removes every chunk from every tier (`local_only`: the cpu and device tiers), pins
    included; returns per cleared tier how many entries it held before."""
    cleared = {name for name, t in zip(storage.names, storage.tiers) if not local_only or t.name in LOCAL_TIERS}
    before = {name: s.backend.entries for name, s in storage.stats().items() if name in cleared}
    storage.clear(local_only=local_only)
    return before
