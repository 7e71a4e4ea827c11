"""Per-request sampling parameters (vLLM's `SamplingParams`, the subset this engine serves)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

# Below this temperature sampling is treated as greedy (argmax), as in vLLM.
_GREEDY_EPS = 1e-5
# The most top logprobs a request may ask for per position (vLLM's default `max_logprobs`).
MAX_LOGPROBS = 20
_MAX_LOGIT_BIAS = 100.0  # biases are clamped to [-100, 100], as vLLM and OpenAI do


@dataclass
class SamplingParams:
    """How to pick each next token, what to report about it, and when to stop.

    `temperature == 0` is greedy. `top_k <= 0` (or -1), `top_p == 1.0` and `min_p == 0`
    disable those filters. `seed` makes a sampled request reproducible regardless of what
    else is batched with it; with `n > 1` sample i uses `seed + i` (vLLM).
    Generation stops at an eos token (unless `ignore_eos`), at any of `stop_token_ids`, at any
    of the `stop` strings (matched on the decoded text, which is cut before the stop string
    unless `include_stop_str_in_output`), or after `max_tokens`; a stopping token is included
    in `token_ids` (vLLM behaviour). Before `min_tokens` tokens, eos and `stop_token_ids` are
    masked and stop strings are not matched.

    Logits are changed in vLLM's order: `allowed_token_ids` (all others masked), `min_tokens`,
    `logit_bias` (added), then `repetition_penalty` (prompt and output tokens: positive logits
    divided by it, others multiplied), `frequency_penalty` (minus count in the output) and
    `presence_penalty` (minus once if in the output); then temperature, `min_p`, top-k, top-p.

    `logprobs=k` reports, per generated token, its own logprob and rank plus the top-k;
    `prompt_logprobs=k` the same per prompt token. Both are of the raw model distribution
    (log_softmax of the logits before any of the changes above: vLLM's default
    `logprobs_mode="raw_logprobs"`). A request with `prompt_logprobs` computes its whole
    prompt: it reads neither the engine's prefix cache nor a connector's tiers (vLLM's
    `skip_reading_prefix_cache`). `max_tokens=0` is allowed only with `prompt_logprobs`: it
    scores the prompt and generates nothing.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    min_p: float = 0.0
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if self.logit_bias is not None:
            self.logit_bias = _int_keyed_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        self.validate()

    def validate(self) -> None:
        """Raises ValueError naming the first invalid field."""
        _number("temperature", self.temperature)
        if not self.temperature >= 0.0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        _number("top_p", self.top_p, "a number in (0, 1]")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _int("top_k", self.top_k, "an int (-1 or 0 disables it)")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        _number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _int("seed", self.seed, "an int or None")
        self._validate_lengths()
        self._validate_penalties()
        self._validate_logprobs()
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"stop_token_ids must be non-negative ints, got {t!r}")
        for stop in self.stop:
            if not isinstance(stop, str) or not stop:
                raise ValueError(f"stop must hold non-empty strings, got {stop!r}")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must hold at least one token id")
            for t in self.allowed_token_ids:
                if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                    raise ValueError(f"allowed_token_ids must be non-negative ints, got {t!r}")

    def _validate_lengths(self) -> None:
        _int("n", self.n, "an int >= 1")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.n > 1 and self.greedy:
            raise ValueError(f"n must be 1 when using greedy sampling (temperature 0), got {self.n}")
        _int("max_tokens", self.max_tokens, "an int >= 1")
        if self.max_tokens == 0:
            if self.prompt_logprobs is None:
                raise ValueError("max_tokens must be >= 1 (0 only scores a prompt, with prompt_logprobs), got 0")
            if self.n > 1:
                raise ValueError(f"n must be 1 when max_tokens=0 (scoring a prompt), got {self.n}")
        elif self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        _int("min_tokens", self.min_tokens, "an int >= 0")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens}")

    def _validate_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _number(name, value)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        _number("repetition_penalty", self.repetition_penalty)
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")

    def _validate_logprobs(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is None:
                continue
            _int(name, value, "an int or None")
            if not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}] (the most top logprobs served), "
                                 f"got {value}")

    def verify_vocab(self, vocab_size: int) -> None:
        """Raises ValueError naming the field if a token id it holds is not in [0, vocab_size)."""
        for name, ids in (("logit_bias", list(self.logit_bias or ())), ("allowed_token_ids",
                                                                         self.allowed_token_ids or [])):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"{name} holds token id(s) {bad[:5]} outside the vocabulary [0, {vocab_size})")

    def for_sample(self, index: int) -> SamplingParams:
        """Returns the params of sample `index` of an `n > 1` request: n=1, seed + index
        (vLLM's child seeds). Only sample 0 reports prompt logprobs (the others may then read
        the prompt's cached blocks)."""
        return dataclasses.replace(
            self, n=1, seed=None if self.seed is None else self.seed + index,
            prompt_logprobs=self.prompt_logprobs if index == 0 else None,
            stop_token_ids=list(self.stop_token_ids), stop=list(self.stop),
            logit_bias=None if self.logit_bias is None else dict(self.logit_bias),
            allowed_token_ids=None if self.allowed_token_ids is None else list(self.allowed_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """Whether every prompt position must be computed (its logits are wanted)."""
        return self.prompt_logprobs is not None

    @property
    def uses_history(self) -> bool:
        """Whether sampling reads the request's prompt and output tokens (penalties, min_tokens)."""
        return (self.min_tokens > 0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


def _number(name: str, value: Any, what: str = "a number") -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be {what}, got {value!r}")


def _int(name: str, value: Any, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be {what}, got {value!r}")


def _int_keyed_bias(bias: Any) -> dict[int, float]:
    """Returns `bias` with int token ids as keys (JSON gives strings) and values clamped to
    [-100, 100]; ValueError names logit_bias if a key or value is not one."""
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a mapping of token id to bias, got {type(bias).__name__}")
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
        if isinstance(key, (bool, float)) or isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value):
            raise ValueError(f"logit_bias must map token ids to finite numbers, got {key!r}: {value!r}")
        out[token] = max(-_MAX_LOGIT_BIAS, min(_MAX_LOGIT_BIAS, float(value)))
    return out
