"""From an OpenAI request to validated engine requests: prompts, `SamplingParams` (every
sampling field, vLLM's meanings) and what the engine must report (n samples, logprobs,
prompt logprobs). Every refusal is a 400 `APIError` naming the field."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from kvtier.server.engine_loop import EngineLoop
from kvtier.server.openai_protocol import (
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingRequest,
)

_PARAM_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


@dataclass
class ServingContext:
    engine_loop: EngineLoop  # the handlers' only way to the engine
    model_name: str
    # "producer": one token per request, answered once its K/V reached every tier (the
    # router's prefill step); "consumer" and "both" serve normally.
    kv_role: str = "both"


@dataclass(frozen=True)
class EngineAsk:
    """What the engine computes per prompt besides the request's sampling fields: `n`
    samples (best_of for completions), `logprobs` per generated token, `prompt_logprobs`."""

    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None


def check_model(ctx: ServingContext, model: str | None) -> None:
    """Raises a 404 APIError unless `model` is None or the served name."""
    if model is not None and model != ctx.model_name:
        raise APIError(404, f"The model `{model}` does not exist (this server serves `{ctx.model_name}`).",
                       "NotFoundError", "model", "model_not_found")


def _check_prompt_logprobs(req: SamplingRequest) -> None:
    if req.prompt_logprobs and req.stream:  # vLLM's rule: they come only with the whole answer
        raise APIError(400, "prompt_logprobs are not available when stream=true", param="prompt_logprobs")


def completion_ask(req: CompletionRequest) -> EngineAsk:
    """Returns what the engine computes for a completion request (vLLM's meanings: `echo`
    with `logprobs` asks for the prompt's logprobs too; `max_tokens=0` with `echo` scores the
    prompt; `best_of` samples are ranked by cumulative logprob, the best `n` returned)."""
    _check_prompt_logprobs(req)
    if req.max_tokens == 0 and not req.echo:
        raise APIError(400, "max_tokens must be >= 1 (0 only with echo=true, to score the prompt)",
                       param="max_tokens")
    best_of = req.best_of if req.best_of is not None else req.n
    if best_of < req.n:
        raise APIError(400, f"best_of must be >= n, got best_of={best_of} and n={req.n}", param="best_of")
    if best_of > req.n and req.stream:
        raise APIError(400, "best_of > n is not available when stream=true (the best are known at the end)",
                       param="best_of")
    if best_of > 1 and req.temperature < 1e-5:
        raise APIError(400, f"n and best_of must be 1 with greedy sampling (temperature 0), got {best_of}",
                       param="best_of" if req.best_of is not None else "n")
    logprobs = req.logprobs
    if logprobs is None and best_of > req.n:
        logprobs = 0  # ranking needs each sample's cumulative logprob
    prompt_logprobs = req.prompt_logprobs
    if prompt_logprobs is None and req.echo:
        prompt_logprobs = req.logprobs
    if prompt_logprobs is None and req.max_tokens == 0:
        prompt_logprobs = 0  # the engine scores a prompt only with prompt logprobs
    return EngineAsk(best_of, logprobs, prompt_logprobs)


def chat_ask(req: ChatCompletionRequest) -> EngineAsk:
    """Returns what the engine computes for a chat request (`top_logprobs` counts only with
    `logprobs=true`, as in vLLM)."""
    _check_prompt_logprobs(req)
    if req.n > 1 and req.temperature < 1e-5:
        raise APIError(400, f"n must be 1 with greedy sampling (temperature 0), got {req.n}", param="n")
    return EngineAsk(req.n, (req.top_logprobs or 0) if req.logprobs else None, req.prompt_logprobs)


def _params(req: SamplingRequest, ask: EngineAsk, max_tokens: int, min_tokens: int,
            logprobs_field: str) -> SamplingParams:
    """Returns the engine's SamplingParams; a 400 naming the request's field if invalid."""
    try:
        return SamplingParams(
            temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, seed=req.seed, max_tokens=max_tokens,
            stop_token_ids=list(req.stop_token_ids or []),
            stop=[req.stop] if isinstance(req.stop, str) else req.stop or [],
            include_stop_str_in_output=req.include_stop_str_in_output, ignore_eos=req.ignore_eos,
            skip_special_tokens=req.skip_special_tokens, n=ask.n, min_p=req.min_p, min_tokens=min_tokens,
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty,
            logit_bias=dict(req.logit_bias) if req.logit_bias is not None else None,  # type: ignore[arg-type]
            allowed_token_ids=req.allowed_token_ids, logprobs=ask.logprobs, prompt_logprobs=ask.prompt_logprobs)
    except ValueError as exc:
        field = str(exc).split(" ", 1)[0]
        raise APIError(400, str(exc), param=logprobs_field if field == "logprobs" else field) from None


def render_chat(engine_loop: EngineLoop, messages: list[ChatMessage], add_generation_prompt: bool = True) -> str:
    """Returns `messages` rendered with the model's chat template (generation prompt added
    unless told otherwise)."""
    tok = engine_loop.tokenizer
    if not getattr(tok, "chat_template", None):
        raise APIError(400, "this model has no chat template: use /v1/completions", param="messages")
    try:
        conv = [{"role": m.role, "content": m.text()} for m in messages]
    except ValueError as exc:
        raise APIError(400, str(exc), param="messages") from None
    return str(tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=add_generation_prompt))


def make_sequences(ctx: ServingContext, prompts: list[Any], req: SamplingRequest, max_tokens: int | None,
                   default_max_tokens: int | None, rid: str, ask: EngineAsk = EngineAsk()) -> list[Sequence]:
    """Returns one validated engine request per prompt (each with `ask.n` samples), under
    `req.cache_salt` (the caller has settled it: kvtier/server/tenant_auth.py).
    `max_tokens` None takes `default_max_tokens` (None: up to the context length). Raises a
    400 APIError naming the problem (prompt too long, bad sampling field)."""
    front = ctx.engine_loop
    limit = front.max_model_len
    if ctx.kv_role == "producer":
        ask = EngineAsk()  # a producer only computes and stores the prompt's K/V: one sample, one token
    logprobs_field = "top_logprobs" if isinstance(req, ChatCompletionRequest) else "logprobs"
    first = max_tokens if max_tokens is not None else 1
    base = _params(req, ask, 1 if ctx.kv_role == "producer" else first, 0, logprobs_field)
    seqs = []
    for i, prompt in enumerate(prompts):
        if req.cache_salt is not None:  # vLLM's prompt dicts carry the salt
            prompt = {**prompt, "cache_salt": req.cache_salt} if isinstance(prompt, dict) else {
                "prompt": prompt, "cache_salt": req.cache_salt}
        try:
            seq = front.make_sequence(prompt, dataclasses.replace(base), f"{rid}-{i}")  # see prompt_index
        except ValueError as exc:  # the prompt, or a token id a sampling field names
            word = str(exc).split(" ", 1)[0]
            param = word if word in _PARAM_FIELDS else "prompt" if "prompt" in str(exc) else None
            raise APIError(400, str(exc), param=param) from None
        n = seq.num_prompt_tokens
        if n >= limit and max_tokens != 0:
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
        if ctx.kv_role == "producer":
            want = 1
        seq.sampling_params = _params(req, ask, want, min(req.min_tokens, want) if ctx.kv_role == "producer"
                                      else req.min_tokens, logprobs_field)
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
