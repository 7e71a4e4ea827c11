"""Completions and chat over the engine loop: OpenAI request -> engine requests -> response.

Non-streaming calls answer once every request finished; streaming calls send one SSE chunk
per choice and step with the text that became final (text that could still turn out to be
the start of a stop string is held back until it cannot) and, if asked, the logprobs of the
step's tokens. An n > 1 request's samples are choices `prompt index x n + sample index`. A
client that disconnects aborts its requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from engine.outputs import CompletionOutput, RequestOutput
from engine.sequence import Sequence
from kvstore.deadlines import STORE_FLUSH_TIMEOUT_S
from kvtier.server.engine_loop import (
    ClientDisconnected,
    EngineDeadError,
    EngineFailedError,
    QueueFullError,
    RequestStream,
)
from kvtier.server.engine_requests import (
    ServingContext,
    chat_ask,
    check_model,
    completion_ask,
    completion_prompts,
    make_sequences,
    prompt_index,
    render_chat,
)
from kvtier.server.logprobs_format import chat_logprobs, completion_logprobs, prompt_logprobs_json
from kvtier.server.openai_protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingRequest,
    new_id,
    now,
    usage,
)

__all__ = ["ServingContext", "check_model", "create_chat_completion", "create_completion", "render_chat"]

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

logger = logging.getLogger("kvtier.server")


def submit(ctx: ServingContext, seqs: list[Sequence]) -> RequestStream:
    """Queues `seqs` on the engine; returns their stream. APIError 429 (queue full) or 503."""
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


@dataclass
class _Totals:
    prompt: int = 0
    completion: int = 0
    cached: int = 0

    def add(self, out: RequestOutput) -> None:
        """Counts a finished request: its prompt once, the tokens of every sample."""
        self.prompt += len(out.prompt_token_ids)
        self.completion += sum(len(c.token_ids) for c in out.outputs)
        self.cached += out.num_cached_tokens

    def usage(self) -> dict[str, Any]:
        return usage(self.prompt, self.completion, self.cached)


async def collect_finals(request: Request, stream: RequestStream) -> list[RequestOutput]:
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


@dataclass
class Delta:
    """What one sample (choice) gained since its last delta."""

    prompt: int  # index of its prompt in the call
    sample: CompletionOutput  # cumulative; `sample.index` is its index among the n
    text: str  # newly final text
    first_token: int  # `sample.token_ids[first_token:]` are new
    first: bool  # its first delta
    out: RequestOutput

    @property
    def finished(self) -> bool:
        return self.sample.finish_reason is not None


async def _deltas(request: Request, stream: RequestStream, holdback: int) -> AsyncIterator[Delta]:
    """Yields a Delta per sample and output of the stream that brought new final text, new
    tokens or the sample's finish (the text a stop string can no longer take back)."""
    sent_text: dict[tuple[str, int], int] = {}
    sent_tokens: dict[tuple[str, int], int] = {}
    done: set[tuple[str, int]] = set()
    async with watching(request, stream):
        async for out in stream:
            for c in out.outputs:
                key = (out.request_id, c.index)
                if key in done:
                    continue
                finished = c.finish_reason is not None
                visible = c.text if finished or not holdback else c.text[: max(len(c.text) - holdback, 0)]
                start, first_token = sent_text.get(key, 0), sent_tokens.get(key, 0)
                if len(visible) <= start and len(c.token_ids) <= first_token and not finished:
                    continue
                first = key not in sent_tokens
                sent_text[key] = max(start, len(visible))
                sent_tokens[key] = len(c.token_ids)
                if finished:
                    done.add(key)
                yield Delta(prompt_index(out.request_id), c, visible[start:], first_token, first, out)


async def _events(ctx: ServingContext, request: Request, stream: RequestStream, req: SamplingRequest,
                  head: dict[str, Any], choice: Callable[[Delta], dict[str, Any] | None],
                  firsts: tuple[dict[str, Any], ...] = ()) -> AsyncIterator[str]:
    """Yields the SSE events of a streamed call: `firsts` (chat's role chunks), one chunk per
    delta that `choice` renders (None: nothing to send), the usage chunk if asked, [DONE];
    an engine failure ends the stream with an error event."""
    totals = _Totals()
    counted: set[str] = set()
    for first in firsts:
        yield _sse({**head, "choices": [first]})
    try:
        async for d in _deltas(request, stream, _holdback(req)):
            rendered = choice(d)
            if rendered is not None:
                yield _sse({**head, "choices": [rendered]})
            if d.out.finished and d.out.request_id not in counted:
                counted.add(d.out.request_id)
                totals.add(d.out)
        if req.stream_options is not None and req.stream_options.include_usage:
            yield _sse({**head, "choices": [], "usage": totals.usage()})
        await stores_landed(ctx)
        yield "data: [DONE]\n\n"
    except (EngineDeadError, ValueError) as exc:
        yield _sse(_engine_error(exc).body())
    except ClientDisconnected:
        return  # nobody is listening; the requests were aborted


