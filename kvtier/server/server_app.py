"""The FastAPI application: OpenAI routes, vLLM's `/tokenize` and `/detokenize`, `/kv/*` admin
routes, health, version, metrics.

`/v1/*`, `/tokenize`, `/detokenize` and `/kv/*` need `Authorization: Bearer <api key>` when
the server has one (with `--tenants`, a tenant's key too, which fixes the request's
`cache_salt`: kvtier/server/tenant_auth.py; `/kv/forget_tenant`, `/kv/reset_prefix_cache`, and of
the cache's operation routes (kvtier/server/cache_routes.py) all but `/kv/inspect` take the
operator's key only);
`/health`, `/version` and `/metrics` are open (as in vLLM). Every error is OpenAI's shape
(kvtier/server/http_edge.py, shared with the router).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvtier import __version__
from kvtier.server.cache_routes import add_cache_routes, prompt_ids
from kvtier.server.http_edge import MAX_BODY_BYTES, install_edge
from kvtier.server.openai_protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ForgetTenantRequest,
    LookupRequest,
    TokenizeRequest,
    now,
)
from kvtier.server.server_metrics import ServerMetrics
from kvtier.server.serving import ServingContext, check_model, create_chat_completion, create_completion, render_chat
from kvtier.server.tenant_auth import Tenancy, TenantKeys

logger = logging.getLogger("kvtier.server")


def build_app(ctx: ServingContext, metrics: ServerMetrics, api_key: str | None = None,
              max_body_bytes: int = MAX_BODY_BYTES, tenants: TenantKeys | None = None) -> FastAPI:
    """Returns the server's application over a started engine loop."""
    app = FastAPI(title="kvtier", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
    front = ctx.engine_loop  # every engine access goes through it
    tenancy = Tenancy(tenants, install_edge(app, api_key, logger, max_body_bytes))
    auth, admin = tenancy.user, tenancy.admin

    @app.get("/health")
    async def health() -> Response:
        ok = front.alive
        return Response(status_code=200 if ok else 503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus() -> Response:
        # off the event loop: a scrape asks the tiers for their figures, and a slow tier must
        # never hold /health or the streams
        body = await asyncio.to_thread(generate_latest, metrics.registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=auth)
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": ctx.model_name, "object": "model", "created": now(),
                                            "owned_by": "kvtier", "root": front.model_path,
                                            "max_model_len": front.max_model_len}]}

    @app.post("/v1/completions", dependencies=auth)
    async def completions(body: CompletionRequest, request: Request) -> Any:
        body.cache_salt = tenancy.salt(request, body.cache_salt)
        return await create_completion(ctx, body, request)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat(body: ChatCompletionRequest, request: Request) -> Any:
        body.cache_salt = tenancy.salt(request, body.cache_salt)
        return await create_chat_completion(ctx, body, request)

    @app.post("/tokenize", dependencies=auth)
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        """vLLM's /tokenize: a prompt's token ids (special tokens added unless
        `add_special_tokens` is false), or a conversation's after the chat template (special
        tokens not added again unless asked), with `max_model_len`."""
        check_model(ctx, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")
        tok = front.tokenizer
        if body.messages is not None:
            text = render_chat(front, body.messages, body.add_generation_prompt)
            special = bool(body.add_special_tokens)
        else:
            text, special = body.prompt or "", body.add_special_tokens is not False
        ids = list(tok.encode(text, add_special_tokens=special))
        return {"count": len(ids), "max_model_len": front.max_model_len, "tokens": ids,
                "token_strs": list(tok.convert_ids_to_tokens(ids)) if body.return_token_strs else None}

    @app.post("/detokenize", dependencies=auth)
    async def detokenize(body: DetokenizeRequest) -> dict[str, str]:
        """vLLM's /detokenize: the text of token ids."""
        check_model(ctx, body.model)
        vocab = front.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens holds {bad[:5]}, not token ids in [0, {vocab})", param="tokens")
        return {"prompt": str(front.tokenizer.decode(body.tokens))}

    @app.post("/kv/lookup", dependencies=auth)
    async def lookup(body: LookupRequest, request: Request) -> dict[str, Any]:
        """How many leading tokens the engine's prefix cache and each tier hold for the
        request's cache_salt (only its entries count), and the engine's load (what a KV-aware
        router needs); runs, loads and counts nothing."""
        check_model(ctx, body.model)
        salt = tenancy.salt(request, body.cache_salt)
        ids = prompt_ids(front, body)
        found = await front.lookup(ids, salt)
        answer = {"model": ctx.model_name, "num_tokens": found.num_tokens,
                  "engine_prefix_cache_tokens": found.engine_prefix_cache_tokens, "tiers": found.tiers,
                  "max_hit_tokens": found.max_hit_tokens, "num_requests_running": found.num_requests_running,
                  "num_requests_waiting": found.num_requests_waiting}
        if body.explain:  # only the operator learns of other tenants' entries
            answer["explain"] = await front.explain(ids, salt, other_tenants=tenancy.is_operator(request))
        return answer

    @app.post("/kv/forget_tenant", dependencies=admin)
    async def forget_tenant(body: ForgetTenantRequest) -> dict[str, Any]:
        """Removes every entry of one cache_salt from the engine's prefix cache and every tier
        (the cache server and Redis included); answers what was removed and which tiers failed."""
        return await front.forget_tenant(body.cache_salt)

    @app.post("/kv/reset_prefix_cache", dependencies=admin)
    async def reset_prefix_cache() -> dict[str, bool]:
        """Drops the engine's prefix cache (refused, `reset: false`, while requests hold blocks)."""
        return {"reset": await front.reset_prefix_cache()}

    add_cache_routes(app, ctx, tenancy)  # /kv/inspect, /kv/pin, /kv/unpin, /kv/clear, /kv/budget
    return app
