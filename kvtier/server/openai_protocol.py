"""OpenAI wire format: request models (unknown fields ignored, as OpenAI does) and errors."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from kvkeys.tenants import validate_cache_salt
from kvstore.sizes import parse_size


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """The sampling fields completions and chat share, plus vLLM's extra body fields. Ranges
    are checked by `SamplingParams` (engine/sampling_params.py), whose errors name the field."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1)
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None  # JSON keys are strings: token ids
    # vLLM extra body fields (`extra_body=` in the openai client)
    top_k: int = Field(default=-1, ge=-1)
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM's: the request shares cached K/V only with requests of the same salt
    cache_salt: str | None = None

    _check_cache_salt = field_validator("cache_salt")(lambda cls, v: validate_cache_salt(v))


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    # 0 only with `echo`: the prompt is scored, nothing generated (lm-eval's loglikelihood call)
    max_tokens: int | None = Field(default=None, ge=0)
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1)


# Content part types that carry an image (OpenAI's chat and responses APIs, transformers' templates).
_IMAGE_PARTS = ("image_url", "input_image", "image")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """Returns the message's text (the text parts of a multi-part content, joined)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            kind = part.get("type")
            if kind in _IMAGE_PARTS:
                raise ValueError(f"messages: image input is not supported (a {kind!r} content part): "
                                 "this server runs text-only prompts")
            if kind != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"messages: only text content parts are supported, got {kind!r}")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None


class TokenizeRequest(BaseModel):
    """`POST /tokenize` (vLLM's): a `prompt`, or `messages` rendered with the chat template."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    """`POST /detokenize` (vLLM's)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]


class LookupRequest(BaseModel):
    """`POST /kv/lookup`: exactly one of the three prompt forms."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    cache_salt: str | None = None  # only this salt's entries count (none: only unsalted ones)
    explain: bool = False  # also say per tier why it holds no more (connector/explain.py)

    _check_cache_salt = field_validator("cache_salt")(lambda cls, v: validate_cache_salt(v))


class TierRequest(LookupRequest):
    """`POST /kv/unpin` and `/kv/drop` (operator only): a prompt (as `/kv/lookup` takes it) and
    one tier (None: the fastest)."""

    tier: str | None = None


class PinRequest(TierRequest):
    """`POST /kv/pin` (operator only): a prompt, the tier, and how long the pin holds (None:
    until unpinned)."""

    ttl_s: float | None = Field(default=None, gt=0)


class PrefetchRequest(TierRequest):
    """`POST /kv/prefetch` (operator only): a prompt, the tier to fill (None: the fastest), and
    whether to run the prompt as a request first (`compute`: what no tier holds is computed
    and stored)."""

    compute: bool = False


class MoveRequest(LookupRequest):
    """`POST /kv/move` (operator only): a prompt and the tiers to move its chunks from and to."""

    from_tier: str
    to_tier: str


class ClearRequest(BaseModel):
    """`POST /kv/clear` (operator only): exactly one of a tenant's `cache_salt`, `all`,
    `older_than_s` (chunks not used for that long) or `stored_model` (every chunk of that model,
    as inspect's `by_model` names it, any tenant); `local_only` limits `all` to the cpu and
    device tiers."""

    model_config = ConfigDict(extra="forbid")

    cache_salt: str | None = None
    stored_model: str | None = Field(default=None, min_length=1)
    all: bool = False
    older_than_s: float | None = Field(default=None, gt=0)
    local_only: bool = False

    _check_cache_salt = field_validator("cache_salt")(lambda cls, v: validate_cache_salt(v))


class BudgetRequest(BaseModel):
    """`POST /kv/budget` (operator only): the tier (None: the fastest) and at least one of its
    limits to change, each a byte count or a size ("1GiB"); None: unchanged."""

    model_config = ConfigDict(extra="forbid")

    tier: str | None = None
    budget: int | None = None
    pin_budget: int | None = None
    tenant_quota: int | None = None

    @field_validator("budget", "pin_budget", "tenant_quota", mode="before")
    @classmethod
    def _size(cls, value: Any, info: ValidationInfo) -> int | None:
        return parse_size(value, info.field_name or "size")


class ForgetTenantRequest(BaseModel):
    """`POST /kv/forget_tenant` (operator only): the tenant's salt."""

    cache_salt: str

    _check_cache_salt = field_validator("cache_salt")(lambda cls, v: validate_cache_salt(v))


class APIError(Exception):
    """An error answered in OpenAI's shape: `{"error": {message, type, param, code}}`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        """Returns the HTTP response that answers this error."""
        return JSONResponse(self.body(), status_code=self.status)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """Returns OpenAI's `usage` object, `prompt_tokens_details.cached_tokens` included."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}
