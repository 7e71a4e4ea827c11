"""The KV connector protocol: how an external KV store plugs into the engine
(docs/architecture.md, "Connector").

Modelled on vLLM's KV connector v1. One object plays both roles (one process): the scheduler
calls the scheduler-side hooks while it plans a step, the model runner calls the worker-side
hooks while it executes that step. With no connector configured none of these calls happen
and the engine behaves exactly as without one.

Per step, in order:

Scheduler side (in `Scheduler.schedule`):
  0. `get_finished() -> (finished_sending, finished_recving)`, then, if either set is not
     empty, `get_block_ids_with_load_errors() -> set[int]`. `finished_recving` names requests
     whose asynchronous load (below) is over; `finished_sending` (and `finished_recving`)
     names finished requests whose block release was delayed (step 9). A finished load makes
     its request schedulable with the loaded tokens computed, cut back to the first of its
     blocks named in the error set (existence at lookup is not possession: those tokens are
     recomputed). Blocks named there must belong to requests reported in the same call.
For each *waiting* request being admitted:
  1. `get_num_new_matched_tokens(seq, num_computed_tokens) -> (num_tokens, load_async)`
     `seq` is the `engine.sequence.Sequence` (request id `seq.request_id`, tokens
     `seq.all_token_ids`); `num_computed_tokens` is what the engine's own prefix cache already
     holds (block aligned). `num_tokens`: how many further tokens, starting at
     `num_computed_tokens`, the connector can load. The engine clamps it so at least the last
     token is computed (its logits are needed) and the total stays below `seq.num_tokens`.
     `load_async`: the load happens in the background, off the engine's steps (see below);
     False: it happens in this step's `start_load_kv`.
  2. `update_state_after_alloc(seq, block_ids, num_external_tokens)` once blocks are
     allocated: `block_ids` is the request's whole block table (prefix-cache hits first, then
     fresh blocks); `seq.num_computed_tokens` is still the prefix-cache part, and positions
     `[seq.num_computed_tokens, seq.num_computed_tokens + num_external_tokens)` are the ones
     to load, always into fresh blocks only this request holds. These tokens count as
     computed: they are not recomputed and `RequestOutput.num_cached_tokens` includes them.
     With `load_async` the request now holds blocks for its whole prompt and is parked
     (status WAITING_FOR_REMOTE_KVS, not scheduled) until step 0 reports its load; the
     connector starts the load here and the running batch keeps stepping meanwhile.
  3. `build_connector_meta(scheduler_output) -> Any` once per step, after all requests are
     scheduled. `scheduler_output.requests` lists `ScheduledRequest`s with `request_id`,
     `token_ids`, `block_ids`, `num_computed_tokens` (K/V already in the cache before this
     step, loaded tokens included), `num_new_tokens`, `num_external_tokens` (synchronous
     loads only), `num_prompt_tokens`, and `slot_mapping(block_size)` /
     `request_slot_mapping(...)` for slots. The returned object is handed to the worker side
     unchanged.

Worker side (in `ModelRunner.execute_model`):
  4. `bind_connector_metadata(meta)` with the object from step 3.
  5. `start_load_kv(attn_metadata)` before the forward: start writing the synchronous loads'
     K/V into the blocks named in step 2 (the kv_cache tensors came from
     `register_kv_caches` at start-up).
  6. Inside the forward, per layer i: `wait_for_layer_load(i)` before attention reads layer
     i (a layer-pipelined load returns as soon as layer i's loaded K/V is in place, while
     later layers still arrive), and `save_kv_layer(i, kv_cache[i], attn_metadata)` after this step's K/V for layer i
     is written (`attn_metadata.slot_mapping` holds the slots of this step's new tokens, in
     the flat batch order given by `attn_metadata.query_start_loc`).
  7. `wait_for_save()` after the forward: the step's stores must be done or safely queued.
  8. `clear_connector_metadata()`.

Scheduler side, after the step (`update_from_output`):
  8b. If the step had loads in it (`num_external_tokens` > 0),
     `get_block_ids_with_load_errors()`: blocks of those loads that did not get their K/V.
     Each such request is cut back to its first bad block and the step's output for it is
     discarded (its forward ran over K/V that never arrived); the rest is recomputed.
  9. `request_finished(seq, block_ids) -> bool` when a request finishes or is aborted
     (including one parked for its load), before its blocks are freed (they still hold its
     K/V during the call). True delays freeing them until step 0 names the request (a
     background load still writes them); `has_unfinished_requests()` stays True meanwhile.

The engine loop: when nothing can be scheduled and only background loads (or delayed
releases) are pending, `LLMEngine.step()` calls `wait_for_finished(timeout)` (a bounded block
until step 0 would report something) and returns []; `LLMEngine.is_waiting_for_kv()` says
the engine is in that state. A loop driving `step()` therefore never spins hot on a parked
request and never sees "scheduler made no progress".

Segmented prompts (CacheBlend): a connector whose `segment_separator` is a string makes
`LLM.generate` split string prompts on it; a prompt given as a list of strings (or a dict with
`segment_lens`) is segmented always. Segment boundaries reach the connector as
`seq.segment_lens`. A connector that loads approximate K/V sets `seq.max_cacheable_tokens` (in
`update_state_after_alloc`) so the engine's prefix cache never shares blocks beyond it.

`register_model(model_config)`, `register_model_module(model)` then `register_kv_caches(kv_caches)`
are called once when the runner allocates the per-layer tensors
`(2, num_blocks, block_size, num_kv_heads, head_size)`; `shutdown()` on `LLM.shutdown()` (flush
pending stores).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from engine.attention_metadata import AttentionMetadata
    from engine.scheduler import SchedulerOutput
    from engine.sequence import Sequence


class KVConnectorBase(ABC):
    """Abstract base of a KV connector; see the module docstring for the call order."""

    # ---- scheduler side ----
    @abstractmethod
    def get_num_new_matched_tokens(self, seq: Sequence, num_computed_tokens: int) -> tuple[int, bool]:
        """Returns (how many tokens after `num_computed_tokens` the connector can load (>= 0),
        whether it loads them asynchronously)."""

    @abstractmethod
    def update_state_after_alloc(self, seq: Sequence, block_ids: list[int], num_external_tokens: int) -> None:
        """Notes where the `num_external_tokens` tokens to load go (`block_ids` = whole table)."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any:
        """Returns this step's instructions for the worker side (loads and saves)."""

    @abstractmethod
    def request_finished(self, seq: Sequence, block_ids: list[int]) -> bool | None:
        """Called once per finished request before its blocks are freed. Returns True to
        delay freeing them until `get_finished()` names the request (falsy: free now)."""

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        """Returns (requests whose delayed block release may now happen, requests whose
        asynchronous load ended) since the last call; each id is reported once (default:
        nothing is ever asynchronous)."""
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Returns the blocks of loads reported by the last `get_finished()` (or, called after
        a step, of that step's loads) that did not get their K/V (from each failed load's
        first bad position to its end); default: none."""
        return set()

    def wait_for_finished(self, timeout: float) -> None:
        """Blocks until `get_finished()` has something to report, at most `timeout` seconds
        (default: sleeps `timeout`; connectors with background loads wake up early)."""
        time.sleep(timeout)

    # ---- worker side ----
    def register_model(self, model_config: Any) -> None:
        """Receives the loaded model's `engine.model_config.ModelConfig` once, before
        `register_kv_caches`; its `fingerprint` names the model's KV (default: ignored)."""

    # String prompts are split into segments on this separator when set (CacheBlend).
    segment_separator: str | None = None

    def register_model_module(self, model: torch.nn.Module) -> None:
        """Receives the loaded model module once, after `register_model`, for connectors that
        run model layers themselves (CacheBlend's selective recompute; default: ignored)."""

    @abstractmethod
    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """Receives the per-layer paged kv_cache tensors once, at start-up."""

    @abstractmethod
    def bind_connector_metadata(self, metadata: Any) -> None:
        """Receives the object `build_connector_meta` returned for the step about to run."""

    def clear_connector_metadata(self) -> None:
        """Drops the step's metadata after the forward (default: nothing to do)."""

    @abstractmethod
    def start_load_kv(self, attn_metadata: AttentionMetadata) -> None:
        """Starts (or does) loading the step's external K/V into the paged cache."""

    @abstractmethod
    def wait_for_layer_load(self, layer_idx: int) -> None:
        """Blocks until layer `layer_idx`'s loaded K/V is in place."""

    @abstractmethod
    def save_kv_layer(self, layer_idx: int, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata) -> None:
        """Called after layer `layer_idx` wrote this step's K/V into `kv_layer`."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """Blocks until this step's saves are done or safely queued."""

    def shutdown(self) -> None:
        """Flushes pending work and releases resources (default: nothing to do)."""


