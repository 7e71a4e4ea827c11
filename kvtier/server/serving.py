"""Completions and chat over the engine loop: OpenAI request -> engine requests -> response.

Non-streaming calls answer once every request finished; streaming calls send one SSE chunk
per step with the text that became final (text that could still turn out to be the start of
a stop string is held back until it cannot). A client that disconnects aborts its requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from kvtier.server.engine_loop import (
    ClientDisconnected,
    EngineDeadError,
    EngineFailedError,
    EngineLoop,
    QueueFullError,
    RequestStream,
)
from kvtier.server.protocol import (
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingRequest,
    new_id,
    now,
    usage,
)

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
STORE_FLUSH_TIMEOUT_S = 30.0

logger = logging.getLogger("kvtier.server")


@dataclass
class ServingContext:
    engine_loop: EngineLoop  # the handlers' only way to the engine
    model_name: str
    # "producer": one token per request, answered once its K/V reached every tier (the
    # router's prefill step); "consumer" and "both" serve normally.
    kv_role: str = "both"


def check_model(ctx: ServingContext, model: str | None) -> None:
    """Raises a 404 APIError unless `model` is None or the served name."""
    if model is not None and model != ctx.model_name:
        raise APIError(404, f"The model `{model}` does not exist (this server serves `{ctx.model_name}`).",
                       "NotFoundError", "model", "model_not_found")


def _unsupported(req: SamplingRequest) -> None:
    if req.n != 1:
        raise APIError(400, f"n={req.n} is not supported: this server returns one choice per prompt (n=1)", param="n")
    if req.best_of not in (None, 1):
        raise APIError(400, "best_of is not supported", param="best_of")
    if req.logprobs not in (None, False, 0):
        raise APIError(400, "logprobs are not supported by this server", param="logprobs")
    if req.echo:
        raise APIError(400, "echo is not supported by this server", param="echo")


def render_chat(engine_loop: EngineLoop, messages: list[ChatMessage]) -> str:
    """Returns `messages` rendered with the model's chat template (generation prompt added)."""
    tok = engine_loop.tokenizer
    if not getattr(tok, "chat_template", None):
        raise APIError(400, "this model has no chat template: use /v1/completions", param="messages")
    try:
        conv = [{"role": m.role, "content": m.text()} for m in messages]
    except ValueError as exc:
        raise APIError(400, str(exc), param="messages") from None
    return str(tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True))


def make_sequences(ctx: ServingContext, prompts: list[Any], req: SamplingRequest, max_tokens: int | None,
                   default_max_tokens: int | None, rid: str) -> list[Sequence]:
    """Returns one validated engine request per prompt. `max_tokens` None takes
    `default_max_tokens` (None: up to the context length). Raises a 400 APIError naming the
    problem (prompt too long, bad sampling field)."""
    front = ctx.engine_loop
    limit = front.max_model_len
    try:
        base = SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, seed=req.seed,
                              max_tokens=1, stop_token_ids=list(req.stop_token_ids or []),
                              stop=[req.stop] if isinstance(req.stop, str) else req.stop or [],
                              include_stop_str_in_output=req.include_stop_str_in_output,
                              ignore_eos=req.ignore_eos)
    except ValueError as exc:
        raise APIError(400, str(exc), param=str(exc).split(" ", 1)[0]) from None
    seqs = []
    for i, prompt in enumerate(prompts):
        try:
            seq = front.make_sequence(prompt, dataclasses.replace(base), f"{rid}-{i}")  # see prompt_index
        except ValueError as exc:
            raise APIError(400, str(exc), param="prompt" if "prompt" in str(exc) else None) from None
        n = seq.num_prompt_tokens
        if n >= limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens; the prompt has {n}, "
                           "which leaves no room for output.", param="prompt", code="context_length_exceeded")
        if max_tokens is None:
            want = limit - n if default_max_tokens is None else min(default_max_tokens, limit - n)
        elif n + max_tokens > limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                           f"{n + max_tokens} tokens ({n} in the prompt, {max_tokens} for the completion).",
                           param="max_tokens", code="context_length_exceeded")
        else:
            want = max_tokens
        seq.sampling_params.max_tokens = 1 if ctx.kv_role == "producer" else want
        try:
            front.check_request(seq)
        except ValueError as exc:
            raise APIError(400, str(exc), param="max_tokens") from None
        seqs.append(seq)
    return seqs


