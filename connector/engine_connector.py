"""`EngineConnector`: kvtier's connector for its own engine, the two halves over one set of
tiers (docs/architecture.md, "Connector").

The scheduler side (`KVTierPlanner`, connector/planner.py) plans loads and saves from
existence alone; the worker side (`KVTierWorker`, connector/worker.py) moves K/V as the
step's metadata says. In one process they share the tiers, the figures and the worker's
`Presence` (the store queue's pending keys count as held, so a lookup right after a store
finds it); nothing else passes between them but the metadata and the worker's output. This
bundle only builds and owns them and answers the questions a user or a server asks of a
connector as a whole (flush, shutdown, figures, what the tiers hold).
"""

from __future__ import annotations

import atexit
import functools
import weakref
from collections.abc import Sequence
from typing import Any

from connector import cache_control
from connector.connector_config import ConnectorConfig, make_config
from connector.connector_metrics import ConnectorMetrics, RequestKVMetrics, TierKVMetrics
from connector.explain import explain
from connector.planner import KVTierPlanner
from connector.presence import held_tokens
from connector.worker import KVTierWorker
from engine.kv_connector import KVConnector
from kvstore.storage_manager import StorageManager


class EngineConnector(KVConnector):
    """A planner and a worker over one `StorageManager` (opened here unless one is passed, to
    share tiers between engines).

    Guarantees: `shutdown()` (also run at interpreter exit) flushes queued stores and closes
    the tiers this connector opened, once.
    """

    planner: KVTierPlanner
    worker: KVTierWorker

    def __init__(self, config: ConnectorConfig | None = None, storage: StorageManager | None = None) -> None:
        self.config = (config or ConnectorConfig()).validate()
        self.config.apply_tenant_tag_key()  # before any key or tenant figure is derived
        self._owns_storage = storage is None
        self.storage = storage if storage is not None else StorageManager.from_config(self.config.kvstore)
        self.metrics = ConnectorMetrics()
        worker = KVTierWorker(self.config, self.storage, self.metrics, check_budgets=self._owns_storage)
        # one keyspace: the worker builds it with the caches, the planner takes that one
        super().__init__(KVTierPlanner(self.config, worker.presence, self.metrics,
                                       keyspace_of=lambda: worker.keyspace), worker)
        self._closed = False
        # A script that never calls LLM.shutdown() still gets its queued stores written.
        self._atexit = functools.partial(_shutdown_at_exit, weakref.ref(self))
        atexit.register(self._atexit)

    def shutdown(self) -> None:
        """Flushes pending stores and closes the tiers this connector opened."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._atexit)
        try:
            super().shutdown()
        finally:
            if self._owns_storage:  # within what is left of the worker's flush bound
                self.storage.close(self.worker.flush_time_left())

    # ---- figures -----------------------------------------------------------------------
    def request_metrics(self, request_id: str) -> RequestKVMetrics:
        """Returns a request's connector figures (live or recently finished; all zero for a
        request the connector never saw or has forgotten)."""
        return self.planner.request_metrics(request_id)

    def tier_metrics(self) -> list[TierKVMetrics]:
        """Returns per-tier totals, fastest tier first."""
        loaded = self.metrics.totals_now().loaded_tokens_by_tier
        return [TierKVMetrics.from_stats(s, loaded.get(name, 0)) for name, s in self.storage.stats().items()]

    def pending_stores(self) -> int:
        """Returns how many gathered chunks wait for the store thread."""
        return self.worker.stores.pending()

    def lookup(self, token_ids: Sequence[int], cache_salt: str | None = None) -> dict[str, int]:
        """Returns, per tier name (fastest first), how many leading tokens of `token_ids` that
        tier holds as stored chunks (the partial last chunk included) for requests of
        `cache_salt` (only that salt's chunks count), never counting the last token (it is
        always computed). Existence only; nothing is read or loaded."""
        if len(token_ids) < 2:
            return {name: 0 for name in self.storage.names}
        ks = self.planner.keyspace.for_salt(cache_salt)
        spans = ks.spans(token_ids)
        return held_tokens(spans, self.worker.presence.tier_prefix_chunks(ks, spans), len(token_ids))

    def explain(self, token_ids: Sequence[int], cache_salt: str | None = None,
                other_tenants: bool = True) -> dict[str, Any]:
        """Returns per tier the leading tokens of `token_ids` held for requests of `cache_salt`
        and why not more (connector/explain.py: another model, engine tag, dtype, layout, chunk
        size or tenant holds it, or evicted, or never stored); existence only. With
        `other_tenants` False, other tenants' entries are not considered."""
        ks = self.planner.keyspace.for_salt(cache_salt)
        return explain(self.storage, ks, self.worker.presence, token_ids, other_tenants)

    def forget_tenant(self, cache_salt: str) -> tuple[dict[str, int], dict[str, str]]:
        """Removes every stored value of `cache_salt`'s requests (any model, prefix chunks and
        CacheBlend segments) from every tier, after this connector's queued stores landed.
        Returns (per tier the values removed, per tier that failed its error)."""
        self.flush()
        return cache_control.forget_tenant(self.storage, cache_salt)

    # ---- operating the cache (connector/cache_control.py) -----------------------------------
    def inspect(self, token_ids: Sequence[int], cache_salt: str | None = None,
                tenants: str | None | bool = True) -> dict[str, Any]:
        """Returns what each tier holds of the prompt's chunks for `cache_salt`, and per tier
        its totals (`tenants`: which tenants' usage to include: True all, a tag only it)."""
        return cache_control.inspect(self.storage, self.planner.keyspace.for_salt(cache_salt), token_ids, tenants)

    def pin(self, token_ids: Sequence[int], cache_salt: str | None = None, tier: str | None = None,
            ttl_s: float | None = None) -> dict[str, Any]:
        """Pins the prompt's held prefix in `tier` (None: the fastest) after queued stores
        landed; PinError (nothing pinned) or ValueError (unknown tier) otherwise."""
        self.flush()
        return cache_control.pin(self.storage, self.planner.keyspace.for_salt(cache_salt), token_ids, tier, ttl_s)

    def unpin(self, token_ids: Sequence[int], cache_salt: str | None = None, tier: str | None = None
              ) -> dict[str, Any]:
        """Releases the pins of the prompt's chunks in `tier` (None: the fastest)."""
        return cache_control.unpin(self.storage, self.planner.keyspace.for_salt(cache_salt), token_ids, tier)

    def prefetch(self, token_ids: Sequence[int], cache_salt: str | None = None, tier: str | None = None
                 ) -> dict[str, Any]:
        """Copies the prompt's leading chunks `tier` (None: the fastest) lacks into it from the
        other tiers, after queued stores landed (cache_control.prefetch)."""
        self.flush()
        return cache_control.prefetch(self.storage, self.planner.keyspace.for_salt(cache_salt), token_ids, tier)

    def move(self, token_ids: Sequence[int], cache_salt: str | None, src: str, dst: str) -> dict[str, Any]:
        """Moves the prompt's chunks from tier `src` into tier `dst`, after queued stores landed."""
        self.flush()
        return cache_control.move(self.storage, self.planner.keyspace.for_salt(cache_salt), token_ids, src, dst)

    def drop(self, token_ids: Sequence[int], cache_salt: str | None = None, tier: str | None = None
             ) -> dict[str, Any]:
        """Removes the prompt's chunks from `tier` (None: the fastest), after queued stores landed."""
        self.flush()
        return cache_control.drop(self.storage, self.planner.keyspace.for_salt(cache_salt), token_ids, tier)

    def clear_model(self, model: str) -> tuple[dict[str, int], dict[str, str]]:
        """Removes every stored value of model `model` (a key's model field, or its name
        before the engine tag: any tenant, dtype, chunk size) from every tier, after this
        connector's queued stores landed (cache_control.clear_model)."""
        self.flush()
        return cache_control.clear_model(self.storage, model)
    def set_budget(self, tier: str | None = None, byte_budget: int | None = None, pin_budget: int | None = None,
                   tenant_quota: int | None = None) -> dict[str, Any]:
        """Changes `tier`'s (None: the fastest) limits given, evicting at once to meet them;
        returns its figures after. BudgetError (nothing changed) or ValueError otherwise."""
        return cache_control.set_budget(self.storage, tier, byte_budget, pin_budget, tenant_quota)

    def clear_tiers(self, local_only: bool = False) -> dict[str, int]:
        """Removes every chunk from every tier (with `local_only`, only this process's cpu and
        device), after queued stores landed, pins included; returns per tier how many entries
        it held before."""
        self.flush()
        return cache_control.clear_tiers(self.storage, local_only)

    def clear_idle(self, older_than_s: float) -> tuple[dict[str, int], dict[str, str]]:
        """Removes the chunks no request used for `older_than_s` seconds (not pinned ones)
        from the tiers that know last uses; returns (per tier removed, per tier why not)."""
        self.flush()
        return self.storage.operations.delete_idle(older_than_s)


def _shutdown_at_exit(ref: weakref.ref[EngineConnector]) -> None:
    conn = ref()
    if conn is not None:
        conn.shutdown()


def build_connector(config_or_urls: Any = None, *, storage: StorageManager | None = None,
                    **overrides: Any) -> EngineConnector:
    """Returns a connector for `LLM(kv_connector=...)` from a ConnectorConfig, KVStoreConfig,
    mapping, YAML path, tier URL or list of tier URLs (fastest first); `overrides` are
    `make_config` keywords (chunk_size, codec, save_decode_tokens, save_unfull_chunk,
    use_layerwise). An extension (CacheBlend) is on when its config section says `enabled`."""
    if isinstance(config_or_urls, EngineConnector):
        if overrides or storage is not None:
            raise ValueError("a ready connector takes no overrides")
        return config_or_urls
    return EngineConnector(make_config(config_or_urls, **overrides), storage=storage)
