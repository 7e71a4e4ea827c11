"""What `LLM.generate` returns (vLLM's `RequestOutput` / `CompletionOutput` / `Logprob` shape)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Logprob:
    """One token's log probability under the model's raw distribution (log_softmax of the
    logits, before penalties, bias, temperature and filtering: vLLM's default
    `logprobs_mode="raw_logprobs"`), its rank in that distribution (1 = most likely; ties
    share the larger rank) and its text alone (`tokenizer.decode([token_id])`)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position, token id -> Logprob: the position's own token first, then the top-k.
LogprobsAtPosition = dict[int, Logprob]
SampleLogprobs = list[LogprobsAtPosition]
# One entry per prompt token; the first is None (nothing predicts it).
PromptLogprobs = list[LogprobsAtPosition | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    # "stop" (eos, a stop token id, the last of `token_ids`, or a stop string), "length" or
    # "abort"; None while the request runs.
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Sum of the generated tokens' logprobs; None unless `SamplingParams.logprobs` is set.
    cumulative_logprob: float | None = None
    # Per generated token, its Logprob and the top-`logprobs` ones; None unless asked.
    logprobs: SampleLogprobs | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Times from `time.monotonic()` (seconds; compare them with each other only)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first generated token (None before it exists)."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    # One per sample (`SamplingParams.n`), in index order.
    outputs: list[CompletionOutput]
    finished: bool
    # Prompt tokens not computed on first scheduling: engine prefix cache + connector loads.
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    num_preemptions: int = 0
    # Per prompt token (the first None) when `SamplingParams.prompt_logprobs` is set, once
    # the whole prompt is computed; None otherwise.
    prompt_logprobs: PromptLogprobs | None = None
