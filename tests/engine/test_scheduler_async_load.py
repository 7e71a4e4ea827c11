"""Scheduler with a connector that loads asynchronously: parked requests hold blocks but are
not scheduled, finished loads make them schedulable with those tokens computed (cut back to
the first bad block), and a finished request's blocks wait for the connector to let go.

The connector's scheduler side here offers loads, and its "worker" finishes them when the
test says so: the next step's report (`KVConnectorOutput`) names them, as a worker side's
would. The model is the test_scheduler token rule, so only scheduling is under test."""

from __future__ import annotations

from engine.kv_connector import KVConnectorOutput, KVConnectorScheduler
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence, SequenceStatus
from tests.fixtures.scheduler import expected_output, make, next_token


class ManualAsyncConnector(KVConnectorScheduler):
    """Offers `offer` tokens of every prompt asynchronously; loads end when `finish` is called
    and are reported with the next step."""

    def __init__(self, offer: int) -> None:
        self.offer = offer
        self.loading: dict[str, list[int]] = {}  # request id -> its block table at admission
        self.done: set[str] = set()
        self.bad: set[int] = set()
        self.cancelled: set[str] = set()
        self.outputs: list[KVConnectorOutput] = []

    def register_model(self, model_config, kv_dtype, block_size):
        pass

    def get_num_new_matched_tokens(self, seq, num_computed_tokens):
        n = max(0, self.offer - num_computed_tokens)
        return n, n > 0

    def update_state_after_alloc(self, seq, block_ids, num_external_tokens):
        if num_external_tokens:
            self.loading[seq.request_id] = list(block_ids)

    def finish(self, rid: str, bad_from_block: int | None = None) -> None:
        blocks = self.loading.pop(rid)
        if bad_from_block is not None:
            self.bad |= set(blocks[bad_from_block:])
        self.done.add(rid)

    def report(self) -> KVConnectorOutput:
        """What a worker side would report after a step: the loads ended since the last one."""
        out = KVConnectorOutput(finished_recving=self.done, invalid_block_ids=self.bad)
        self.done, self.bad = set(), set()
        return out

    def update_connector_output(self, output):
        self.outputs.append(output)

    def request_finished(self, seq, block_ids):
        if seq.request_id in self.loading:
            self.cancelled.add(seq.request_id)
            return True  # the "loader" still writes these blocks
        return False

    def build_connector_meta(self, scheduler_output):
        return None


def step(s):
    out = s.schedule()
    sampled = [next_token(r.seq.all_token_ids) if r.samples else None for r in out.requests]
    s.update_from_output(out, sampled, s.connector.report())
    return [(r.request_id, r.num_computed_tokens, r.num_new_tokens) for r in out.requests]


def scheduler(conn, **kw):
    s = make(**kw)
    s.connector = conn
    return s


PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def test_a_parked_request_holds_blocks_while_others_run_then_resumes_loaded():
    conn = ManualAsyncConnector(offer=0)
    s = scheduler(conn, num_blocks=64, block_size=4, budget=64)
    busy = Sequence("busy", list(range(3, 13)), PARAMS)
    s.add(busy)
    assert step(s) == [("busy", 0, 10)]
    conn.offer = 16
    warm = Sequence("warm", list(range(100, 121)), PARAMS)  # 21 tokens, 16 of them loadable
    s.add(warm)
    for _ in range(2):  # parked: not scheduled, the running request keeps stepping
        assert [r[0] for r in step(s)] == ["busy"]
        assert warm.status is SequenceStatus.WAITING_FOR_REMOTE_KVS and "warm" in s.waiting_for_kv
        assert len(warm.block_table) == 6 and s.has_unfinished() and s.has_kv_in_flight()
    conn.finish("warm")
    assert [r[0] for r in step(s)] == ["busy"]  # this step's report resumes it
    plan = step(s)
    assert ("warm", 16, 5) in plan  # loaded tokens computed: only the rest is prefilled
    assert warm.num_cached_tokens == 16 and s.num_external_hit_tokens == 16
    while s.has_unfinished():
        step(s)
    assert warm.output_token_ids == expected_output(warm.prompt_token_ids, 4)
    assert set(s.block_manager.ref_counts()) == {0}


def test_a_failed_load_is_cut_back_to_the_first_bad_block():
    conn = ManualAsyncConnector(offer=16)
    s = scheduler(conn, num_blocks=64, block_size=4, budget=64)
    seq = Sequence("r", list(range(100, 121)), PARAMS)
    s.add(seq)
    assert step(s) == []
    conn.finish("r", bad_from_block=2)  # blocks 2.. did not get their K/V
    assert step(s) == []  # this step's report resumes it
    assert step(s) == [("r", 8, 13)]  # positions 8.. are recomputed
    assert s.num_load_error_tokens == 8 and s.num_external_hit_tokens == 8
    while s.has_unfinished():
        step(s)
    assert seq.output_token_ids == expected_output(seq.prompt_token_ids, 4)
    assert set(s.block_manager.ref_counts()) == {0}


def test_abort_while_loading_frees_blocks_only_once_the_connector_lets_go():
    conn = ManualAsyncConnector(offer=16)
    s = scheduler(conn, num_blocks=64, block_size=4, budget=64)
    seq = Sequence("r", list(range(100, 121)), PARAMS)
    s.add(seq)
    step(s)
    blocks = list(seq.block_table)
    assert s.abort("r") is seq and "r" in conn.cancelled
    assert seq.status is SequenceStatus.FINISHED_ABORTED and "r" in s.delayed_free
    assert all(s.block_manager.pool.blocks[b].ref_cnt == 1 for b in blocks)
    assert s.has_unfinished()  # the loop must keep stepping to release them
    out = s.schedule()  # the worker side learns of the abort with the next step (stops the load)
    assert out.is_empty and out.finished_req_ids == {"r"}
    s.update_from_output(out, [], conn.report())
    assert "r" in s.delayed_free
    conn.finish("r")
    assert step(s) == []
    assert not s.has_unfinished() and set(s.block_manager.ref_counts()) == {0}
