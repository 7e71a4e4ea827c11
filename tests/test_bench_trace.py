"""benchmarks/bench_trace.py's references and replays on tiny hand-made traces: the offline
optimum never loses to a real tier's LRU at the same capacity, reaches the unlimited bound once
everything fits, and LRU, the cpu tier and the cache server's store agree block for block;
chain-aware LRU keeps a chain's head where LRU keeps its tail; every policy is replayed and
compared with LRU. The replays through the tiers themselves are kvstore/trace_replay.py's
(tests/kvstore/test_trace_replay.py)."""

from __future__ import annotations

from benchmarks.bench_trace import (
    against_lru,
    load_trace,
    meets_target,
    next_uses,
    replay_chain_lru,
    replay_optimum,
    replay_reuse_oracle,
    replay_server,
    replay_unlimited,
)
from kvstore.backends.memory import CPUBackend
from kvstore.cache_server.store import ByteStore
from kvstore.eviction import POLICIES
from kvstore.trace_replay import PAYLOAD_BYTES as ITEM
from kvstore.trace_replay import replay_tier
from kvstore.traces import Request


def _req(*blocks: int) -> Request:
    return Request(512 * len(blocks), blocks)


def test_a_prefix_hit_is_the_run_of_held_leading_blocks() -> None:
    trace = [_req(1, 2, 3), _req(1, 2, 4), _req(5, 2, 3)]  # 2, 3 held later, but not as a prefix of 5
    assert replay_unlimited(trace).hit_tokens == 2 * 512
    assert Request(700, (1, 2)).block_tokens(1) == 188  # the last block is short


def test_the_optimum_beats_lru_where_lru_thrashes_and_matches_unlimited_when_all_fits() -> None:
    # a cyclic scan of 4 one-block prompts over a 3-block cache: LRU never hits, the optimum does
    trace = [_req(i % 4) for i in range(40)]
    nexts = next_uses(trace)
    lru = replay_tier(trace, CPUBackend(byte_budget=3 * ITEM))
    best = replay_optimum(trace, 3, nexts)
    assert lru.hit_tokens == 0 and best.rate > 0.6
    assert replay_optimum(trace, 4, nexts).hit_tokens == replay_unlimited(trace).hit_tokens


def test_the_cpu_tier_and_the_cache_server_evict_alike_on_a_real_trace() -> None:
    trace = load_trace("synthetic")[:300]
    distinct = len({b for r in trace for b in r.blocks})
    blocks = distinct // 10
    cpu = replay_tier(trace, CPUBackend(byte_budget=blocks * ITEM))
    server = replay_server(trace, ByteStore(blocks * (len("kvtier:trace:float16:v1:c512:") + 32 + ITEM), pin_budget=0))
    best = replay_optimum(trace, blocks, next_uses(trace))
    assert cpu.hit_tokens == server.hit_tokens <= best.hit_tokens <= replay_unlimited(trace).hit_tokens
    assert cpu.prompt_tokens == sum(r.input_length for r in trace)


def test_chain_aware_lru_keeps_the_head_that_lru_evicts_first() -> None:
    trace = [_req(1, 2, 3), _req(4), _req(1, 2, 3)]
    lru = replay_tier(trace, CPUBackend(byte_budget=3 * ITEM))
    assert lru.hit_tokens == 0  # 4 evicted block 1, the head: the chain is worthless
    assert replay_chain_lru(trace, 3).hit_tokens == 2 * 512  # 4 evicted block 3, the tail


def test_every_policy_is_replayed_and_compared_with_lru() -> None:
    trace = load_trace("synthetic")[:300]
    distinct = len({b for r in trace for b in r.blocks})
    rows = []
    for share in (0.02, 0.05, 0.10, 0.20):
        blocks = max(1, int(distinct * share))
        row = {"share": share, **{f"cpu {p}": replay_tier(trace, CPUBackend(byte_budget=blocks * ITEM, eviction=p)).rate
                                  for p in POLICIES}}
        row["chain lru (sim)"] = replay_chain_lru(trace, blocks).rate
        row["lru + reuse oracle (sim)"] = replay_reuse_oracle(trace, blocks, next_uses(trace)).rate
        assert row["lru + reuse oracle (sim)"] >= row["cpu lru"]
        rows.append(row)
    ratios = against_lru(rows)
    assert set(ratios) == {f"cpu {p}" for p in POLICIES} | {"chain lru (sim)", "lru + reuse oracle (sim)"}
    assert ratios["cpu lru"]["mean"] == 1.0 and not meets_target(ratios["cpu lru"])
    assert all(0 < r["min"] <= r["mean"] for r in ratios.values())
