"""What one `Scheduler.schedule()` decides: the step's requests, and what a KV connector and
the model runner are told about it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.sequence import Sequence


@dataclass
class ScheduledRequest:
    """One sequence's share of a step (also what a connector sees)."""

    seq: Sequence
    num_computed_tokens: int  # K/V already in the cache before this step (loads included)
    num_new_tokens: int  # tokens computed by this step
    num_external_tokens: int = 0  # tokens a connector loads this step (admission only)

    @property
    def request_id(self) -> str:
        return self.seq.request_id

    @property
    def token_ids(self) -> list[int]:
        return self.seq.all_token_ids

    @property
    def block_ids(self) -> list[int]:
        return self.seq.block_table

    @property
    def num_prompt_tokens(self) -> int:
        return self.seq.num_prompt_tokens

    @property
    def samples(self) -> bool:
        """Whether this step reaches the sequence's last token (so a token is sampled)."""
        return self.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    requests: list[ScheduledRequest] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    # Requests finished (or aborted) since the last step: a connector's worker side stops
    # their loads (vLLM's `finished_req_ids`).
    finished_req_ids: set[str] = field(default_factory=set)
    kv_connector_metadata: Any = None

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(r.num_new_tokens for r in self.requests)

    @property
    def is_empty(self) -> bool:
        return not self.requests
