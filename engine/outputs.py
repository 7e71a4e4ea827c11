"""What `LLM.generate` returns (vLLM's `RequestOutput` / `CompletionOutput` shape)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    # "stop" (eos, a stop token id, the last of `token_ids`, or a stop string), "length" or
    # "abort"; None while the request runs.
    finish_reason: str | None = None
    stop_reason: int | str | None = None


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
    outputs: list[CompletionOutput]
    finished: bool
    # Prompt tokens not computed on first scheduling: engine prefix cache + connector loads.
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    num_preemptions: int = 0