def _echo(ctx: ServingContext, out: RequestOutput) -> str:
    """Returns the prompt's text (decoded when it came as token ids)."""
    if out.prompt is not None:
        return out.prompt
    return str(ctx.engine_loop.tokenizer.decode(out.prompt_token_ids))


def _completion_choice(ctx: ServingContext, req: CompletionRequest, out: RequestOutput, c: CompletionOutput,
                       index: int, text: str, first_token: int, echo: bool,
                       offsets: dict[int, int]) -> dict[str, Any]:
    """Returns one completions choice: `text` (the prompt's first if `echo`), the logprobs
    of `c`'s tokens from `first_token` (the prompt's first if `echo`) if asked."""
    token_ids = list(c.token_ids[first_token:])
    positions: list[Any] = list((c.logprobs or [])[first_token:])
    if echo:
        text = _echo(ctx, out) + text
        token_ids = list(out.prompt_token_ids) + token_ids
        positions = list(out.prompt_logprobs or [None] * len(out.prompt_token_ids)) + positions
    logprobs = None
    if req.logprobs is not None:
        logprobs = completion_logprobs(ctx.engine_loop.tokenizer, token_ids, positions, req.logprobs,
                                       offsets.get(index, 0))
        if logprobs["tokens"]:
            offsets[index] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
    choice = {"index": index, "text": text, "logprobs": logprobs,
              "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
    return choice


async def create_completion(ctx: ServingContext, req: CompletionRequest, request: Request) -> Any:
    check_model(ctx, req.model)
    ask = completion_ask(req)
    rid = new_id("cmpl")
    seqs = make_sequences(ctx, completion_prompts(req), req, req.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS, rid, ask)
    created = now()
    stream = submit(ctx, seqs)
    if not req.stream:
        outs = await collect_finals(request, stream)
        await stores_landed(ctx)
        totals = _Totals()
        choices: list[dict[str, Any]] = []
        for out in outs:
            totals.add(out)
            samples = out.outputs
            if ask.n > req.n:  # best_of: the n with the highest cumulative logprob
                samples = sorted(samples, key=lambda c: c.cumulative_logprob or 0.0, reverse=True)[: req.n]
            for c in samples:
                rendered = _completion_choice(ctx, req, out, c, len(choices), c.text, 0, req.echo, {})
                if req.prompt_logprobs is not None:
                    rendered["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs)
                choices.append(rendered)
        return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": ctx.model_name,
                             "choices": choices, "usage": totals.usage()})

    offsets: dict[int, int] = {}

    def choice(d: Delta) -> dict[str, Any] | None:
        c = d.sample
        if not (d.text or d.finished or (req.logprobs is not None and len(c.token_ids) > d.first_token)
                or (req.echo and d.first)):
            return None
        index = d.prompt * req.n + c.index
        rendered = _completion_choice(ctx, req, d.out, c, index, d.text, d.first_token, req.echo and d.first, offsets)
        if not d.finished:
            rendered["finish_reason"] = rendered["stop_reason"] = None
        return rendered

    head = {"id": rid, "object": "text_completion", "created": created, "model": ctx.model_name}
    return StreamingResponse(_events(ctx, request, stream, req, head, choice), media_type="text/event-stream")


def _chat_logprobs(ctx: ServingContext, req: ChatCompletionRequest, c: CompletionOutput,
                   first_token: int = 0) -> dict[str, Any] | None:
    if not req.logprobs:
        return None
    return chat_logprobs(ctx.engine_loop.tokenizer, c.token_ids[first_token:], (c.logprobs or [])[first_token:],
                         req.top_logprobs or 0)


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest, request: Request) -> Any:
    check_model(ctx, req.model)
    ask = chat_ask(req)
    rid = new_id("chatcmpl")
    prompt = render_chat(ctx.engine_loop, req.messages)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    seqs = make_sequences(ctx, [prompt], req, max_tokens, None, rid, ask)
    created = now()
    stream = submit(ctx, seqs)
    if not req.stream:
        (out,) = await collect_finals(request, stream)
        await stores_landed(ctx)
        totals = _Totals()
        totals.add(out)
        body = {"id": rid, "object": "chat.completion", "created": created, "model": ctx.model_name,
                "choices": [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                             "logprobs": _chat_logprobs(ctx, req, c), "finish_reason": c.finish_reason,
                             "stop_reason": c.stop_reason} for c in out.outputs],
                "usage": totals.usage()}
        if req.prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs)
        return JSONResponse(body)

    def choice(d: Delta) -> dict[str, Any] | None:
        c = d.sample
        logprobs = _chat_logprobs(ctx, req, c, d.first_token) if len(c.token_ids) > d.first_token else None
        if not d.finished:
            if not (d.text or logprobs):
                return None
            return {"index": c.index, "delta": {"content": d.text}, "logprobs": logprobs, "finish_reason": None}
        return {"index": c.index, "delta": {"content": d.text} if d.text else {}, "logprobs": logprobs,
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}

    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": ctx.model_name}
    firsts = tuple({"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": None} for j in range(req.n))
    return StreamingResponse(_events(ctx, request, stream, req, head, choice, firsts),
                             media_type="text/event-stream")
