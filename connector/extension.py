"""The one interface through which the prefix path (connector/planner.py, connector/worker.py)
calls an extension of it at its hook points; CacheBlend (connector/blend) is the extension.

An extension has the connector's two roles, so it is two objects, as the connector is:
- `PlannerExtension` (scheduler side): it may take a request at lookup (it answers the lookup
  and plans the request's K/V itself, the prefix path plans no load for it), contributes work
  items to each step's metadata, may exclude a request from prefix stores, and forgets a
  request when it finishes.
- `WorkerExtension` (worker side): runs the step's work items before the forward.
With no extension configured the planner and the worker hold the null objects below, which
take no request and run nothing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from connector.request_view import RequestView
    from engine.kv_cache import KeyedModel
    from engine.scheduler_output import SchedulerOutput
    from kvkeys.keyspace import Keyspace


class PlannerExtension(ABC):
    """The scheduler side of an extension, called by `KVTierPlanner` at each of its hooks."""

    # String prompts are split into segments on this separator when set (the planner's own).
    segment_separator: str | None = None

    @abstractmethod
    def register_model(self, model_config: KeyedModel, keyspace: Keyspace, block_size: int) -> None:
        """Receives the model, the keyspace and the block size; ValueError if it cannot serve
        the model."""

    @abstractmethod
    def match(self, seq: RequestView, num_computed_tokens: int) -> tuple[int, bool] | None:
        """Returns the lookup's answer (as `get_num_new_matched_tokens`) for a request this
        extension takes, or None: the prefix path looks it up."""

    @abstractmethod
    def admit(self, seq: RequestView, block_ids: list[int], num_external_tokens: int) -> bool:
        """After allocation (as `update_state_after_alloc`): returns True if the request's
        matched tokens are this extension's to fill (the prefix path plans no load)."""

    @abstractmethod
    def step_work(self, scheduler_output: SchedulerOutput) -> list[Any]:
        """Returns this step's work items for the worker side (picklable; `KVTierMeta.extension_work`)."""

    @abstractmethod
    def excludes_saves(self, request_id: str) -> bool:
        """Whether nothing of the live request may be stored as prefix chunks."""

    @abstractmethod
    def finish(self, request_id: str) -> bool:
        """Forgets the finished request; returns True if it was excluded from prefix stores
        (nothing of it is stored, its blocks may be freed at once)."""


class WorkerExtension(ABC):
    """The worker side of an extension, called by `KVTierWorker` in `start_load_kv`."""

    @abstractmethod
    def run(self, work: list[Any]) -> dict[str, int]:
        """Does the step's work items (after its loads were handed on, before its forward);
        returns the requests whose cached-token count it revised, with their counts."""


class NoPlannerExtension(PlannerExtension):
    """No extension: every request takes the prefix path."""

    def register_model(self, model_config: KeyedModel, keyspace: Keyspace, block_size: int) -> None:
        pass

    def match(self, seq: RequestView, num_computed_tokens: int) -> tuple[int, bool] | None:
        return None

    def admit(self, seq: RequestView, block_ids: list[int], num_external_tokens: int) -> bool:
        return False

    def step_work(self, scheduler_output: SchedulerOutput) -> list[Any]:
        return []

    def excludes_saves(self, request_id: str) -> bool:
        return False

    def finish(self, request_id: str) -> bool:
        return False


class NoWorkerExtension(WorkerExtension):
    """No extension: a step carries no work for one (RuntimeError if it does)."""

    def run(self, work: list[Any]) -> dict[str, int]:
        if work:
            raise RuntimeError("a step carries work for an extension (a blend) but none is configured on the "
                               "worker (blend.enabled)")
        return {}
