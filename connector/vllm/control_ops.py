"""The cache-control operations as JSON questions, for `vllm serve`: its route
(connector/vllm/lookup_route.py, `/kv/<name>` per entry of `CONTROL_OPS`) asks each worker over
the lookup channel (`ControlQuestion`), the worker answers from its own tiers with connector/
cache_control.py's functions (`answer_control`), and the route joins the tensor-parallel ranks'
answers into the single-rank shape `kvtier serve` gives (the `merge` of each op).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from connector.cache_control import (
    NoSuchModel,
    clear_model,
    clear_tiers,
    drop,
    forget_tenant,
    inspect,
    merge_figures,
    move,
    pin,
    prefetch,
    set_budget,
    unpin,
)
from kvkeys.keyspace import Keyspace
from kvkeys.tenants import tenant_tag, validate_cache_salt
from kvstore.backend import EntryInfo
from kvstore.budget import BudgetError
from kvstore.pin_set import PinError
from kvstore.sizes import parse_size
from kvstore.storage_manager import StorageManager

log = logging.getLogger(__name__)

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
    return None if q.get("tier") is None else _tier_name(q, "tier")


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


CLEAR_FIELDS = ("cache_salt", "all", "older_than_s", "stored_model", "local_only")


def _run_clear(storage: StorageManager, keyspace: Keyspace, q: Question) -> Answer:
    extra = sorted(set(q) - {"op", *CLEAR_FIELDS})
    if extra:
        raise Refused(400, f"/kv/clear takes {', '.join(CLEAR_FIELDS)}; not {', '.join(extra)}", extra[0])
    for flag in ("all", "local_only"):
        if not isinstance(q.get(flag, False), bool):
            raise Refused(400, f"{flag} must be true or false", flag)
    older = _positive(q, "older_than_s")
    salt, model = q.get("cache_salt"), q.get("stored_model")
    if model is not None and not (isinstance(model, str) and model):
        raise Refused(400, "stored_model must be a model's name (as inspect's by_model shows it)", "stored_model")
    if [salt is not None, q.get("all", False), older is not None, model is not None].count(True) != 1:
        raise Refused(400, "give exactly one of cache_salt, all (true), older_than_s or stored_model", "all")
    if model is not None:
        try:
            removed, errors = clear_model(storage, model)
        except NoSuchModel as e:
            raise Refused(404, str(e), "stored_model") from None
        return {"cleared": "model", "stored_model": model, "tiers": removed, "errors": errors}
    if salt is not None:
        removed, errors = forget_tenant(storage, salt)
        return {"cleared": "tenant", "tiers": removed, "errors": errors}
    if older is None:
        return {"cleared": "all", "tiers": clear_tiers(storage, bool(q.get("local_only", False)))}
    removed, errors = storage.operations.delete_idle(older)
    return {"cleared": "idle", "older_than_s": older, "tiers": removed, "errors": errors}


def _run_prefetch(storage: StorageManager, keyspace: Keyspace, q: Question) -> Answer:
    # `compute` (the prompt run first) is the route's part: it runs it through vLLM itself
    if not isinstance(q.get("compute", False), bool):
        raise Refused(400, "compute must be true or false", "compute")
    return {**prefetch(storage, keyspace, q["token_ids"], _tier_arg(q)), "ran_request": None}


def _tier_name(q: Question, field: str) -> str:
    """Returns the tier the question's `field` names; Refused (400) unless a non-empty string."""
    tier = q.get(field)
    if not (isinstance(tier, str) and tier):
        raise Refused(400, f"{field} must be a tier's kind (cpu, disk), URL or name from inspect", field)
    return tier


def _run_move(storage: StorageManager, keyspace: Keyspace, q: Question) -> Answer:
    return move(storage, keyspace, q["token_ids"], _tier_name(q, "from_tier"), _tier_name(q, "to_tier"))


def _run_drop(storage: StorageManager, keyspace: Keyspace, q: Question) -> Answer:
    return drop(storage, keyspace, q["token_ids"], _tier_arg(q))


def _size(q: Question, field: str) -> int | None:
    try:
        return parse_size(q.get(field), field)
    except (TypeError, ValueError) as exc:
        raise Refused(400, str(exc), field) from None


def _run_budget(storage: StorageManager, keyspace: Keyspace, q: Question) -> Answer:
    sizes = {f: _size(q, f) for f in ("budget", "pin_budget", "tenant_quota")}
    return set_budget(storage, _tier_arg(q), sizes["budget"], sizes["pin_budget"], sizes["tenant_quota"])


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
    except BudgetError as exc:
        return Refused(409, str(exc), "budget", "budget_refused").answer()
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


_USAGE = ("by_tenant", "by_model")


def _sum_tier_totals(tiers: Sequence[Mapping[str, Mapping[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, first in tiers[0].items():
        ranks = [t.get(name, {}) for t in tiers]
        merged = {k: _total([r.get(k) for r in ranks]) for k in first if k not in _USAGE}
        for by in _USAGE:
            usage = [r.get(by) for r in ranks]
            merged[by] = None if any(u is None for u in usage) else {
                label: _sum_maps([u.get(label, {"entries": 0, "bytes": 0}) for u in usage if u is not None])
                for label in sorted({label for u in usage if u is not None for label in u})}
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
            if (merged := merge_figures(infos)) is not None:
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


def merge_least(answers: list[Answer]) -> Answer:
    """Returns one prefetch, move or drop answer: of each count, the least any rank reached
    (per tier for `copied` and `held_tokens`), `removed` and `refused` summed."""
    first = answers[0]
    out = dict(first)
    for key, value in first.items():
        if key in ("removed", "refused"):
            out[key] = sum(a[key] for a in answers)
        elif isinstance(value, int) and not isinstance(value, bool):
            out[key] = min(a[key] for a in answers)
        elif key in ("copied", "held_tokens") and isinstance(value, dict):
            out[key] = {k: min(a[key].get(k, 0) for a in answers) for k in value}
    return out


def merge_budget(answers: list[Answer]) -> Answer:
    """Returns one budget answer: the tier's figures summed over the ranks (each its own tier)."""
    name = answers[0]["tier"]
    figures = [{name: {k: v for k, v in a.items() if k != "tier"}} for a in answers]
    return {"tier": name, **_sum_tier_totals(figures)[name]}


CONTROL_OPS: dict[str, ControlOp] = {
    "inspect": ControlOp(_run_inspect, merge_inspect, flush=False),
    "pin": ControlOp(_run_pin, merge_pins),
    "unpin": ControlOp(_run_unpin, merge_pins, flush=False),
    "prefetch": ControlOp(_run_prefetch, merge_least),
    "move": ControlOp(_run_move, merge_least),
    "drop": ControlOp(_run_drop, merge_least),
    "clear": ControlOp(_run_clear, merge_clear, prompt=False),
    "budget": ControlOp(_run_budget, merge_budget, prompt=False, flush=False),
}
"""The control ops by name (vllm serve's route `/kv/<name>`): a new one is one entry here."""
