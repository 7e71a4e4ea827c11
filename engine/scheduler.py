"""Continuous batching with chunked prefill and preemption by recompute (vLLM v1 style).

Each step has a token budget (`max_num_batched_tokens`). Running sequences are served first,
oldest first: a decode needs one token, an unfinished prefill takes what the budget allows.
If blocks run out, the newest running sequence is preempted (its blocks freed, its progress
discarded) and requeued at the head of the waiting queue; it is recomputed later, usually
from the prefix cache. Waiting sequences are admitted in arrival order while the budget,
`max_num_seqs` and the free blocks allow (no admission in a step that preempted). A request
asking for prompt logprobs reads neither the prefix cache nor a connector (vLLM's
`skip_reading_prefix_cache`): every prompt position is computed. One with `max_tokens=0`
(scoring) finishes when its prefill does, with no token.

Loads in the step (a connector answering `(n, False)`, e.g. layerwise): the loaded tokens
count as computed at admission; if the connector reports blocks of such a load unfilled after
the step (`get_block_ids_with_load_errors()` in `update_from_output`), the request is cut back
to the first of them and the step's token for it is discarded (recomputed exactly).

Asynchronous loads (a connector answering `(n, True)`): the request gets blocks for its whole
prompt and waits in `waiting_for_kv` (status WAITING_FOR_REMOTE_KVS) while the connector's
worker side fills them in the background; the running batch keeps stepping. The worker's
report after each step (`KVConnectorOutput`, applied in `update_from_output`) names finished
loads: each puts its request back at the head of the waiting queue with the loaded tokens
computed, cut back to the first block in `invalid_block_ids` (those tokens are recomputed). A
request whose connector asked to delay freeing its blocks (`request_finished` returned True: a
load still writes them, or a save will read them) keeps them in `delayed_free` until the
report names it.
"""

from __future__ import annotations

import time
from collections import deque

from engine.block_manager import BlockManager
from engine.block_pool import KVCacheBlock
from engine.kv_connector import KVConnectorOutput, KVConnectorScheduler
from engine.scheduler_output import ScheduledRequest, SchedulerOutput
from engine.sequence import Sequence, SequenceStatus


