"""Operating the cache: what each tier holds of a prompt's chunks (inspect), the operator's
pins of its prefix in one tier (pin, unpin), and removals (one tenant's entries, every chunk,
the chunks unused for a while). The routes `/kv/inspect`, `/kv/pin`, `/kv/unpin` and
`/kv/clear` of `kvtier serve` answer from here (docs/serving.md, "Operating the cache"), and so
do the same routes of `vllm serve`, whose worker answers them as JSON questions over the lookup
channel (`CONTROL_OPS`, `answer_control`; connector/vllm_lookup_route.py, docs/vllm.md).

A prompt is taken as the request would take it: its tokens are cut into chunk spans by the
request's keyspace (its cache_salt's: connector/keyspace.py), and a chunk is held by a tier
when every stored value of it is (its layers, its KV heads). Pins are the tiers' own
(kvstore/pin_set.py): all of a prefix's values or none.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from connector.key_families import FamilyIndex
from connector.keyspace import Keyspace, Span
from engine.cache_salt import tenant_tag, validate_cache_salt
from kvstore.backend import EntryInfo
from kvstore.pin_set import PinError
from kvstore.storage_manager import LOCAL_TIERS, StorageManager
from kvstore.tenant_keys import tenant_prefix

log = logging.getLogger(__name__)


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


def _pins_now(storage: StorageManager, tier: int) -> dict[str, Any]:
    b = storage.stats()[storage.names[tier]].backend
    return {"pinned_entries": b.pinned_entries, "pinned_bytes": b.pinned_bytes, "pin_budget": b.pin_budget}


# ---- removals ---------------------------------------------------------------------------
def forget_tenant(storage: StorageManager, cache_salt: str) -> tuple[dict[str, int], dict[str, str]]:
    """Removes every stored value of `cache_salt`'s requests from every tier (and the tenant
    from the shared tiers' family index); returns (per tier removed, per tier that failed)."""
    tag = tenant_tag(cache_salt)
    FamilyIndex.of(storage).forget_tenant(tag)
    return storage.delete_prefix(tenant_prefix(tag))


def clear_tiers(storage: StorageManager, local_only: bool = False) -> dict[str, int]:
    """Removes every chunk from every tier (`local_only`: the cpu and device tiers), pins
    included; returns per cleared tier how many entries it held before."""
    cleared = {name for name, t in zip(storage.names, storage.tiers) if not local_only or t.name in LOCAL_TIERS}
    before = {name: s.backend.entries for name, s in storage.stats().items() if name in cleared}
    storage.clear(local_only=local_only)
    return before


# ---- the JSON control ops: vLLM's worker answers them over the lookup channel -------------
Question = Mapping[str, Any]
Answer = dict[str, Any]


