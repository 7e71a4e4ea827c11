"""The scheduler side alone: it answers from existence (one batched query per tier, a second
only to find a stored partial chunk), plans loads and saves without touching a tier, hashes
each token of a request once, and its plans are plain data."""

from __future__ import annotations

import pickle
from pathlib import Path

import torch

from connector.connector_config import make_config
from connector.connector_metrics import ConnectorMetrics
from connector.planner import KVTierPlanner
from connector.presence import LocalHeldKeys, Presence
from connector.request_view import StepRequest
from engine.kv_connector import KVConnectorOutput
from engine.model_config import ModelConfig
from engine.sampling_params import SamplingParams
from engine.scheduler_output import ScheduledRequest, SchedulerOutput
from engine.sequence import Sequence
from kvkeys import keyspace as keyspace_module
from kvstore.backends.memory import CPUBackend
from kvstore.storage_manager import StorageManager

CHUNK = 16


class _CountingTier(CPUBackend):
    """A real CPU tier that records which of its operations were called."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def batched_contains(self, keys):
        self.calls.append("contains")
        return super().batched_contains(keys)

    def batched_get(self, keys, *, read_only=False):
        self.calls.append("read")
        return super().batched_get(keys, read_only=read_only)


def _planner(default_model_path: Path) -> tuple[KVTierPlanner, _CountingTier, ModelConfig]:
    mc = ModelConfig.from_pretrained(default_model_path)
    tier = _CountingTier()
    planner = KVTierPlanner(make_config(["cpu"], chunk_size=CHUNK), Presence([LocalHeldKeys(StorageManager([tier]))]),
                            ConnectorMetrics())
    planner.register_model(mc, torch.float32, 16)
    return planner, tier, mc


def _store(tier: _CountingTier, mc: ModelConfig, spans) -> None:
    for sp in spans:
        tier.put(sp.key, torch.zeros(mc.num_layers, 2, sp.num_tokens, mc.num_kv_heads, mc.head_size))


def test_a_full_hit_is_one_existence_query_and_plans_touch_no_tier(default_model_path: Path) -> None:
    planner, tier, mc = _planner(default_model_path)
    ids = list(range(100, 200))  # 6 full chunks and a 4-token partial one
    spans = planner.keyspace.spans(ids)
    _store(tier, mc, spans)
    seq = Sequence("r", ids, SamplingParams(max_tokens=1))
    tier.calls.clear()
    assert planner.get_num_new_matched_tokens(seq, 0) == (99, True)  # never the last token
    assert tier.calls == ["contains"]
    blocks = list(range(7))
    planner.update_state_after_alloc(seq, blocks, 99)
    meta = planner.build_connector_meta(SchedulerOutput())  # the request waits for its load
    assert tier.calls == ["contains"]  # planning asked nothing more, read nothing
    (load,) = meta.loads
    assert (load.request_id, load.start, load.end, load.block_ids, load.spans) == ("r", 0, 99, [blocks], spans)
    assert pickle.loads(pickle.dumps(meta)) == meta


def test_a_run_that_stops_early_probes_its_partial_chunk_once(default_model_path: Path) -> None:
    planner, tier, mc = _planner(default_model_path)
    short = list(range(100, 140))  # chunks [0,16) [16,32) and the partial [32,40)
    _store(tier, mc, planner.keyspace.spans(short))
    grown = short + list(range(500, 530))  # [32,48) has grown: its full key misses
    seq = Sequence("g", grown, SamplingParams(max_tokens=1))
    tier.calls.clear()
    assert planner.get_num_new_matched_tokens(seq, 0) == (40, True)  # two chunks and the stored partial
    assert tier.calls == ["contains", "contains"]


def test_saves_are_planned_once_from_what_the_step_computed(default_model_path: Path) -> None:
    planner, tier, _ = _planner(default_model_path)
    ids = list(range(100, 150))
    seq = Sequence("s", ids, SamplingParams(max_tokens=1))
    assert planner.get_num_new_matched_tokens(seq, 0) == (0, False)
    planner.update_state_after_alloc(seq, list(range(4)), 0)
    tier.calls.clear()
    first = planner.build_connector_meta(SchedulerOutput([ScheduledRequest(seq, 0, 40)]))
    assert [(sp.start, sp.end) for sp in first.saves[0].spans] == [(0, 16), (16, 32)]
    seq.num_computed_tokens = 40
    rest = planner.build_connector_meta(SchedulerOutput([ScheduledRequest(seq, 40, 10)]))
    # The prompt's partial last chunk too (save_unfull_chunk), and nothing offered twice.
    assert [(sp.start, sp.end) for sp in rest.saves[0].spans] == [(32, 48), (48, 50)]
    assert tier.calls == []  # whether a tier holds them is the worker side's question


def test_a_request_that_skips_saves_offers_nothing_but_still_loads(default_model_path: Path) -> None:
    planner, tier, mc = _planner(default_model_path)
    ids = list(range(100, 150))
    _store(tier, mc, planner.keyspace.spans(ids[:32]))
    seq = Sequence("s", ids, SamplingParams(max_tokens=1))
    planner.skip_saves("s")
    assert planner.get_num_new_matched_tokens(seq, 0) == (32, True)
    planner.update_state_after_alloc(seq, list(range(4)), 32)
    meta = planner.build_connector_meta(SchedulerOutput([ScheduledRequest(seq, 32, 18)]))
    assert [ld.request_id for ld in meta.loads] == ["s"] and meta.saves == []
    seq.num_computed_tokens = 50
    seq.output_token_ids.append(7)
    planner.update_connector_output(KVConnectorOutput(finished_recving={"s"}))
    assert planner.request_finished(seq, list(range(4))) is False  # no tail to save: freed at once
    assert planner.build_connector_meta(SchedulerOutput([])).saves == []
    # the flag ends with the request: a later request with that id is stored again
    again = Sequence("s", ids, SamplingParams(max_tokens=1))
    planner.get_num_new_matched_tokens(again, 0)
    planner.update_state_after_alloc(again, list(range(4)), 0)
    assert planner.build_connector_meta(SchedulerOutput([ScheduledRequest(again, 32, 18)])).saves


def test_a_request_whose_load_failed_recomputes_and_is_offered_nothing_again(default_model_path: Path) -> None:
    """A value the tier keeps but the engine cannot take fails every load of it: the request
    recomputes, saving its chunks again, and its next lookups (vLLM asks again for a request
    it reschedules) claim nothing, where offering the chunks again looped for ever."""
    planner, tier, mc = _planner(default_model_path)
    ids = list(range(100, 150))
    _store(tier, mc, planner.keyspace.spans(ids[:32]))
    seq = Sequence("f", ids, SamplingParams(max_tokens=1))
    assert planner.get_num_new_matched_tokens(seq, 0) == (32, True)
    planner.update_state_after_alloc(seq, [3, 1, 2, 0], 32)
    planner.build_connector_meta(SchedulerOutput())
    planner.update_connector_output(KVConnectorOutput(finished_recving={"f"}, invalid_block_ids={1}))
    assert planner.get_num_new_matched_tokens(seq, 0) == (0, False)
    planner.update_state_after_alloc(seq, [3, 1, 2, 0], 0)
    meta = planner.build_connector_meta(SchedulerOutput([ScheduledRequest(seq, 0, 50)]))
    assert [(sp.start, sp.end) for sp in meta.saves[0].spans][:1] == [(16, 32)]  # from the bad block on
    planner.request_finished(seq, [3, 1, 2, 0])
    again = Sequence("f", ids, SamplingParams(max_tokens=1))  # the id's next request loads again
    assert planner.get_num_new_matched_tokens(again, 0) == (32, True)


def test_over_tiles_loads_and_saves_cover_whole_blocks(default_model_path: Path) -> None:
    """A keyspace over pages moved as whole tiles (block size 4 here): the partial last chunk
    is stored cut to its last whole block, a load never starts inside a block, and it stops
    before the last token as any load does (the worker moves that block's tile whole)."""
    mc = ModelConfig.from_pretrained(default_model_path)
    tier = _CountingTier()
    config = make_config(["cpu"], chunk_size=CHUNK)
    planner = KVTierPlanner(config, Presence([LocalHeldKeys(StorageManager([tier]))]), ConnectorMetrics())
    planner.register_model(mc, torch.float32, 4, config.keyspace(mc, "float32.vec-tiles-b4", token_multiple=4))
    ids = list(range(100, 143))  # two full chunks and an 11-token partial one
    seq = Sequence("t", ids, SamplingParams(max_tokens=1))
    assert planner.get_num_new_matched_tokens(seq, 0) == (0, False)
    planner.update_state_after_alloc(seq, list(range(11)), 0)
    meta = planner.build_connector_meta(SchedulerOutput([ScheduledRequest(seq, 0, 43)]))
    assert [(sp.start, sp.end) for sp in meta.saves[0].spans] == [(0, 16), (16, 32), (32, 40)]
    _store(tier, mc, meta.saves[0].spans)
    again = Sequence("u", ids, SamplingParams(max_tokens=1))
    assert planner.get_num_new_matched_tokens(again, 0) == (40, True)
    exact = Sequence("v", ids[:32] + [7, 7, 7, 7, 7], SamplingParams(max_tokens=1))  # 37 tokens: [0, 32) held
    assert planner.get_num_new_matched_tokens(exact, 0) == (32, True)
    whole = Sequence("w", ids[:32], SamplingParams(max_tokens=1))  # the last token computed
    assert planner.get_num_new_matched_tokens(whole, 0) == (31, True)
    assert planner.get_num_new_matched_tokens(again, 2) == (0, False)  # a hit mid-block: no partial tile


def test_a_chunked_8k_prompt_has_each_token_hashed_once(default_model_path: Path, monkeypatch) -> None:
    """Lookups (asked again while a request waits), every chunked-prefill step's save plan and
    the finish share the request's spans: chain hashes over its tokens are linear in them."""
    planner, _, _ = _planner(default_model_path)
    real = keyspace_module.chain_hash
    hashed: list[int] = []

    def counting(parent: bytes, tokens) -> bytes:
        hashed.append(len(tokens))
        return real(parent, tokens)

    monkeypatch.setattr(keyspace_module, "chain_hash", counting)
    ids = list(range(8192 + 5))  # 512 chunks and a partial one
    seq = Sequence("long", ids, SamplingParams(max_tokens=1))
    for _ in range(3):
        assert planner.get_num_new_matched_tokens(seq, 0) == (0, False)
    blocks = list(range(len(ids) // 16 + 1))
    saved = []
    for done in range(0, len(ids), 512):  # chunked prefill, 512 tokens a step
        meta = planner.plan_step([StepRequest(seq, [blocks], done, min(512, len(ids) - done))])
        saved += [sp for save in meta.saves for sp in save.spans]
    seq.num_computed_tokens = len(ids)
    planner.request_finished(seq, blocks)
    assert len(hashed) == 513 and sum(hashed) == len(ids)  # each chunk hashed once, each token once
    assert saved == planner.keyspace.spans(ids)  # every chunk offered once, the partial one included