class Scheduler:
    """Decides which tokens of which sequences each step computes.

    Guarantees: a step never exceeds `max_num_batched_tokens` tokens or `max_num_seqs`
    sequences; every scheduled token has a slot; a finished sequence holds no blocks.
    """

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: set[int] | frozenset[int] = frozenset(),
        kv_connector: KVConnectorScheduler | None = None,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.connector = kv_connector
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_external_hit_tokens = 0
        # Async loads in flight: request id -> (sequence, first loaded position, tokens loaded).
        self.waiting_for_kv: dict[str, tuple[Sequence, int, int]] = {}
        # Finished requests whose blocks a connector still writes: freed once it reports them.
        self.delayed_free: dict[str, Sequence] = {}
        self.num_load_error_tokens = 0  # loaded tokens found bad and recomputed
        self.finished_req_ids: set[str] = set()  # since the last step, for the connector's worker side

    # ---- admission ----
    def check_request(self, seq: Sequence) -> None:
        """Raises ValueError if `seq` can never run (too long, or more blocks than exist)."""
        n = seq.num_prompt_tokens
        if n == 0:
            raise ValueError("prompt is empty (0 tokens)")
        if n > self.max_model_len:
            raise ValueError(f"prompt has {n} tokens, longer than max_model_len={self.max_model_len}")
        # K/V is needed for every token but the last one generated (every prompt token when
        # max_tokens is 0: the prefill writes them all).
        kv_tokens = min(n + max(seq.sampling_params.max_tokens, 1) - 1, self.max_model_len)
        need = self.block_manager.blocks_needed(kv_tokens)
        if need > self.block_manager.num_blocks:
            raise ValueError(
                f"request needs {need} KV blocks ({kv_tokens} tokens, block_size "
                f"{self.block_manager.block_size}) but num_gpu_blocks={self.block_manager.num_blocks}"
            )

    def add(self, seq: Sequence) -> None:
        self.check_request(seq)
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        """Whether any request waits, runs or waits for K/V, or any finished one still holds
        blocks a connector writes (the loop must keep stepping to release them)."""
        return bool(self.waiting or self.running or self.waiting_for_kv or self.delayed_free)

    def has_kv_in_flight(self) -> bool:
        """Whether a connector's background load (or a delayed block release) is pending."""
        return bool(self.waiting_for_kv or self.delayed_free)

    # ---- one step ----
    def schedule(self) -> SchedulerOutput:
        """Returns the next step's plan; sequences' `num_computed_tokens` advance only in
        `update_from_output` (loaded and prefix-cached tokens are counted at admission)."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm = self.block_manager

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while bm.allocate_slots(seq, n) is None:
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted_request_ids.append(victim.request_id)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break
            out.requests.append(ScheduledRequest(seq, seq.num_computed_tokens, n))
            budget -= n
            i += 1

        while (
            self.waiting
            and budget > 0
            and not out.preempted_request_ids
            and len(self.running) < self.max_num_seqs
        ):
            seq = self.waiting[0]
            num_external, load_async = 0, False
            resumed = bool(seq.block_table)  # its async load finished: blocks held, tokens computed
            hits: list[KVCacheBlock]
            skip_cache = seq.sampling_params.skip_reading_prefix_cache
            if resumed:
                hits, num_local = [], seq.num_computed_tokens
            elif skip_cache:  # prompt logprobs: every prompt position is computed (vLLM)
                hits, num_local = [], 0
            else:
                hits, num_local = bm.get_computed_blocks(seq)
                if self.connector is not None:
                    num_external, load_async = self._ask_connector(self.connector, seq, num_local)
            if load_async and num_external > 0 and self.connector is not None:  # only a connector loads async
                # Blocks for the whole prompt now, so the finished load never waits for blocks.
                rest = seq.num_tokens - num_local - num_external
                if bm.allocate_slots(seq, rest, hits, num_external) is None:
                    break  # wait for running sequences to free blocks
                self.waiting.popleft()
                seq.num_computed_tokens = num_local
                self.connector.update_state_after_alloc(seq, seq.block_table, num_external)
                bm.record_prefix_lookup(seq.num_tokens, num_local)
                seq.status = SequenceStatus.WAITING_FOR_REMOTE_KVS
                self.waiting_for_kv[seq.request_id] = (seq, num_local, num_external)
                continue
            n = min(seq.num_tokens - num_local - num_external, budget)
            if bm.allocate_slots(seq, n, hits, num_external) is None:
                break  # wait for running sequences to free blocks
            self.waiting.popleft()
            if not resumed:
                seq.num_computed_tokens = num_local
                if self.connector is not None:
                    self.connector.update_state_after_alloc(seq, seq.block_table, num_external)
                seq.num_computed_tokens += num_external
                if not skip_cache:  # a request that skipped the lookup is not counted (vLLM)
                    bm.record_prefix_lookup(seq.num_tokens, num_local)
                self.num_external_hit_tokens += num_external
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = seq.num_computed_tokens
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.requests.append(ScheduledRequest(seq, seq.num_computed_tokens, n, num_external))
            budget -= n

        if self.connector is not None:
            out.finished_req_ids, self.finished_req_ids = self.finished_req_ids, set()
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        return out

    @staticmethod
    def _ask_connector(connector: KVConnectorScheduler, seq: Sequence, num_local: int) -> tuple[int, bool]:
        """Returns the connector's (tokens it can load after `num_local`, load_async), the
        count clamped so the last token is computed."""
        answer = connector.get_num_new_matched_tokens(seq, num_local)
        if not (isinstance(answer, tuple) and len(answer) == 2):
            raise ValueError(f"get_num_new_matched_tokens must return (num_tokens, load_async), got {answer!r}")
        num_external = max(0, min(int(answer[0] or 0), seq.num_tokens - 1 - num_local))
        return num_external, bool(answer[1])

    def _apply_finished_kv(self, kv_output: KVConnectorOutput) -> None:
        """Applies what the connector's worker side reports done: finished loads make their
        requests schedulable (cut back to the first bad block), released requests free their
        blocks."""
        done = kv_output.finished_sending | kv_output.finished_recving
        if not done:
            return
        bad_blocks = kv_output.invalid_block_ids
        resumed: list[Sequence] = []
        for rid in done:
            seq = self.delayed_free.pop(rid, None)
            if seq is not None:
                self.block_manager.free(seq)
            entry = self.waiting_for_kv.pop(rid, None)
            if entry is None:
                continue
            seq, start, n = entry
            end = start + n
            bad = [i for i, b in enumerate(seq.block_table) if b in bad_blocks]
            if bad:  # existence was not possession: recompute from the first bad block
                end = max(start, min(end, bad[0] * self.block_manager.block_size))
                self.num_load_error_tokens += start + n - end
            seq.num_computed_tokens = end
            self.num_external_hit_tokens += end - start
            self.block_manager.cache_blocks(seq)
            seq.status = SequenceStatus.WAITING
            resumed.append(seq)
        # Back at the head of the queue, in arrival order: they were admitted before the rest.
        for seq in sorted(resumed, key=lambda q: q.arrival_time, reverse=True):
            self.waiting.appendleft(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.PREEMPTED
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def update_from_output(self, out: SchedulerOutput, sampled: list[int | None],
                           kv_output: KVConnectorOutput | None = None) -> list[Sequence]:
        """Applies the connector's report on the step (if any), advances each scheduled
        sequence by its tokens, appends sampled tokens, applies the token stop conditions and
        frees finished sequences; then resumes requests whose background load ended. Returns
        the sequences that got a new token, finished or not."""
        progressed: list[Sequence] = []
        now = time.monotonic()
        kv_output = kv_output or KVConnectorOutput()
        if self.connector is not None:
            self.connector.update_connector_output(kv_output)
        bad_blocks = kv_output.invalid_block_ids
        for req, token in zip(out.requests, sampled, strict=True):
            seq = req.seq
            if req.request_id in kv_output.num_cached_tokens:
                seq.num_cached_tokens = kv_output.num_cached_tokens[req.request_id]
            if bad_blocks and req.num_external_tokens and self._undo_failed_load(req, bad_blocks):
                continue  # its token came from K/V that never arrived: recomputed instead
            seq.num_computed_tokens += req.num_new_tokens
            self.block_manager.cache_blocks(seq)
            if token is None:
                continue  # a prefill chunk short of the last token samples nothing
            if seq.sampling_params.max_tokens == 0:  # scoring: the prompt's logprobs are the result
                progressed.append(seq)
                self._finish(seq, SequenceStatus.FINISHED_LENGTH, now)
                continue
            seq.output_token_ids.append(token)
            if seq.first_token_time is None:
                seq.first_token_time = now
            progressed.append(seq)
            status = self._stop_status(seq, token)
            if status is not None:
                self._finish(seq, status, now)
        self._apply_finished_kv(kv_output)
        return progressed

    def _undo_failed_load(self, req: ScheduledRequest, bad_blocks: set[int]) -> bool:
        """Cuts a request whose in-step load left blocks in `bad_blocks` unfilled back to the
        first of them (the step's own tokens and output are discarded); returns whether it did."""
        seq = req.seq
        bad = next((i for i, b in enumerate(seq.block_table) if b in bad_blocks), None)
        if bad is None:
            return False
        start = req.num_computed_tokens - req.num_external_tokens
        end = max(start, min(req.num_computed_tokens, bad * self.block_manager.block_size))
        lost = req.num_computed_tokens - end
        self.num_load_error_tokens += lost
        self.num_external_hit_tokens -= lost
        seq.num_computed_tokens = end
        seq.num_cached_tokens = min(seq.num_cached_tokens, end)
        self.block_manager.cache_blocks(seq)
        return True

    def _stop_status(self, seq: Sequence, token: int) -> SequenceStatus | None:
        p = seq.sampling_params
        if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            seq.stop_reason = token
            return SequenceStatus.FINISHED_STOPPED
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

    def finish_request(self, seq: Sequence, status: SequenceStatus) -> None:
        """Finishes an unfinished `seq` with `status` (a stop string matched, an abort): its
        blocks are freed now, after the connector's `request_finished`."""
        if not seq.is_finished:
            self._finish(seq, status, time.monotonic())

    def _finish(self, seq: Sequence, status: SequenceStatus, now: float) -> None:
        seq.status = status
        seq.finish_time = now
        if seq in self.running:
            self.running.remove(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self.waiting_for_kv.pop(seq.request_id, None)
        delay = False
        if self.connector is not None:
            self.finished_req_ids.add(seq.request_id)
            delay = bool(self.connector.request_finished(seq, list(seq.block_table)))
        if delay:  # a load still writes its blocks, or a save will read them: freed when reported
            self.delayed_free[seq.request_id] = seq
        else:
            self.block_manager.free(seq)

    def abort(self, request_id: str) -> Sequence | None:
        """Finishes a request as aborted wherever it is; returns it, or None if unknown."""
        waiting_for_kv = [entry[0] for entry in self.waiting_for_kv.values()]
        for seq in [*self.running, *self.waiting, *waiting_for_kv]:
            if seq.request_id == request_id:
                self._finish(seq, SequenceStatus.FINISHED_ABORTED, time.monotonic())
                return seq
        return None