def prompt_index(request_id: str) -> int:
    """Returns the position in its HTTP call's prompt list of an engine request made by
    `make_sequences` (ids are `<call id>-<index>`)."""
    return int(request_id.rsplit("-", 1)[1])


def completion_prompts(req: CompletionRequest) -> list[Any]:
    """Returns the engine prompts of a completion request (strings or token-id dicts)."""
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if not p:
        raise APIError(400, "prompt is empty", param="prompt")
    if all(isinstance(x, int) for x in p):
        return [{"prompt_token_ids": list(p)}]
    if all(isinstance(x, str) for x in p):
        return list(p)
    if all(isinstance(x, list) for x in p):
        return [{"prompt_token_ids": list(x)} for x in p if isinstance(x, list)]  # all are
    raise APIError(400, "prompt must be a string, a list of strings, a list of token ids or a list of those lists",
                   param="prompt")


def _submit(ctx: ServingContext, seqs: list[Sequence]) -> RequestStream:
    try:
        return ctx.engine_loop.submit(seqs)
    except QueueFullError as exc:
        raise APIError(429, str(exc), "rate_limit_error", code="queue_full") from None
    except EngineDeadError as exc:
        raise APIError(503, str(exc), "service_unavailable", code="engine_dead") from None


@contextlib.asynccontextmanager
async def watching(request: Request, stream: RequestStream) -> AsyncIterator[None]:
    """Ends `stream` (aborting its requests) when the HTTP client disconnects, and closes it
    on the way out whatever happened."""

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        stream.cancel(ClientDisconnected())

    watcher = asyncio.create_task(watch())
    try:
        yield
    finally:
        watcher.cancel()
        stream.close()


async def stores_landed(ctx: ServingContext, timeout_s: float = STORE_FLUSH_TIMEOUT_S) -> None:
    """Producer only: returns once every queued K/V store reached its tiers (or after
    `timeout_s`, logged: the consumer then prefills what is missing)."""
    if ctx.kv_role != "producer":
        return
    if not await ctx.engine_loop.flush_stores(timeout_s):
        logger.warning("producer: K/V stores did not land within %.0fs; consumers will prefill the rest", timeout_s)


def _holdback(req: SamplingRequest) -> int:
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    return max((len(s) for s in stops), default=1) - 1


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


def _engine_error(exc: BaseException) -> APIError:
    """Returns the answer to a request the engine could not serve: 500 if it failed while the
    request was in it, 503 if it was already down, 400 if it refused the request."""
    if isinstance(exc, EngineFailedError):
        return APIError(500, str(exc), "internal_error", code="engine_failed")
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), "service_unavailable", code="engine_dead")
    return APIError(400, str(exc))


def _error_event(exc: BaseException) -> str:
    return _sse(_engine_error(exc).body())


@dataclass
class _Totals:
    prompt: int = 0
    completion: int = 0
    cached: int = 0

    def add(self, out: RequestOutput) -> None:
        self.prompt += len(out.prompt_token_ids)
        self.completion += len(out.outputs[0].token_ids)
        self.cached += out.num_cached_tokens

    def usage(self) -> dict[str, Any]:
        return usage(self.prompt, self.completion, self.cached)


async def _collect(request: Request, stream: RequestStream) -> list[RequestOutput]:
    """Returns the final output of each of the stream's requests, in prompt order."""
    finals: dict[str, RequestOutput] = {}
    async with watching(request, stream):
        try:
            async for out in stream:
                if out.finished:
                    finals[out.request_id] = out
        except (EngineDeadError, ValueError) as exc:  # ValueError: refused after validation
            raise _engine_error(exc) from None
        except ClientDisconnected:  # nobody reads the answer; the requests were aborted
            raise APIError(499, "client disconnected", code="client_disconnected") from None
    return [finals[k] for k in sorted(finals, key=prompt_index)]


