"""The KV connector protocol: how an external KV store plugs into the engine
(docs/architecture.md, "Connector").

Modelled on vLLM's KV connector v1: a connector is two objects, one per role, and the only
thing that crosses from the scheduler side to the worker side is the metadata object
`build_connector_meta` returns (it pickles, so the halves may live in different processes, as
they do in vLLM); the worker side answers with a `KVConnectorOutput` after each step. With no
connector configured none of these calls happen and the engine behaves exactly as without one.

Start-up: `KVConnectorWorker.register_model(model_config)`, `register_model_module(model)`,
`register_kv_caches(kv_caches)` when the runner has allocated the per-layer caches; then
`KVConnectorScheduler.register_model(model_config, kv_dtype, block_size)`.

Per step, in order:

Scheduler side (`Scheduler.schedule`), for each waiting request being admitted:
  1. `get_num_new_matched_tokens(seq, num_computed_tokens) -> (num_tokens, load_async)`:
     how many tokens after the engine's own prefix-cache hit (`num_computed_tokens`, block
     aligned) the connector can load, from existence only. The engine clamps it so the last
     token is computed. `load_async`: the load runs in the background while the request waits
     (status WAITING_FOR_REMOTE_KVS); False: it is part of this step.
  2. `update_state_after_alloc(seq, block_ids, num_external_tokens)` once blocks are
     allocated: `block_ids` is the whole table; positions `[seq.num_computed_tokens,
     + num_external_tokens)` are to be loaded into fresh blocks only this request holds.
  3. `build_connector_meta(scheduler_output)` once per step, after all requests are
     scheduled (even when none is, so finished requests and background loads are handed on).

Worker side (`ModelRunner.execute_model`, which runs even for a step with nothing to compute
while a connector has work in flight):
  4. `bind_connector_metadata(meta)`, then `start_load_kv(attn_metadata)` (None when there
     is no forward).
  5. Inside the forward, per layer i: `wait_for_layer_load(i)` before attention reads layer
     i, `save_kv_layer(i, kv_cache[i], attn_metadata)` after this step's K/V for layer i is
     written.
  6. `wait_for_save()`: the step's stores are done or safely queued.
  7. With no forward and nothing else to do, `wait_for_finished(timeout)` (a bounded block).
  8. `build_connector_output(scheduler_output.finished_req_ids)`: `get_finished(...)`, then
     `get_block_ids_with_load_errors()`, as the step's `KVConnectorOutput`. Then
     `clear_connector_metadata()`.

Scheduler side, after the step (`Scheduler.update_from_output`):
  9. `update_connector_output(kv_output)`; the scheduler then cuts back every request whose
     load left blocks in `invalid_block_ids` (this step's loads: the step's token for it is
     discarded; finished background loads: resumed from their first bad block), resumes the
     requests in `finished_recving` and frees the delayed blocks of `finished_sending`.
  10. `request_finished(seq, block_ids) -> bool` when a request finishes or is aborted,
     before its blocks are freed: True keeps them until `finished_sending` or
     `finished_recving` names the request (a load still writes them, or a save will read
     them); the request's id reaches the worker in the next step's `finished_req_ids`.

Segmented prompts (CacheBlend): a scheduler side whose `segment_separator` is a string makes
`LLM.generate` split string prompts on it; a prompt given as a list of strings (or a dict with
`segment_lens`) is segmented always. A connector that loads approximate K/V sets
`seq.max_cacheable_tokens` (in `update_state_after_alloc`) so the engine's prefix cache never
shares blocks beyond it.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

import torch

from kvsettings import TIERS_ENV, ProcessEnv, variable

if TYPE_CHECKING:
    from engine.attention_metadata import AttentionMetadata
    from engine.model_config import ModelConfig
    from engine.scheduler_output import SchedulerOutput
    from engine.sequence import Sequence


@dataclass
class KVConnectorOutput:
    """What the worker side reports after a step (vLLM's `KVConnectorOutput`, plus kvtier's
    `num_cached_tokens`)."""

    # Finished requests whose delayed block release may now happen (their saves read them).
    finished_sending: set[str] = field(default_factory=set)
    # Requests whose background load ended (cancelled ones included).
    finished_recving: set[str] = field(default_factory=set)
    # Blocks of this step's loads, and of the loads in `finished_recving`, that did not get
    # their K/V: from each failed load's first bad position to its end.
    invalid_block_ids: set[int] = field(default_factory=set)
    # Requests whose cached-token count the worker revised (CacheBlend counts only loaded
    # segments, known once they are fetched).
    num_cached_tokens: dict[str, int] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.invalid_block_ids
                    or self.num_cached_tokens)


class KVConnectorScheduler(ABC):
    """The scheduler side: plans loads and saves from existence alone, never reads or writes
    K/V; see the module docstring for the call order."""

    # String prompts are split into segments on this separator when set (CacheBlend).
    segment_separator: str | None = None

    @abstractmethod
    def register_model(self, model_config: ModelConfig, kv_dtype: torch.dtype, block_size: int) -> None:
        """Receives the engine's model, KV cache dtype and block size once, before any request."""

    @abstractmethod
    def get_num_new_matched_tokens(self, seq: Sequence, num_computed_tokens: int) -> tuple[int, bool]:
        """Returns (how many tokens after `num_computed_tokens` the connector can load (>= 0),
        whether it loads them asynchronously)."""

    @abstractmethod
    def update_state_after_alloc(self, seq: Sequence, block_ids: list[int], num_external_tokens: int) -> None:
        """Notes where the `num_external_tokens` tokens to load go (`block_ids` = whole table)."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any:
        """Returns this step's picklable instructions for the worker side."""

    @abstractmethod
    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Receives what the worker side reported after a step."""

    @abstractmethod
    def request_finished(self, seq: Sequence, block_ids: list[int]) -> bool:
        """Called once per finished request before its blocks are freed. Returns True to
        keep them until the worker names the request in `finished_sending`/`finished_recving`."""

    def request_metrics(self, request_id: str) -> Any | None:
        """Returns the connector's figures for a request (live or recently finished) for the
        per-request log line, or None (default) when the connector keeps none."""
        return None

    def shutdown(self) -> None:
        """Releases resources (default: nothing to do)."""


class KVConnectorWorker(ABC):
    """The worker side: moves K/V between the paged caches and the connector's store as the
    metadata says; see the module docstring for the call order."""

    def register_model(self, model_config: ModelConfig) -> None:
        """Receives the loaded model's description once, before `register_kv_caches`."""

    def register_model_module(self, model: torch.nn.Module) -> None:
        """Receives the loaded model module once, for connectors that run model layers
        themselves (CacheBlend's selective recompute; default: ignored)."""

    @abstractmethod
    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """Receives the per-layer paged kv_cache tensors once, at start-up."""

    @abstractmethod
    def bind_connector_metadata(self, metadata: Any) -> None:
        """Receives the object `build_connector_meta` returned for the step about to run."""

    def clear_connector_metadata(self) -> None:
        """Drops the step's metadata after the step (default: nothing to do)."""

    @abstractmethod
    def start_load_kv(self, attn_metadata: AttentionMetadata | None) -> None:
        """Starts (or does) the step's loads; `attn_metadata` is None for a step without a forward."""

    @abstractmethod
    def wait_for_layer_load(self, layer_idx: int) -> None:
        """Blocks until layer `layer_idx`'s loaded K/V is in place."""

    @abstractmethod
    def save_kv_layer(self, layer_idx: int, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata) -> None:
        """Called after layer `layer_idx` wrote this step's K/V into `kv_layer`."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """Blocks until this step's saves are done or safely queued."""

    @abstractmethod
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Returns (finished requests whose blocks no save reads any more, requests whose
        background load ended) since the last call, each id once; `finished_req_ids` are the
        requests the scheduler finished since the last step (their loads stop)."""

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Returns the blocks of the loads last reported by `get_finished()`, and of this
        step's loads, that did not get their K/V (default: none)."""
        return set()

    def build_connector_output(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        """Returns the step's report for the scheduler side: `get_finished(finished_req_ids)`
        and `get_block_ids_with_load_errors()`, called in that order."""
        sending, recving = self.get_finished(finished_req_ids)
        return KVConnectorOutput(set(sending or ()), set(recving or ()), self.get_block_ids_with_load_errors())

    def wait_for_finished(self, timeout: float) -> None:
        """Blocks until `get_finished()` has something to report, at most `timeout` seconds
        (default: returns at once)."""

    def flush(self, timeout: float | None = None) -> bool:
        """Waits until queued saves reached their store; returns False on timeout (default:
        nothing is queued)."""
        return True

    def shutdown(self) -> None:
        """Flushes pending work and releases resources (default: nothing to do)."""


@dataclass
class KVConnector:
    """One connector's two halves, as `LLM(kv_connector=...)` takes them."""

    planner: KVConnectorScheduler  # the scheduler side
    worker: KVConnectorWorker

    def flush(self, timeout: float | None = None) -> bool:
        """Waits until the worker's queued saves reached their store; False on timeout."""
        return self.worker.flush(timeout)

    def shutdown(self) -> None:
        """Shuts the worker side down (flushing its saves), then the scheduler side."""
        try:
            self.worker.shutdown()
        finally:
            self.planner.shutdown()


CONFIG_FILE_ENV = (variable(ProcessEnv, "config"), "LMCACHE_CONFIG_FILE")
"""Variables naming a connector config file, first one set wins (LMCache's name reads an LMCache YAML)."""
CONNECTOR_ENV = (CONFIG_FILE_ENV[0], TIERS_ENV, "LMCACHE_CONFIG_FILE")
"""Variables that alone enable the KV connector, as LMCACHE_CONFIG_FILE does for LMCache: the config file's,
and kvstore's `tiers` key's (`kvsettings.TIERS_ENV`, which `KVStoreConfig.tiers` declares with it)."""


def connector_env(env: Mapping[str, str] | None = None) -> str | None:
    """Returns the first of CONNECTOR_ENV set (non-empty) in `env` (default os.environ), or None."""
    env = os.environ if env is None else env
    return next((v for v in CONNECTOR_ENV if env.get(v)), None)


# Connector factories register here (pyproject entry points), so `LLM(kv_connector=<config>)` can
# build one without the engine importing any connector package (docs/architecture.md, "Layout and
# import rules").
CONNECTOR_FACTORY_GROUP = "kvtier.kv_connectors"
DEFAULT_CONNECTOR_FACTORY = "kvtier"


def resolve_kv_connector(spec: Any) -> tuple[KVConnector | None, bool]:
    """Returns (connector, built_here): `spec` itself if it is a KVConnector (or None), else the
    connector the installed factory builds from `spec` (tier URLs, a mapping, a YAML path: what
    the factory accepts). Raises ValueError if no factory is installed or it rejects `spec`."""
    if spec is None or isinstance(spec, KVConnector):
        return spec, False
    found = entry_points(group=CONNECTOR_FACTORY_GROUP, name=DEFAULT_CONNECTOR_FACTORY)
    if not found:
        raise ValueError(f"kv_connector: got a {type(spec).__name__} config but no connector factory is "
                         f"installed (entry point group {CONNECTOR_FACTORY_GROUP!r}); install kvtier "
                         f"(pip install -e .) or pass a KVConnector")
    connector = next(iter(found)).load()(spec)
    if not isinstance(connector, KVConnector):
        raise ValueError(f"kv_connector: the factory returned a {type(connector).__name__}, not a KVConnector")
    return connector, True
