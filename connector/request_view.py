"""What the connector's scheduler side reads of a request, whichever engine runs it.

kvtier's `Sequence` and vLLM's `Request` both have every attribute of `RequestView`, so the
planner (connector/planner.py) reads each engine's own objects: no mirror is kept, nothing
is copied per step but the block tables a step's plans name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class RequestView(Protocol):
    """What the planner reads of a request. kvtier's `Sequence` and vLLM's `Request` both
    have it, so each engine hands the planner its own objects."""

    @property
    def request_id(self) -> str: ...

    @property
    def cache_salt(self) -> str | None: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def all_token_ids(self) -> Sequence[int]: ...


BlockIds = Sequence[Sequence[int]]
"""A request's block table per KV cache group (one group in kvtier's engine)."""


@dataclass
class StepRequest:
    """One request's share of a step, as the planner plans saves from it."""

    request: RequestView
    block_ids: BlockIds
    num_computed_tokens: int  # before this step
    num_new_tokens: int
