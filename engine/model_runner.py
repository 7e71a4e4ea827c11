"""Owns the model and the paged KV cache; turns a scheduled step into tensors, runs it, samples.

The per-layer caches are `(2, num_blocks, block_size, num_kv_heads, head_size)` tensors
allocated once. Batch tensors (input ids, positions, slot mapping, block tables) are built on
the host with vectorised ops and moved to the device in one copy each.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.attention_metadata import AttentionMetadata
from engine.engine_config import EngineConfig
from engine.kv_cache import kv_bytes_per_block, slot_mapping, zeroed_pool
from engine.kv_connector import KVConnectorOutput, KVConnectorWorker
from engine.logprobs import PromptLogprobsChunk, StepLogprobs, prompt_top_logprobs
from engine.model_loader import load_model, resolve_device, resolve_dtype
from engine.sampler import Sampler
from engine.scheduler_output import SchedulerOutput
from engine.sequence import Sequence
from hostmem import keep_freed_memory

# CPU has no allocator to query; this is the default KV budget there.
_CPU_KV_BUDGET_BYTES = 1 << 30


class ModelRunner:
    """Runs steps on one device. Guarantees: the KV pool is allocated once and never resized."""

    def __init__(self, config: EngineConfig, kv_connector: KVConnectorWorker | None = None) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        if self.device.type == "cpu":  # a step's activations are host memory: keep it between steps
            keep_freed_memory()
        self.model, self.model_config = load_model(config.model, self.device, self.dtype,
                                                     config.kernels)
        self.block_size = config.block_size
        self.num_blocks = self._decide_num_blocks()
        mc = self.model_config
        shape = (mc.num_layers, 2, self.num_blocks, self.block_size, mc.num_kv_heads, mc.head_size)
        # One allocation, one view per layer: the connector then moves a chunk of every layer
        # in one op (engine/kv_cache.py `_stacked_view`; benchmarks/bench_load.py).
        self.kv_caches = list(zeroed_pool(shape, self.dtype, self.device).unbind(0))
        self.connector = kv_connector
        if kv_connector is not None:
            kv_connector.register_model(mc)
            kv_connector.register_model_module(self.model)
            kv_connector.register_kv_caches(self.kv_caches)
        self.sampler = Sampler(mc.eos_token_ids)
        # Seeds the generators of requests that bring no seed (reproducible per LLM seed).
        self._seed_rng = torch.Generator().manual_seed(config.seed)

    def _decide_num_blocks(self) -> int:
        cfg = self.config
        if cfg.num_gpu_blocks is not None:
            return cfg.num_gpu_blocks
        per_block = kv_bytes_per_block(self.model_config, self.block_size, self.dtype)
        budget = cfg.kv_cache_memory_bytes
        if budget is None:
            if self.device.type == "cuda":
                free, _total = torch.cuda.mem_get_info(self.device)
                budget = int(free * cfg.gpu_memory_utilization)
            else:
                budget = _CPU_KV_BUDGET_BYTES
        n = budget // per_block
        if n < 1:
            raise ValueError(
                f"kv_cache_memory_bytes={budget} holds no block "
                f"({per_block} bytes per block of {self.block_size} tokens)"
            )
        return int(n)

    def _generator(self, seq: Sequence) -> torch.Generator:
        if seq.generator is None:
            seed = seq.sampling_params.seed
            if seed is None:
                seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_rng))
            seq.generator = torch.Generator().manual_seed(seed)
        return seq.generator

    def prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Returns (input_ids [T], positions [T], attention metadata) on the device for a step."""
        reqs = out.requests
        n_new = torch.tensor([r.num_new_tokens for r in reqs], dtype=torch.long)
        ctx = torch.tensor([r.num_computed_tokens for r in reqs], dtype=torch.long)
        qsl = torch.zeros(len(reqs) + 1, dtype=torch.long)
        torch.cumsum(n_new, 0, out=qsl[1:])
        num_tokens = int(qsl[-1])
        token_ids: list[int] = []
        for r in reqs:
            token_ids += r.seq.token_ids_slice(r.num_computed_tokens, r.num_computed_tokens + r.num_new_tokens)
        seq_index = torch.repeat_interleave(torch.arange(len(reqs)), n_new)
        positions = torch.arange(num_tokens) - qsl[seq_index] + ctx[seq_index]
        max_blocks = max(len(r.seq.block_table) for r in reqs)
        tables = torch.zeros(len(reqs), max_blocks, dtype=torch.long)
        for i, r in enumerate(reqs):
            tables[i, : len(r.seq.block_table)] = torch.as_tensor(r.seq.block_table, dtype=torch.long)
        slots = slot_mapping(tables, seq_index, positions, self.block_size)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=slots.to(dev, non_blocking=True),
            block_tables=tables.to(dev, non_blocking=True),
            query_start_loc=qsl.tolist(),
            seq_lens=(ctx + n_new).tolist(),
            block_size=self.block_size,
            kv_connector=self.connector,
        )
        input_ids = torch.tensor(token_ids, dtype=torch.long).to(dev, non_blocking=True)
        return input_ids, positions.to(dev, non_blocking=True), meta

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput,
                      kv_wait_s: float = 0.0) -> tuple[ModelRunnerOutput, KVConnectorOutput | None]:
        """Runs one step; returns (per scheduled request the sampled token, or None for a
        prefill chunk that does not reach the request's last token, with the step's asked-for
        logprobs; the connector's report, or None without a connector). A step with no request
        runs only the connector's hooks, waiting up to `kv_wait_s` for a background load to end."""
        conn = self.connector
        if out.is_empty:
            return ModelRunnerOutput([]), None if conn is None else self._connector_step(conn, out, kv_wait_s)
        input_ids, positions, meta = self.prepare(out)
        if conn is not None:
            conn.bind_connector_metadata(out.kv_connector_metadata)
        try:
            if conn is not None:
                conn.start_load_kv(meta)
            # Only sampling rows' final hidden states are read, unless a request wants prompt logprobs.
            last_of = None if any(r.seq.sampling_params.prompt_logprobs is not None for r in out.requests) \
                else self._sampling_rows(out)
            hidden = self.model(input_ids, positions, self.kv_caches, meta, last_of)
            kv_output = None
            if conn is not None:
                conn.wait_for_save()
                kv_output = conn.build_connector_output(out.finished_req_ids)
        finally:
            if conn is not None:
                conn.clear_connector_metadata()
        return self._sample(out, hidden, meta, last_of), kv_output

    @staticmethod
    def _connector_step(conn: KVConnectorWorker, out: SchedulerOutput, kv_wait_s: float) -> KVConnectorOutput:
        """Runs the connector's hooks for a step without a forward (loads to start, saves of
        finished requests, reports); waits up to `kv_wait_s` for something to report."""
        conn.bind_connector_metadata(out.kv_connector_metadata)
        try:
            conn.start_load_kv(None)
            conn.wait_for_save()
            if kv_wait_s > 0:
                conn.wait_for_finished(kv_wait_s)
            return conn.build_connector_output(out.finished_req_ids)
        finally:
            conn.clear_connector_metadata()

    @staticmethod
    def _sampling_rows(out: SchedulerOutput) -> list[int]:
        """Returns the indices of the step's requests that sample a token from their last row."""
        return [i for i, r in enumerate(out.requests) if r.samples]

    def _sample(self, out: SchedulerOutput, hidden: torch.Tensor, meta: AttentionMetadata,
                last_of: list[int] | None) -> ModelRunnerOutput:
        """Returns per scheduled request the token sampled from its last row, or None, and the
        logprobs the step's requests asked for. `hidden`: every row's final hidden state, or
        only the last rows of requests `last_of` (the sampling ones, `_sampling_rows`), in order."""
        result = ModelRunnerOutput([None] * len(out.requests))
        rows = last_of
        if rows is None:
            result.logprobs.prompt = self._prompt_logprobs(out, hidden, meta)
            rows = self._sampling_rows(out)
            last = torch.tensor(meta.last_token_rows(rows), dtype=torch.long, device=hidden.device)
            hidden = hidden.index_select(0, last)
        if not rows:
            return result
        logits = self.model.compute_logits(hidden)
        seqs = [out.requests[i].seq for i in rows]
        params = [s.sampling_params for s in seqs]
        gens = [self._generator(s) if not s.sampling_params.greedy else None for s in seqs]
        hist = [(s.prompt_token_ids, s.output_token_ids) if s.sampling_params.uses_history else None for s in seqs]
        sampled = self.sampler.sample(logits, params, gens, hist)
        for i, t in zip(rows, sampled.token_ids.tolist()):
            result.sampled[i] = t
        if sampled.logprobs is not None:
            for j, row in enumerate(sampled.logprob_rows):
                i = rows[row]
                result.logprobs.sampled[i] = (sampled.logprobs, j, params[row].logprobs or 0)
        return result

    def _prompt_logprobs(self, out: SchedulerOutput, hidden: torch.Tensor,
                         meta: AttentionMetadata) -> dict[int, PromptLogprobsChunk]:
        """Returns, by request index, the prompt logprobs of the prompt positions this step
        computed for requests that asked (position p's row predicts prompt token p + 1)."""
        chunks: dict[int, PromptLogprobsChunk] = {}
        for i, r in enumerate(out.requests):
            k = r.seq.sampling_params.prompt_logprobs
            if k is None:
                continue
            start = r.num_computed_tokens
            end = min(start + r.num_new_tokens, r.seq.num_prompt_tokens - 1)
            if end <= start:
                continue
            q0 = meta.query_start_loc[i]
            next_ids = torch.tensor(r.seq.prompt_token_ids[start + 1 : end + 1], device=hidden.device)
            top = prompt_top_logprobs(self.model.compute_logits, hidden[q0 : q0 + end - start], next_ids, k)
            chunks[i] = PromptLogprobsChunk(start, top, k)
        return chunks


@dataclass
class ModelRunnerOutput:
    """One step's results by index in `SchedulerOutput.requests`: the sampled token (None
    for a prefill chunk short of the last token) and the logprobs asked for."""

    sampled: list[int | None]
    logprobs: StepLogprobs = field(default_factory=StepLogprobs)