# Connector factories register here (pyproject entry points), so `LLM(kv_connector=<config>)` can
# build one without the engine importing any connector package (docs/architecture.md, "Layout and
# import rules").
CONNECTOR_FACTORY_GROUP = "kvtier.kv_connectors"
DEFAULT_CONNECTOR_FACTORY = "kvtier"


def resolve_kv_connector(spec: Any) -> tuple[KVConnectorBase | None, bool]:
    """Returns (connector, built_here): `spec` itself if it is a connector (or None), else the
    connector the installed factory builds from `spec` (tier URLs, a mapping, a YAML path: what
    the factory accepts). Raises ValueError if no factory is installed or it rejects `spec`."""
    if spec is None or isinstance(spec, KVConnectorBase):
        return spec, False
    found = entry_points(group=CONNECTOR_FACTORY_GROUP, name=DEFAULT_CONNECTOR_FACTORY)
    if not found:
        raise ValueError(f"kv_connector: got a {type(spec).__name__} config but no connector factory is "
                         f"installed (entry point group {CONNECTOR_FACTORY_GROUP!r}); install kvtier "
                         f"(pip install -e .) or pass a KVConnectorBase")
    connector = next(iter(found)).load()(spec)
    if not isinstance(connector, KVConnectorBase):
        raise ValueError(f"kv_connector: the factory returned a {type(connector).__name__}, not a KVConnectorBase")
    return connector, True
