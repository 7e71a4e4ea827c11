"""The step loop: requests in, one scheduled forward per `step()`, finished outputs out."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

from engine.block_manager import BlockManager
from engine.detokenizer import IncrementalDetokenizer, find_stop_string
from engine.engine_config import EngineConfig
from engine.kv_connector import KVConnector
from engine.logprobs import TokenDecoder, record_step_logprobs
from engine.model_loader import load_tokenizer
from engine.model_runner import ModelRunner
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.parallel_sampling import ParentRequests
from engine.progress import PrefillProgress, progress_enabled
from engine.request_log import log_finished
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus
from kvkeys.tenants import tenant_tag, validate_cache_salt

PromptType = str | list[str] | Mapping[str, Any]  # list[str]: one prompt in segments
# The longest `step()` blocks when nothing can run until a connector's background load ends.
KV_WAIT_S = 0.05


class LLMEngine:
    """Wires runner, block manager and scheduler. Not thread-safe: one caller drives `step()`."""

    def __init__(self, config: EngineConfig, kv_connector: KVConnector | None = None) -> None:
        if kv_connector is not None and not isinstance(kv_connector, KVConnector):
            raise ValueError(f"kv_connector must be a KVConnector, got {type(kv_connector).__name__}")
        self.config = config
        self.kv_connector = kv_connector
        self.runner = ModelRunner(config, kv_connector.worker if kv_connector is not None else None)
        mc = self.runner.model_config
        self.model_config = mc
        if kv_connector is not None:
            kv_connector.planner.register_model(mc, self.runner.dtype, config.block_size)
        if config.max_model_len is not None and config.max_model_len > mc.max_model_len:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's limit {mc.max_model_len}")
        self.max_model_len = config.max_model_len or mc.max_model_len
        assert mc.path is not None  # ModelConfig.from_pretrained records the checkpoint's path
        self.tokenizer = load_tokenizer(mc.path)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            eos_token_ids=set(mc.eos_token_ids),
            kv_connector=kv_connector.planner if kv_connector is not None else None,
        )
        self._ids = itertools.count()
        self._decode = TokenDecoder(self.tokenizer)  # logprobs' decoded tokens
        self.parents = ParentRequests()  # live n > 1 requests (engine/parallel_sampling.py)
        # A bar for prefills longer than one step, when progress is shown (engine/progress.py).
        self._prefill_progress = PrefillProgress(config.max_num_batched_tokens) if progress_enabled() else None

    # ---- requests ----
    def make_sequence(self, prompt: PromptType, params: SamplingParams, request_id: str | None = None) -> Sequence:
        """Returns a validated, not yet queued Sequence; ValueError names what is wrong."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        params.validate()
        params.verify_vocab(self.model_config.vocab_size)
        text: str | None = None
        segment_lens: list[int] | None = None
        cache_salt = None
        if isinstance(prompt, Mapping):  # vLLM's TextPrompt / TokensPrompt, with its cache_salt
            cache_salt = validate_cache_salt(prompt.get("cache_salt"))
            if prompt.get("multi_modal_data") is not None:  # vLLM's images, audio, video
                raise ValueError("multi_modal_data: image and other non-text input is not supported "
                                 "(the engine runs text-only prompts)")
            if "prompt_token_ids" not in prompt and isinstance(prompt.get("prompt"), (str, list)):
                prompt = prompt["prompt"]
        sep = self.kv_connector.planner.segment_separator if self.kv_connector is not None else None
        if isinstance(prompt, str) and sep and sep in prompt:
            prompt = prompt.split(sep)
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            # Segments are tokenized one by one so each has the same ids wherever it appears.
            token_ids: list[int] = []
            lens: list[int] = []
            for i, part in enumerate(prompt):
                ids = self.tokenizer.encode(part, add_special_tokens=i == 0) if part else []
                if not ids:
                    raise ValueError(f"prompt segment {i} is empty (0 tokens)")
                token_ids += ids
                lens.append(len(ids))
            segment_lens = lens
            text = "".join(prompt)
        elif isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty (0 tokens)")
            text = prompt
            token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, Mapping) and "prompt_token_ids" in prompt:
            token_ids = list(prompt["prompt_token_ids"])
            vocab = self.model_config.vocab_size
            for t in token_ids:
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                    raise ValueError(f"prompt_token_ids holds {t!r}, not a token id in [0, {vocab})")
            if prompt.get("segment_lens") is not None:
                segment_lens = list(prompt["segment_lens"])
                if (
                    not segment_lens
                    or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in segment_lens)
                    or sum(segment_lens) != len(token_ids)
                ):
                    raise ValueError(f"segment_lens {segment_lens!r} must be positive ints summing to "
                                     f"the {len(token_ids)} prompt tokens")
        else:
            raise ValueError("a prompt must be a str, a list of str segments, or a dict with 'prompt_token_ids' "
                             "or 'prompt'")
        image = self.model_config.image_token_id  # a multimodal checkpoint's, run as its text part
        if image is not None and image in token_ids:
            raise ValueError(f"prompt holds token {image}, {self.model_config.checkpoint_architecture}'s image "
                             "placeholder: image input is not supported (text-only prompts)")
        rid = request_id if request_id is not None else self.next_request_id()
        seq = Sequence(rid, token_ids, params, prompt=text, segment_lens=segment_lens, cache_salt=cache_salt)
        self.scheduler.check_request(seq)
        return seq

    def next_request_id(self) -> str:
        """Returns a request id no earlier call returned (ids the engine assigns itself)."""
        return str(next(self._ids))

    def add_sequence(self, seq: Sequence) -> None:
        """Queues `seq`; an `n > 1` request as its n samples (its outputs keep its id)."""
        if seq.sampling_params.n == 1:
            self.scheduler.add(seq)
            return
        self.scheduler.check_request(seq)
        for child in self.parents.fan_out(seq):
            self.scheduler.add(child)

    def add_request(self, prompt: PromptType, params: SamplingParams, request_id: str | None = None) -> str:
        """Queues one request; returns its id."""
        seq = self.make_sequence(prompt, params, request_id)
        self.add_sequence(seq)
        return seq.request_id

    def abort_request(self, request_id: str) -> None:
        parent = self.parents.pop(request_id)
        for child in parent.children if parent is not None else []:
            self.scheduler.abort(child.request_id)
        if parent is None:
            self.scheduler.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        """Whether `step()` still has work: requests waiting, running or waiting for a
        connector's background load (or holding blocks a load still writes)."""
        return self.scheduler.has_unfinished()

    def is_waiting_for_kv(self) -> bool:
        """Whether the engine's only work is a connector's background loads: `step()` then
        blocks briefly (up to `KV_WAIT_S`) for a load to finish and returns []."""
        s = self.scheduler
        return s.has_kv_in_flight() and not s.running

    # ---- the loop ----
    def step(self, kv_wait_s: float = KV_WAIT_S) -> list[RequestOutput]:
        """Runs one scheduled forward; returns an output (cumulative tokens and text, with a
        `finished` flag) for every request that got a new token in it, as vLLM's `step()`.
        With only background loads left, it waits up to `kv_wait_s` for one and returns []."""
        out = self.scheduler.schedule()
        if out.is_empty:
            if self.kv_connector is not None and self.scheduler.has_kv_in_flight():
                # Only the connector's work is left: run its hooks, waiting (bounded) for a
                # background load to end, never spinning hot.
                _, kv_output = self.runner.execute_model(out, kv_wait_s)
                self.scheduler.update_from_output(out, [], kv_output)
                return []
            if self.scheduler.waiting and not self.scheduler.running:
                # Cannot happen for requests that passed check_request; fail loudly, not spin.
                raise RuntimeError("scheduler made no progress with an idle engine")
            return []
        result, kv_output = self.runner.execute_model(out)
        progressed = self.scheduler.update_from_output(out, result.sampled, kv_output)
        record_step_logprobs(out.requests, result.logprobs, self._decode)
        if self._prefill_progress is not None:
            self._prefill_progress.update(out.requests)
        for seq in progressed:
            self._detokenize(seq)
            if seq.is_finished:
                log_finished(seq, self.kv_connector.planner if self.kv_connector is not None else None)
        outputs = {o.request_id: o for o in map(self.make_output, progressed)}  # one per n > 1 parent
        for rid, o in outputs.items():
            if o.finished:
                self.parents.pop(rid)
        return list(outputs.values())

    def _detokenize(self, seq: Sequence) -> None:
        """Extends `seq`'s text by its new token and applies the stop strings: a match cuts
        the text and finishes the request (a length finish becomes a stop)."""
        p = seq.sampling_params
        if seq.detokenizer is None:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, p.skip_special_tokens)
        detok = seq.detokenizer
        new = detok.update(seq.output_token_ids, final=seq.is_finished)
        # Stop strings count only past min_tokens (vLLM).
        hit = find_stop_string(detok.text, len(new), p.stop) if seq.num_output_tokens > p.min_tokens else None
        if hit is None:
            return
        pos, stop = hit
        detok.text = detok.text[: pos + len(stop) if p.include_stop_str_in_output else pos]
        seq.stop_reason = stop
        if seq.is_finished:
            seq.status = SequenceStatus.FINISHED_STOPPED
        else:
            self.scheduler.finish_request(seq, SequenceStatus.FINISHED_STOPPED)

    def make_output(self, seq: Sequence) -> RequestOutput:
        """Returns `seq`'s output so far; for a sample of an `n > 1` request, the request's."""
        parent = self.parents.parent_of(seq.request_id)
        if parent is not None:
            return parent.merge([self._output(c) for c in parent.children])
        return self._output(seq)

    def _output(self, seq: Sequence) -> RequestOutput:
        p = seq.sampling_params
        completion = CompletionOutput(
            index=0,
            text=seq.output_text,
            token_ids=list(seq.output_token_ids),
            finish_reason=seq.status.value if seq.is_finished else None,
            stop_reason=seq.stop_reason,
            cumulative_logprob=seq.cumulative_logprob if p.logprobs is not None else None,
            logprobs=list(seq.logprobs or []) if p.logprobs is not None else None,
        )
        metrics = RequestMetrics(seq.arrival_time, seq.first_scheduled_time, seq.first_token_time, seq.finish_time)
        return RequestOutput(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=list(seq.prompt_token_ids),
            outputs=[completion],
            finished=seq.is_finished,
            num_cached_tokens=max(seq.num_cached_tokens, 0),
            metrics=metrics,
            num_preemptions=seq.num_preemptions,
            prompt_logprobs=list(seq.prompt_logprobs) if seq.prompt_logprobs is not None else None,
        )

    def get_stats(self) -> dict[str, Any]:
        bm = self.block_manager
        q, h = bm.prefix_cache_queries, bm.prefix_cache_hits
        return {
            "prefix_cache_queries": q,
            "prefix_cache_hits": h,
            "prefix_cache_hit_rate": h / q if q else 0.0,
            "connector_hit_tokens": self.scheduler.num_external_hit_tokens,
            "connector_load_error_tokens": self.scheduler.num_load_error_tokens,
            "num_waiting_for_kv": len(self.scheduler.waiting_for_kv),
            "num_gpu_blocks": bm.num_blocks,
            "num_free_blocks": bm.num_free_blocks,
            "block_usage": bm.pool.usage(),
            "num_cached_blocks": len(bm.pool.cached),
            "num_preemptions": self.scheduler.num_preemptions,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
        }

    # ---- what a serving layer asks (kvtier/server/engine_loop.py) ----
    @property
    def max_num_seqs(self) -> int:
        """Returns the most requests one step runs (fixed at construction)."""
        return self.scheduler.max_num_seqs

    def check_request(self, seq: Sequence) -> None:
        """Raises ValueError if `seq` can never run here (longer than max_model_len, or more
        KV blocks than exist); reads only limits fixed at construction."""
        self.scheduler.check_request(seq)

    def num_cached_prefix_tokens(self, token_ids: list[int], cache_salt: str | None = None) -> int:
        """Returns how many leading tokens of `token_ids` the prefix cache holds now for
        requests of `cache_salt` (whole blocks, never the last token); read-only: takes no
        block references, counts no query."""
        return self.block_manager.num_cached_prefix_tokens(token_ids, cache_salt)

    def load(self) -> tuple[int, int]:
        """Returns (requests running, requests waiting), the waiting ones including those
        waiting for a connector's load."""
        s = self.scheduler
        return len(s.running), len(s.waiting) + len(s.waiting_for_kv)

    def forget_tenant(self, cache_salt: str) -> int:
        """Uncaches every prefix-cache block that requests of `cache_salt` registered (see
        `BlockPool.forget_tenant`); returns how many. ValueError for an invalid salt."""
        salt = validate_cache_salt(cache_salt)
        if salt is None:
            raise ValueError("cache_salt must be a non-empty string")
        return self.block_manager.pool.forget_tenant(tenant_tag(salt))

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached block hash; returns False, changing nothing, while any request
        holds blocks."""
        return self.block_manager.pool.reset_prefix_cache()
