"""The connector protocol, exercised by a small in-memory connector whose two halves record
every call into one list.

The worker half saves each request's prompt K/V through `save_kv_layer` and loads it for a
later request with the same prompt prefix through `start_load_kv`; the only thing the
scheduler half hands it is the step's metadata. So the test checks the call order of both
halves, and that loaded tokens really replace compute (and really are read by the model).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.kv_cache import request_slots
from engine.kv_connector import KVConnector, KVConnectorOutput, KVConnectorScheduler, KVConnectorWorker
from harness.text import long_text

pytestmark = pytest.mark.slow
PARAMS = SamplingParams(temperature=0.0, max_tokens=12)
Store = dict[tuple[int, ...], list[torch.Tensor]]  # prompt -> per layer [2, n, H, D]


@dataclass
class StepMeta:
    # (slots, stored prompt, first position, count) to load this step
    loads: list[tuple[torch.Tensor, tuple[int, ...], int, int]] = field(default_factory=list)
    # (request id, slots, the prompt once this save completes it, else None) to save this step
    saves: list[tuple[str, torch.Tensor, tuple[int, ...] | None]] = field(default_factory=list)


class RecordingScheduler(KVConnectorScheduler):
    def __init__(self, calls: list[tuple], store: Store) -> None:
        self.calls = calls
        self.store = store
        self.block_size = 0
        self.pending: dict[str, tuple[tuple[int, ...], int, int, list[int]]] = {}

    def register_model(self, model_config, kv_dtype, block_size) -> None:
        self.calls.append(("scheduler.register_model", model_config.num_layers, kv_dtype, block_size))
        self.block_size = block_size

    def get_num_new_matched_tokens(self, seq, num_computed_tokens: int) -> tuple[int, bool]:
        self.calls.append(("get_num_new_matched_tokens", seq.request_id, num_computed_tokens))
        toks = tuple(seq.all_token_ids)
        best = max((len(k) for k in self.store if toks[: len(k)] == k), default=0)
        return max(0, best - num_computed_tokens), False

    def update_state_after_alloc(self, seq, block_ids, num_external_tokens) -> None:
        self.calls.append(("update_state_after_alloc", seq.request_id, list(block_ids), num_external_tokens,
                           seq.num_computed_tokens))
        if num_external_tokens:
            key = max((k for k in self.store if tuple(seq.all_token_ids[: len(k)]) == k), key=len)
            self.pending[seq.request_id] = (key, seq.num_computed_tokens, num_external_tokens, list(block_ids))

    def build_connector_meta(self, scheduler_output) -> StepMeta:
        meta = StepMeta()
        bs = self.block_size
        for r in scheduler_output.requests:
            if r.request_id in self.pending:
                key, start, n, blocks = self.pending.pop(r.request_id)
                meta.loads.append((request_slots(blocks, bs, start, start + n), key, start, n))
            end = min(r.num_computed_tokens + r.num_new_tokens, r.num_prompt_tokens)
            if end > r.num_computed_tokens:  # prompt tokens computed this step
                done = tuple(r.seq.prompt_token_ids) if end == r.num_prompt_tokens else None
                meta.saves.append((r.request_id, request_slots(r.block_ids, bs, r.num_computed_tokens, end), done))
        self.calls.append(("build_connector_meta", [(r.request_id, r.num_computed_tokens, r.num_new_tokens)
                                                    for r in scheduler_output.requests]))
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self.calls.append(("update_connector_output", output.is_empty))

    def request_finished(self, seq, block_ids) -> bool:
        self.calls.append(("request_finished", seq.request_id, list(block_ids)))
        return False

    def shutdown(self) -> None:
        self.calls.append(("scheduler.shutdown",))


class RecordingWorker(KVConnectorWorker):
    def __init__(self, calls: list[tuple], store: Store) -> None:
        self.calls = calls
        self.store = store
        self.kv_caches: list[torch.Tensor] = []
        self.saving: dict[str, dict[int, list[torch.Tensor]]] = defaultdict(lambda: defaultdict(list))
        self.meta: StepMeta | None = None
        self.corrupt = False

    @staticmethod
    def _flat(layer: torch.Tensor) -> torch.Tensor:
        return layer.view(2, -1, layer.shape[-2], layer.shape[-1])

    def register_kv_caches(self, kv_caches) -> None:
        self.calls.append(("register_kv_caches", len(kv_caches), tuple(kv_caches[0].shape)))
        self.kv_caches = kv_caches

    def bind_connector_metadata(self, metadata) -> None:
        self.calls.append(("bind_connector_metadata",))
        self.meta = metadata

    def clear_connector_metadata(self) -> None:
        self.calls.append(("clear_connector_metadata",))
        self.meta = None

    def start_load_kv(self, attn_metadata) -> None:
        assert self.meta is not None
        self.calls.append(("start_load_kv", [(start, n) for _, _, start, n in self.meta.loads]))
        for slots, key, start, n in self.meta.loads:
            for layer, stored in zip(self.kv_caches, self.store[key]):
                src = stored[:, start: start + n]
                self._flat(layer)[:, slots] = torch.zeros_like(src) if self.corrupt else src.to(layer.dtype)

    def wait_for_layer_load(self, layer_idx: int) -> None:
        self.calls.append(("wait_for_layer_load", layer_idx))

    def save_kv_layer(self, layer_idx, kv_layer, attn_metadata) -> None:
        assert self.meta is not None
        self.calls.append(("save_kv_layer", layer_idx))
        for rid, slots, _ in self.meta.saves:
            self.saving[rid][layer_idx].append(self._flat(kv_layer)[:, slots].clone())

    def wait_for_save(self) -> None:
        assert self.meta is not None
        self.calls.append(("wait_for_save",))
        for rid, _, prompt in self.meta.saves:
            if prompt is not None:  # the whole prompt is saved (none of it loaded)
                parts = self.saving.pop(rid)
                kv = [torch.cat(parts[i], dim=1) for i in range(len(self.kv_caches))]
                if kv[0].shape[1] == len(prompt):
                    self.store[prompt] = kv

    def get_finished(self, finished_req_ids):
        self.calls.append(("get_finished", sorted(finished_req_ids)))
        for rid in finished_req_ids:
            self.saving.pop(rid, None)
        return None, None

    def shutdown(self) -> None:
        self.calls.append(("worker.shutdown",))


@contextmanager
def recording_llm(model: Path, **kw) -> Iterator[tuple[LLM, list[tuple], RecordingWorker]]:
    calls: list[tuple] = []
    store: Store = {}
    worker = RecordingWorker(calls, store)
    llm = LLM(str(model), device="cpu", num_gpu_blocks=64,
              kv_connector=KVConnector(RecordingScheduler(calls, store), worker), **kw)
    try:
        yield llm, calls, worker
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def prompt(default_model_path: Path) -> dict:
    from engine.model_loader import load_tokenizer

    return {"prompt_token_ids": load_tokenizer(default_model_path).encode(long_text(6))[:203]}


@pytest.fixture(scope="module")
def reference(default_model_path: Path, prompt: dict) -> list[int]:
    with LLM(str(default_model_path), device="cpu", num_gpu_blocks=64) as llm:
        return llm.generate(prompt, PARAMS)[0].outputs[0].token_ids


def step_calls(calls: list[tuple]) -> list[list[tuple]]:
    steps: list[list[tuple]] = []
    cur: list[tuple] | None = None
    for c in calls:
        if c[0] == "bind_connector_metadata":
            cur = []
        if cur is not None:
            cur.append(c)
        if c[0] == "clear_connector_metadata" and cur is not None:
            steps.append(cur)
            cur = None
    return steps


def test_hooks_order_and_arguments(default_model_path: Path, prompt: dict, reference: list[int]) -> None:
    with recording_llm(default_model_path, enable_prefix_caching=False) as (llm, calls, _):
        num_layers = llm.model_config.num_layers
        assert calls[0] == ("register_kv_caches", num_layers, (2, llm.get_stats()["num_gpu_blocks"], 16, 3, 64))
        assert calls[1] == ("scheduler.register_model", num_layers, torch.float32, 16)
        out = llm.generate(prompt, PARAMS)[0]
        assert out.outputs[0].token_ids == reference and out.num_cached_tokens == 0
        names = [c[0] for c in calls]
        assert names.count("get_num_new_matched_tokens") == 1 and names.count("update_state_after_alloc") == 1
        assert calls[names.index("update_state_after_alloc")][3] == 0
        steps = step_calls(calls)
        assert len(steps) == len(reference)  # one prefill step, then one decode step per token
        for s in steps:
            layer_calls = [c for c in s if c[0] in ("wait_for_layer_load", "save_kv_layer")]
            assert layer_calls == [(n, i) for i in range(num_layers) for n in ("wait_for_layer_load", "save_kv_layer")]
            assert [c[0] for c in s][:2] == ["bind_connector_metadata", "start_load_kv"]
            assert [c[0] for c in s][-3:] == ["wait_for_save", "get_finished", "clear_connector_metadata"]
        # Each step's meta is built before the step runs; the worker's report is handed back after it.
        meta_at = [i for i, n in enumerate(names) if n == "build_connector_meta"]
        bound_at = [i for i, n in enumerate(names) if n == "bind_connector_metadata"]
        report_at = [i for i, n in enumerate(names) if n == "update_connector_output"]
        assert len(meta_at) == len(bound_at) == len(report_at) == len(steps)
        assert all(m < b < r for m, b, r in zip(meta_at, bound_at, report_at))
        # request_finished comes after the last step and before the blocks are freed.
        fin = calls[names.index("request_finished")]
        assert len(fin[2]) == -(-(203 + 11) // 16)
        assert names.index("request_finished") > max(i for i, n in enumerate(names) if n == "clear_connector_metadata")
        assert tuple(prompt["prompt_token_ids"]) in llm.engine.kv_connector.worker.store
    assert calls[-2:] == [("worker.shutdown",), ("scheduler.shutdown",)]


def test_loaded_tokens_are_not_recomputed_and_are_used(
    default_model_path: Path, prompt: dict, reference: list[int]
) -> None:
    with recording_llm(default_model_path, enable_prefix_caching=False) as (llm, calls, worker):
        first = llm.generate(prompt, PARAMS)[0]
        calls.clear()
        out = llm.generate(prompt, PARAMS)[0]
        # The finished request's id reaches the worker side with the next step.
        assert [c for c in calls if c[0] == "get_finished"][0] == ("get_finished", [first.request_id])
        # All but the last prompt token come from the connector; only 1 token is computed.
        assert out.num_cached_tokens == 202
        assert out.outputs[0].token_ids == reference
        first_step = step_calls(calls)[0]
        assert first_step[1] == ("start_load_kv", [(0, 202)])
        assert ("build_connector_meta", [(out.request_id, 202, 1)]) in calls
        assert llm.get_stats()["connector_hit_tokens"] == 202
        # Proof the model reads what was loaded: zeroed K/V changes the continuation.
        worker.corrupt = True
        bad = llm.generate(prompt, PARAMS)[0]
        assert bad.num_cached_tokens == 202 and bad.outputs[0].token_ids != reference
        stats = llm.get_stats()
        assert stats["num_free_blocks"] == stats["num_gpu_blocks"]


def test_connector_only_asked_beyond_the_engine_prefix_cache(
    default_model_path: Path, prompt: dict, reference: list[int]
) -> None:
    with recording_llm(default_model_path) as (llm, calls, _):
        llm.generate(prompt, PARAMS)
        calls.clear()
        out = llm.generate(prompt, PARAMS)[0]
        (ask,) = [c for c in calls if c[0] == "get_num_new_matched_tokens"]
        assert ask[2] == 192  # 12 full blocks from the engine's own cache
        (alloc,) = [c for c in calls if c[0] == "update_state_after_alloc"]
        assert alloc[3] == 10 and alloc[4] == 192  # the connector loads 192..202; 202 is computed
        assert out.num_cached_tokens == 202 and out.outputs[0].token_ids == reference


def test_a_bare_count_answer_is_refused_naming_the_protocol(default_model_path: Path, prompt: dict) -> None:
    class CountOnly(RecordingScheduler):
        def get_num_new_matched_tokens(self, seq, num_computed_tokens: int):  # type: ignore[override]
            return 0  # the pre-async protocol: no load_async flag

    calls: list[tuple] = []
    conn = KVConnector(CountOnly(calls, {}), RecordingWorker(calls, {}))
    with LLM(str(default_model_path), device="cpu", num_gpu_blocks=64, kv_connector=conn) as llm:
        with pytest.raises(ValueError, match=r"must return \(num_tokens, load_async\)"):
            llm.generate(prompt, PARAMS)