async def _deltas(
    request: Request, stream: RequestStream, holdback: int
) -> AsyncIterator[tuple[int, str, RequestOutput]]:
    """Yields (prompt index, new final text, output) per output of the stream: the text a
    stop string can no longer take back."""
    sent: dict[str, int] = {}
    async with watching(request, stream):
        async for out in stream:
            text = out.outputs[0].text
            visible = text if out.finished or not holdback else text[: max(len(text) - holdback, 0)]
            start = sent.get(out.request_id, 0)
            if len(visible) > start:
                sent[out.request_id] = len(visible)
            yield prompt_index(out.request_id), visible[start:], out


async def _events(ctx: ServingContext, request: Request, stream: RequestStream, req: SamplingRequest,
                  head: dict[str, Any], choice: Callable[[int, str, RequestOutput], dict[str, Any] | None],
                  first: dict[str, Any] | None = None) -> AsyncIterator[str]:
    """Yields the SSE events of a streamed call: `first` (chat's role chunk), one chunk per
    output that `choice` renders (None: nothing to send), the usage chunk if asked, [DONE];
    an engine failure ends the stream with an error event."""
    totals = _Totals()
    if first is not None:
        yield _sse({**head, "choices": [first]})
    try:
        async for i, delta, out in _deltas(request, stream, _holdback(req)):
            rendered = choice(i, delta, out)
            if rendered is not None:
                yield _sse({**head, "choices": [rendered]})
            if out.finished:
                totals.add(out)
        if req.stream_options is not None and req.stream_options.include_usage:
            yield _sse({**head, "choices": [], "usage": totals.usage()})
        await stores_landed(ctx)
        yield "data: [DONE]\n\n"
    except (EngineDeadError, ValueError) as exc:
        yield _error_event(exc)
    except ClientDisconnected:
        return  # nobody is listening; the requests were aborted


async def create_completion(ctx: ServingContext, req: CompletionRequest, request: Request) -> Any:
    check_model(ctx, req.model)
    _unsupported(req)
    rid = new_id("cmpl")
    seqs = make_sequences(ctx, completion_prompts(req), req, req.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS, rid)
    created = now()
    stream = _submit(ctx, seqs)
    if not req.stream:
        outs = await _collect(request, stream)
        await stores_landed(ctx)
        totals = _Totals()
        choices = []
        for i, out in enumerate(outs):
            totals.add(out)
            c = out.outputs[0]
            choices.append({"index": i, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason,
                            "stop_reason": c.stop_reason})
        return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": ctx.model_name,
                             "choices": choices, "usage": totals.usage()})

    def choice(i: int, delta: str, out: RequestOutput) -> dict[str, Any] | None:
        if not (delta or out.finished):
            return None
        c = out.outputs[0]
        return {"index": i, "text": delta, "logprobs": None,
                "finish_reason": c.finish_reason if out.finished else None,
                "stop_reason": c.stop_reason if out.finished else None}

    head = {"id": rid, "object": "text_completion", "created": created, "model": ctx.model_name}
    return StreamingResponse(_events(ctx, request, stream, req, head, choice), media_type="text/event-stream")


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest, request: Request) -> Any:
    check_model(ctx, req.model)
    _unsupported(req)
    rid = new_id("chatcmpl")
    prompt = render_chat(ctx.engine_loop, req.messages)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    seqs = make_sequences(ctx, [prompt], req, max_tokens, None, rid)
    created = now()
    stream = _submit(ctx, seqs)
    if not req.stream:
        (out,) = await _collect(request, stream)
        await stores_landed(ctx)
        c = out.outputs[0]
        totals = _Totals()
        totals.add(out)
        return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": ctx.model_name,
                             "choices": [{"index": 0, "message": {"role": "assistant", "content": c.text},
                                          "logprobs": None, "finish_reason": c.finish_reason,
                                          "stop_reason": c.stop_reason}],
                             "usage": totals.usage()})

    def choice(_i: int, delta: str, out: RequestOutput) -> dict[str, Any] | None:
        if not out.finished:
            return {"index": 0, "delta": {"content": delta}, "logprobs": None, "finish_reason": None} if delta else None
        c = out.outputs[0]
        return {"index": 0, "delta": {"content": delta} if delta else {}, "logprobs": None,
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}

    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": ctx.model_name}
    first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    return StreamingResponse(_events(ctx, request, stream, req, head, choice, first), media_type="text/event-stream")
