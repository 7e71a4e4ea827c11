"""The one interface through which the prefix path (connector/planner.py, connector/worker.py)
calls an extension of it at its hook points, and the registry extensions plug into.

Extensions register from outside the core: an installed package names an `Extension` under the
entry point group `kvtier.extensions` (kvtier's own CacheBlend, connector/blend, is one, named in
pyproject.toml), or a program calls `register`. Each owns one top-level section of the connector
config (`blend:`), its `KVTIER_*` settings and its command-line flags; the core builds its two
halves when that section says `enabled`, and never imports it.

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

import argparse
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from connector.connector_metrics import ConnectorMetrics
    from connector.presence import Presence
    from connector.request_view import RequestView
    from connector.store_queue import StoreQueue
    from engine.kv_cache import KeyedModel, PagedKVLayout
    from engine.scheduler_output import SchedulerOutput
    from kvkeys.keyspace import Keyspace
    from kvsettings import Setting
    from kvstore.storage_manager import StorageManager


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
            raise RuntimeError("a step carries work for an extension but none is enabled on the worker "
                               "(the scheduler side's config enables one the worker's does not)")
        return {}


# ---- the registry --------------------------------------------------------------------------
EXTENSION_GROUP = "kvtier.extensions"
"""The entry point group an installed extension registers under (its value: an `Extension`)."""


class ExtensionConfig(Protocol):
    """An extension's section of the connector config, as its `parse` returns it."""

    enabled: bool

    def validate(self, num_layers: int | None = None) -> Any: ...


@dataclass(frozen=True)
class Extension:
    """One extension: its config section and settings, its flags, and what builds its halves.

    `planner(config, presence, metrics)` and `worker(config, storage, stores, layout, keyspace,
    metrics, model_config, model)` are called only when the section is `enabled`.
    `whole_chunks`: it loads whole chunks, so layer-pipelined loads (`use_layerwise`) cannot
    run beside it. `in_vllm`: it runs inside vLLM too (else vLLM refuses a config enabling it).
    `add_flags(parser)` adds its command-line flags; `flag_changes(args)` returns the changes
    they ask of its section (None: its flags were not given), applied as the section's keys
    with `enabled` true."""

    section: str
    title: str
    settings: tuple[Setting, ...]
    parse: Callable[[Any], ExtensionConfig]
    planner: Callable[[Any, Presence, ConnectorMetrics], PlannerExtension]
    worker: Callable[[Any, StorageManager, StoreQueue, PagedKVLayout, Keyspace, ConnectorMetrics, KeyedModel,
                      torch.nn.Module | None], WorkerExtension]
    whole_chunks: bool = False
    in_vllm: bool = False
    add_flags: Callable[[argparse.ArgumentParser], None] | None = None
    flag_changes: Callable[[argparse.Namespace], Mapping[str, Any] | None] | None = None


_registered: dict[str, Extension] = {}
_loaded = False
_lock = threading.Lock()


def register(extension: Extension) -> None:
    """Adds `extension` to this process's registry; ValueError if its section is taken by another."""
    with _lock:
        held = _registered.get(extension.section)
        if held is not None and held is not extension:
            raise ValueError(f"extension section {extension.section!r} is registered twice "
                             f"({held.title} and {extension.title})")
        _registered[extension.section] = extension


def extensions() -> dict[str, Extension]:
    """Returns every registered extension by its config section: those installed under
    `EXTENSION_GROUP` (loaded once) and those `register`ed."""
    global _loaded
    if not _loaded:
        found = [ep.load() for ep in entry_points(group=EXTENSION_GROUP)]
        for ext in found:
            if not isinstance(ext, Extension):
                raise ValueError(f"entry point group {EXTENSION_GROUP!r}: {ext!r} is not an Extension")
            register(ext)
        _loaded = True
    return dict(_registered)


def planner_extension(sections: Mapping[str, Any], presence: Presence,
                      metrics: ConnectorMetrics) -> PlannerExtension:
    """Returns the scheduler side of the extension `sections` enable (at most one), else none."""
    on = enabled_extension(sections)
    return NoPlannerExtension() if on is None else on[0].planner(on[1], presence, metrics)


def worker_extension(sections: Mapping[str, Any], storage: StorageManager, stores: StoreQueue,
                     layout: PagedKVLayout, keyspace: Keyspace, metrics: ConnectorMetrics,
                     model_config: KeyedModel, model: torch.nn.Module | None) -> WorkerExtension:
    """Returns the worker side of the extension `sections` enable (at most one), else none."""
    on = enabled_extension(sections)
    if on is None:
        return NoWorkerExtension()
    return on[0].worker(on[1], storage, stores, layout, keyspace, metrics, model_config, model)


def enabled_extension(sections: Mapping[str, Any]) -> tuple[Extension, Any] | None:
    """Returns the registered extension whose section in `sections` is enabled, with that
    section; None when none is. ValueError when more than one is (one runs at a time)."""
    registry = extensions()
    on = [(registry[name], cfg) for name, cfg in sections.items() if name in registry and cfg.enabled]
    if len(on) > 1:
        raise ValueError(f"{' and '.join(e.section for e, _ in on)}: one extension runs at a time; enable one")
    return on[0] if on else None