class Refused(Exception):
    """A control question refused: the HTTP status, a message naming the problem, the field."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def answer(self) -> Answer:
        """Returns the refusal as a control answer: `{"error": {status, message, param, code}}`."""
        return {"error": {"status": self.status, "message": self.message, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ControlOp:
    """One cache-control operation as a JSON question (`vllm serve`'s `/kv/<name>` route).

    `run(storage, keyspace, question)` answers it on one worker (the keyspace is the question's
    cache_salt's, for this worker's KV heads; Refused, PinError or ValueError refuse it);
    `merge` joins the tensor-parallel ranks' answers into one of the single-rank shape.
    `prompt`: the body names a prompt, tokenized by the route into `token_ids`. `every_rank`:
    asked of every rank (each holds its own KV heads), else of rank 0 alone. `flush`: the
    worker's queued stores land first."""

    run: Callable[[StorageManager, Keyspace, Question], Answer]
    merge: Callable[[list[Answer]], Answer]
    prompt: bool = True
    every_rank: bool = True
    flush: bool = True


def _tier_arg(q: Question) -> str | None:
    tier = q.get("tier")
    if tier is not None and not (isinstance(tier, str) and tier):
        raise Refused(400, "tier must be a tier's kind (cpu, disk), URL or name from inspect", "tier")
    return tier


def _positive(q: Question, field: str) -> float | None:
    value = q.get(field)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
        raise Refused(400, f"{field} must be a number of seconds greater than 0", field)
    return None if value is None else float(value)


def _run_inspect(storage: StorageManager, keyspace: Keyspace, q: Question) -> Answer:
    # vllm serve's clients share one key: usage is shown for the asked tenant alone
    salt = q.get("cache_salt")
    return inspect(storage, keyspace, q["token_ids"], tenant_tag(salt) if salt is not None else False)


def _run_pin(storage: StorageManager, keyspace: Keyspace, q: Question) -> Answer:
    return pin(storage, keyspace, q["token_ids"], _tier_arg(q), _positive(q, "ttl_s"))


def _run_unpin(storage: StorageManager, keyspace: Keyspace, q: Question) -> Answer:
    return unpin(storage, keyspace, q["token_ids"], _tier_arg(q))


CLEAR_FIELDS = ("cache_salt", "all", "older_than_s", "local_only")


def _run_clear(storage: StorageManager, keyspace: Keyspace, q: Question) -> Answer:
    extra = sorted(set(q) - {"op", *CLEAR_FIELDS})
    if extra:
        raise Refused(400, f"/kv/clear takes {', '.join(CLEAR_FIELDS)}; not {', '.join(extra)}", extra[0])
    for flag in ("all", "local_only"):
        if not isinstance(q.get(flag, False), bool):
            raise Refused(400, f"{flag} must be true or false", flag)
    older = _positive(q, "older_than_s")
    salt = q.get("cache_salt")
    if [salt is not None, q.get("all", False), older is not None].count(True) != 1:
        raise Refused(400, "give exactly one of cache_salt, all (true) or older_than_s", "all")
    if salt is not None:
        removed, errors = forget_tenant(storage, salt)
        return {"cleared": "tenant", "tiers": removed, "errors": errors}
    if older is None:
        return {"cleared": "all", "tiers": clear_tiers(storage, bool(q.get("local_only", False)))}
    removed, errors = storage.delete_idle(older)
    return {"cleared": "idle", "older_than_s": older, "tiers": removed, "errors": errors}


def answer_control(storage: StorageManager, keyspace: Keyspace, question: Question,
                   flush: Callable[[], object] | None = None) -> Answer:
    """Returns the answer to a JSON control question (`{"op": name, ...}`, CONTROL_OPS) from
    this worker's tiers, the keyspace narrowed to its `cache_salt`; a refusal or failure as
    `{"error": {status, message, param, code}}`, never raised. `flush` lands queued stores."""
    name = question.get("op")
    op = CONTROL_OPS.get(name) if isinstance(name, str) else None
    try:
        if op is None:
            raise Refused(400, f"unknown control op {name!r} (known: {', '.join(CONTROL_OPS)})", "op")
        try:
            salt = validate_cache_salt(question.get("cache_salt"))
        except ValueError as exc:
            raise Refused(400, str(exc), "cache_salt") from None
        ids = question.get("token_ids")
        if op.prompt and not (isinstance(ids, list) and ids and all(type(t) is int and t >= 0 for t in ids)):
            raise Refused(400, "token_ids must be a non-empty list of non-negative integers", "prompt_token_ids")
        if op.flush and flush is not None:
            flush()
        return op.run(storage, keyspace.for_salt(salt), question)
    except Refused as exc:
        return exc.answer()
    except PinError as exc:
        return Refused(409, str(exc), "tier", "pin_refused").answer()
    except ValueError as exc:  # an unknown tier
        return Refused(400, str(exc), "tier").answer()
    except Exception as exc:  # a tier's failure: answered, never a dropped channel
        log.exception("control op %s failed", name)
        return Refused(500, f"{name} failed: {type(exc).__name__}: {exc}").answer()


# ---- joining the tensor-parallel ranks' answers ---------------------------------------------
def _total(values: Sequence[Any]) -> Any:
    """Returns the sum of numbers (None if any is None), all() of booleans."""
    if all(isinstance(v, bool) for v in values):
        return all(values)
    return None if any(v is None for v in values) else sum(values)


def _sum_maps(maps: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Returns per key (rank 0's keys) the total of the ranks' values."""
    return {k: _total([m.get(k) for m in maps]) for k in maps[0]}


def _sum_tier_totals(tiers: Sequence[Mapping[str, Mapping[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, first in tiers[0].items():
        ranks = [t.get(name, {}) for t in tiers]
        merged = {k: _total([r.get(k) for r in ranks]) for k in first if k != "by_tenant"}
        usage = [r.get("by_tenant") for r in ranks]
        merged["by_tenant"] = None if any(u is None for u in usage) else {
            tag: _sum_maps([u.get(tag, {"entries": 0, "bytes": 0}) for u in usage if u is not None])
            for tag in sorted({tag for u in usage if u is not None for tag in u})}
        out[name] = merged
    return out


def merge_inspect(answers: list[Answer]) -> Answer:
    """Returns one inspect answer from every rank's: a chunk is in a tier when every rank holds
    its heads of it (figures joined as one chunk's values are), tier totals summed."""
    if len(answers) == 1:
        return answers[0]
    chunks = []
    for c, chunk in enumerate(answers[0]["chunks"]):
        where = [a["chunks"][c]["tiers"] for a in answers]
        tiers = {}
        for name in chunk["tiers"]:
            figures = [w.get(name) for w in where]
            infos = [None if f is None else EntryInfo(f["bytes"], f["age_s"], f["idle_s"], f["pinned"],
                                                      f["pin_expires_in_s"]) for f in figures]
            if (merged := _merge(infos)) is not None:
                tiers[name] = merged
        chunks.append({**chunk, "tiers": tiers})
    return {**answers[0], "chunks": chunks, "tiers": _sum_tier_totals([a["tiers"] for a in answers])}


_PINS = ("pinned_entries", "pinned_bytes", "pin_budget")


def merge_pins(answers: list[Answer]) -> Answer:
    """Returns one pin or unpin answer: the chunks and tokens every rank pinned (the least),
    bytes, releases and the tier's pins summed."""
    first = answers[0]
    out = {**first, **_sum_maps([{k: a[k] for k in (*_PINS, "new_bytes", "released") if k in a} for a in answers])}
    for least in ("chunks", "tokens"):
        if least in first:
            out[least] = min(a[least] for a in answers)
    return out


def merge_clear(answers: list[Answer]) -> Answer:
    """Returns one clear answer: per tier the ranks' removals summed, each rank's errors."""
    if len(answers) == 1:
        return answers[0]
    out = {**answers[0], "tiers": _sum_maps([a["tiers"] for a in answers])}
    if "errors" in out:
        out["errors"] = {name: "; ".join(f"rank {r}: {a['errors'][name]}" for r, a in enumerate(answers)
                                         if name in a["errors"])
                         for name in sorted({n for a in answers for n in a["errors"]})}
    return out


CONTROL_OPS: dict[str, ControlOp] = {
    "inspect": ControlOp(_run_inspect, merge_inspect, flush=False),
    "pin": ControlOp(_run_pin, merge_pins),
    "unpin": ControlOp(_run_unpin, merge_pins, flush=False),
    "clear": ControlOp(_run_clear, merge_clear, prompt=False),
}
"""The control ops by name (vllm serve's route `/kv/<name>`): a new one is one entry here."""
