"""One request's state as it moves through the scheduler (nano-vllm's `Sequence`).

A request's tokens are its prompt followed by what it has generated. `num_computed_tokens`
counts the leading tokens whose K/V is in the paged cache (computed by the engine, found in
its prefix cache, or loaded by a connector); the rest are computed by later steps.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import PromptLogprobs, SampleLogprobs
from engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    # Admitted with blocks while a connector loads part of its prefix in the background; it
    # becomes WAITING (schedulable, those tokens computed) once the load is reported done.
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"  # eos or a stop token id
    FINISHED_LENGTH = "length"  # max_tokens or max_model_len
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in _FINISHED


_FINISHED = {
    SequenceStatus.FINISHED_STOPPED,
    SequenceStatus.FINISHED_LENGTH,
    SequenceStatus.FINISHED_ABORTED,
}


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    prompt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)

    status: SequenceStatus = SequenceStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Physical block ids, one per `block_size` tokens of `all_token_ids`, in order.
    block_table: list[int] = field(default_factory=list)
    # Chained hashes of this sequence's full blocks, extended as blocks fill (prefix caching).
    block_hashes: list[bytes] = field(default_factory=list)
    # Prompt tokens served without compute on first scheduling (prefix cache + connector).
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    # The stop token id, or the stop string that ended the request.
    stop_reason: int | str | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    # Per-request RNG for seeded sampling; created lazily by the sampler.
    generator: torch.Generator | None = None
    # Token counts of the prompt's segments (system, documents, query), summing to the prompt
    # length, or None. Plain metadata for a connector (CacheBlend); the engine never reads it.
    segment_lens: list[int] | None = None
    # Leading tokens whose K/V is exact and may enter the prefix cache; None = all. A connector
    # that loads approximate K/V (CacheBlend) lowers it so nothing approximate is ever shared.
    max_cacheable_tokens: int | None = None
    # The output's text so far, extended each step by the engine (None before the first token).
    detokenizer: IncrementalDetokenizer | None = None
    # With `sampling_params.logprobs`: per output token its logprobs (engine/logprobs.py).
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float = 0.0
    # With `sampling_params.prompt_logprobs`: per prompt token (the first None), by position.
    prompt_logprobs: PromptLogprobs | None = None
    # vLLM's `cache_salt` (kvkeys/tenants.py): the request shares cached K/V only with
    # requests of the same salt (None: only with unsalted ones).
    cache_salt: str | None = None

    @property
    def output_text(self) -> str:
        return self.detokenizer.text if self.detokenizer is not None else ""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output without copying the whole list."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]
