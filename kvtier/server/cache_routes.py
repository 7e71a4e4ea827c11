"""The routes that operate the cache (`kvtier cache ...`, kvtier/cmd_cache.py, is their
client; docs/serving.md, "Operating the cache"):

- `POST /kv/inspect` (any key, like `/kv/lookup`; a tenant's key sees its own salt and only
  its own tenant's usage): a prompt's chunks, which tiers hold each (bytes, age, last use,
  pin), and per tier its totals;
- `POST /kv/pin`, `POST /kv/unpin` (operator's key): pin a prompt's held prefix in one tier
  against eviction, within that tier's pin budget, optionally for `ttl_s` seconds; release it;
- `POST /kv/prefetch` (operator's key): copy a prompt's held prefix into one tier (default the
  fastest) from the others; with `compute`, run the prompt first so what no tier holds is
  computed and stored (warm a document before traffic);
- `POST /kv/move`, `POST /kv/drop` (operator's key): move a prompt's chunks from one tier to
  another; remove them from one tier;
- `POST /kv/clear` (operator's key): one tenant's entries (what `/kv/forget_tenant` does),
  one model's (`stored_model`), everything (the engine's prefix cache, as `/kv/reset_prefix_cache`, and every tier), or
  the chunks not used for `older_than_s` seconds.
- `POST /kv/budget` (operator's key): one tier's byte budget, pin budget and per-tenant quota
  changed at run time, evicting at once to meet them; answers the tier's figures after.

The work runs off the event loop (tier calls may touch the disk or the network) and off the
engine thread (no step waits for it).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request

from connector.cache_control import NoSuchModel
from connector.engine_connector import EngineConnector
from engine.sampling_params import SamplingParams
from kvkeys.tenants import tenant_tag
from kvstore.budget import BudgetError
from kvstore.pin_set import PinError
from kvtier.server.engine_loop import EngineLoop
from kvtier.server.openai_protocol import (
    APIError,
    BudgetRequest,
    ClearRequest,
    LookupRequest,
    MoveRequest,
    PinRequest,
    PrefetchRequest,
    TierRequest,
    new_id,
)
from kvtier.server.serving import ServingContext, check_model, collect_finals, render_chat, submit
from kvtier.server.tenant_auth import Tenancy


def prompt_ids(front: EngineLoop, body: LookupRequest) -> list[int]:
    """Returns the token ids of the body's one prompt form (`prompt`, `prompt_token_ids` or
    `messages`), as a request would run them (segments, token-id checks); APIError 400 else."""
    forms = [f for f in ("prompt", "prompt_token_ids", "messages") if getattr(body, f) is not None]
    if len(forms) != 1:
        raise APIError(400, "give exactly one of prompt, prompt_token_ids or messages", param="prompt")
    prompt: str | dict[str, list[int]]
    if body.prompt_token_ids is not None:
        prompt = {"prompt_token_ids": list(body.prompt_token_ids)}
    else:
        prompt = body.prompt if body.prompt is not None else render_chat(front, body.messages or [])
    try:  # never queued
        return front.make_sequence(prompt, SamplingParams(max_tokens=1), new_id("kv")).prompt_token_ids
    except ValueError as exc:
        raise APIError(400, str(exc), param="prompt") from None


def _connector(front: EngineLoop) -> EngineConnector:
    connector = front.connector
    if connector is None:
        raise APIError(400, "this server has no KV tiers (start it with --kv-tier or --config)")
    return connector


def add_cache_routes(app: FastAPI, ctx: ServingContext, tenancy: Tenancy) -> None:
    """Adds `/kv/inspect`, `/kv/pin`, `/kv/unpin`, `/kv/prefetch`, `/kv/move`, `/kv/drop`,
    `/kv/clear` and `/kv/budget` to `app`."""
    front = ctx.engine_loop

    def asked(body: LookupRequest) -> tuple[list[int], EngineConnector]:
        """Returns the body's prompt as token ids and the connector to ask; APIError 400 (or
        404 for another model) otherwise."""
        check_model(ctx, body.model)
        return prompt_ids(front, body), _connector(front)

    @app.post("/kv/inspect", dependencies=tenancy.user)
    async def inspect(body: LookupRequest, request: Request) -> dict[str, Any]:
        """The prompt's chunks for the request's cache_salt and where each is held, and per
        tier its totals; reads nothing but the tiers' indexes (no K/V)."""
        ids, connector = asked(body)
        salt = tenancy.salt(request, body.cache_salt)
        # a tenant's key sees only its own tenant's usage; the operator's every tenant's
        tenants: str | bool = tenant_tag(salt) if tenancy.is_tenant(request) and salt is not None else True
        found = await asyncio.to_thread(connector.inspect, ids, salt, tenants)
        engine_tokens = await asyncio.to_thread(front.cached_prefix_tokens, ids, salt)
        return {"model": ctx.model_name, "engine_prefix_cache_tokens": engine_tokens, **found}

    @app.post("/kv/pin", dependencies=tenancy.admin)
    async def pin(body: PinRequest) -> dict[str, Any]:
        """Pins the prompt's leading chunks the tier holds (all or none)."""
        ids, connector = asked(body)
        return await _control(connector.pin, ids, body.cache_salt, body.tier, body.ttl_s)

    @app.post("/kv/unpin", dependencies=tenancy.admin)
    async def unpin(body: TierRequest) -> dict[str, Any]:
        """Releases the pins of the prompt's chunks in the tier."""
        ids, connector = asked(body)
        return await _control(connector.unpin, ids, body.cache_salt, body.tier)

    @app.post("/kv/prefetch", dependencies=tenancy.admin)
    async def prefetch(body: PrefetchRequest, request: Request) -> dict[str, Any]:
        """Fills the tier with the prompt's held prefix; with `compute`, runs the prompt first."""
        ids, connector = asked(body)
        await _control(connector.storage.operations.name, body.tier)  # an unknown tier is a 400 before any work
        ran: dict[str, Any] | None = None
        if body.compute:
            seq = front.make_sequence(_salted(ids, body.cache_salt), SamplingParams(max_tokens=1), new_id("kv") + "-0")
            try:
                front.check_request(seq)
            except ValueError as exc:
                raise APIError(400, str(exc), param="prompt") from None
            (out,) = await collect_finals(request, submit(ctx, [seq]))
            ran = {"prompt_tokens": len(ids), "cached_tokens": out.num_cached_tokens}
        return {**await _control(connector.prefetch, ids, body.cache_salt, body.tier), "ran_request": ran}

    @app.post("/kv/move", dependencies=tenancy.admin)
    async def move(body: MoveRequest) -> dict[str, Any]:
        """Moves the prompt's chunks from one tier into another."""
        ids, connector = asked(body)
        return await _control(connector.move, ids, body.cache_salt, body.from_tier, body.to_tier)

    @app.post("/kv/drop", dependencies=tenancy.admin)
    async def drop(body: TierRequest) -> dict[str, Any]:
        """Removes the prompt's chunks from the tier, pinned or not."""
        ids, connector = asked(body)
        return await _control(connector.drop, ids, body.cache_salt, body.tier)

    @app.post("/kv/clear", dependencies=tenancy.admin)
    async def clear(body: ClearRequest) -> dict[str, Any]:
        """Removes one tenant's entries, one model's, everything, or what was not used for a while."""
        given = [body.cache_salt is not None, body.all, body.older_than_s is not None, body.stored_model is not None]
        if sum(given) != 1:
            raise APIError(400, "give exactly one of cache_salt, all (true), older_than_s or stored_model", param="all")
        if body.cache_salt is not None:
            return {"cleared": "tenant", **await front.forget_tenant(body.cache_salt)}
        if body.all:
            return {"cleared": "all", **await front.clear_all(body.local_only)}
        if body.stored_model is not None:
            connector = _connector(front)
            # the served name means the served model: its chunks are keyed by its fingerprint
            model = connector.planner.keyspace.model if body.stored_model == ctx.model_name else body.stored_model
            try:
                removed, errors = await asyncio.to_thread(connector.clear_model, model)
            except NoSuchModel as e:
                raise APIError(404, str(e), param="stored_model") from None
            return {"cleared": "model", "stored_model": model, "tiers": removed, "errors": errors}
        assert body.older_than_s is not None
        removed, errors = await asyncio.to_thread(_connector(front).clear_idle, body.older_than_s)
        return {"cleared": "idle", "older_than_s": body.older_than_s, "tiers": removed, "errors": errors}

    @app.post("/kv/budget", dependencies=tenancy.admin)
    async def budget(body: BudgetRequest) -> dict[str, Any]:
        """Changes one tier's limits, evicting at once to meet them; the tier's figures after."""
        if body.budget is None and body.pin_budget is None and body.tenant_quota is None:
            raise APIError(400, "give at least one of budget, pin_budget and tenant_quota", param="budget")
        connector = _connector(front)
        return await _control(connector.set_budget, body.tier, body.budget, body.pin_budget, body.tenant_quota)


def _salted(ids: list[int], cache_salt: str | None) -> dict[str, Any]:
    """Returns the engine prompt of `ids` under `cache_salt`."""
    return {"prompt_token_ids": ids} if cache_salt is None else {"prompt_token_ids": ids, "cache_salt": cache_salt}


async def _control(fn: Any, *args: Any) -> Any:
    """Returns `fn(*args)` run off the event loop; a refused pin or budget is 409, an unknown
    tier (or a malformed limit) 400."""
    try:
        result = await asyncio.to_thread(fn, *args)
    except PinError as exc:
        raise APIError(409, str(exc), param="tier", code="pin_refused") from None
    except BudgetError as exc:
        raise APIError(409, str(exc), param="budget", code="budget_refused") from None
    except ValueError as exc:
        raise APIError(400, str(exc), param="tier") from None
    return result
