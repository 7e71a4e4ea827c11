"""The sizing simulator (benchmarks/sim_scaling.py): invariants on small traces, no model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import sim_scaling
from benchmarks.sim.cache import BlockPool, ChunkTier
from benchmarks.sim.measured import load_measured
from benchmarks.sim.trace import Workload, ideal_reuse, make_trace

MEASURED = load_measured()
SMALL = ["--doc-tokens", "1024", "--question-tokens", "32", "--answer-tokens", "16", "--think-s", "20"]


def run(*argv: str) -> dict:
    args = sim_scaling.build_parser().parse_args([*SMALL, *argv])
    return sim_scaling.run(sim_scaling.scenario_from_args(args, MEASURED), MEASURED)


def test_no_reuse_means_no_hits() -> None:
    # Private documents, one round each: nothing is ever sent twice.
    out = run("--engines", "2", "--docs", "0", "--rounds", "1", "--users", "40", "--pool-blocks", "4000",
              "--tier", "cpu:1GiB", "--tier", "kvtier:8GiB")
    assert out["trace"]["ideal_reuse"] == 0.0
    for policy, r in out["policies"].items():
        assert r["all"]["hit_rate"] == 0.0, policy
        assert r["all"]["requests"] == 40


def test_kv_aware_hits_at_least_round_robin_on_a_reuse_trace() -> None:
    # No shared tier and pools that hold a few sessions each: only affinity keeps a user's
    # history where their next round lands.
    out = run("--engines", "4", "--users", "48", "--rounds", "4", "--docs", "12", "--pool-blocks", "600",
              "--rate", "0.3")
    kv, rr = out["policies"]["kv-aware"]["all"], out["policies"]["round-robin"]["all"]
    assert out["trace"]["ideal_reuse"] > 0.5
    assert kv["engine_hit_rate"] >= rr["engine_hit_rate"]
    assert kv["engine_hit_rate"] > 0.3


def test_shard_count_grows_with_engines() -> None:
    # Per-engine rate fixed: more engines move more bytes through the shared tier.
    common = ["--model", "llama-3-8b", "--doc-tokens", "2048", "--docs", "50", "--rounds", "3", "--think-s", "5",
              "--pool-gib", "1", "--rate", "4", "--tier", "kvtier:16GiB", "--policy", "round-robin",
              "--step-fit", "0.01,0.00005,0.0002,0.000000001", "--load-scale", "10"]
    sized = [run("--engines", str(n), *common)["policies"]["round-robin"]["shared_tiers"]["kvtier"]
             for n in (1, 4, 12)]
    shards = [s["shards"] for s in sized]
    assert shards[0] < shards[1] < shards[2], shards
    assert sized[0]["read_gbps"] < sized[1]["read_gbps"] < sized[2]["read_gbps"]


def test_deterministic_with_a_seed() -> None:
    argv = ["--engines", "2", "--users", "24", "--pool-blocks", "500", "--tier", "kvtier:2GiB"]
    a, b = run(*argv, "--seed", "7"), run(*argv, "--seed", "7")
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    c = run(*argv, "--seed", "8")
    assert c["policies"]["kv-aware"]["all"] != a["policies"]["kv-aware"]["all"]


def test_pools_and_tiers_keep_their_bounds() -> None:
    from benchmarks.sim.simulate import TierSpec, simulate

    trace = make_trace(Workload(users=30, rounds=3, docs=5, doc_tokens=1024, question_tokens=32,
                                answer_tokens=16, think_s=5, rate=1.0))
    budget = 10 * 256 * 46080 + 123  # ten chunks and change: the rest must be evicted
    from benchmarks.sim.engine_sim import EngineConfig

    for policy in ("kv-aware", "prefix-hash", "round-robin"):
        res = simulate(trace, policy, 3, EngineConfig(pool_blocks=300), MEASURED.step,
                       [TierSpec("kvtier", budget, 1.0, shared=True)], 46080)
        assert res.blocks_held_at_end == 0
        assert len(res.lives) == len(trace)
        assert res.shared[0].bytes_used <= budget
        assert all(lv.first_token_s is not None and lv.first_token_s >= lv.req.arrival_s for lv in res.lives)


def test_block_pool_prefix_hits_and_eviction_order() -> None:
    pool = BlockPool(4)
    assert pool.acquire(["a", "b", "c"])
    pool.release(["a", "b", "c"])
    assert pool.hit_blocks(["a", "b", "c", "d"]) == 3
    assert pool.acquire(["x", "y"])  # one empty block, then the tail "c" is evicted: the head stays
    assert pool.hit_blocks(["a", "b", "c"]) == 2
    assert not pool.acquire(["p", "q", "r"])  # 2 held of 4: three new blocks do not fit
    pool.release(["x", "y"])
    assert pool.num_held == 0


def test_chunk_tier_budget_is_exact() -> None:
    t = ChunkTier("kvtier", 3 * 100 + 99, 100, 1.0, 0.0)
    for k in range(10):
        t.put(k)
    assert t.bytes_used == 300 and 9 in t and 6 not in t


def test_ideal_reuse_counts_shared_documents_and_history() -> None:
    trace = make_trace(Workload(users=2, rounds=2, docs=1, doc_tokens=256, question_tokens=16,
                                answer_tokens=16, think_s=1, rate=1.0))
    assert 0.5 < ideal_reuse(trace, 16) < 1.0


@pytest.mark.parametrize("argv, needle", [
    (["--tier", "kvtier:lots"], "bad size 'lots'"),
    (["--tier", "tape:1GiB"], "bad tier 'tape:1GiB'"),
    (["--tier", "kvtier:1GiB:fast"], "load speed 'fast' is not a number"),
    (["--model", "gpt-9"], "unknown model 'gpt-9'"),
    (["--engines", "0"], "--engines must be >= 1"),
    (["--step-fit", "1,2"], "bad --step-fit"),
])
def test_bad_input_is_one_clear_line(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert sim_scaling.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err


def test_cli_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dest = tmp_path / "out.json"
    assert sim_scaling.main([*SMALL, "--engines", "2", "--users", "8", "--pool-blocks", "400",
                             "--tier", "kvtier:1GiB", "--json", str(dest)]) == 0
    out = json.loads(dest.read_text())
    assert set(out["policies"]) == {"kv-aware", "prefix-hash", "round-robin"}
    assert "| kv-aware |" in capsys.readouterr().out
