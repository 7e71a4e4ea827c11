"""benchmarks/bench_demotion.py's model of a cpu tier over a disk tier gives `kvtier cache plan`'s
figures (kvstore/trace_replay.py) on a real trace, under write-through and demotion; its filters
decide what the disk is written, and the table marks the cells that meet the target."""

from __future__ import annotations

from benchmarks.bench_demotion import Context, meets, oracle, render, replay, run, used_in_cpu
from benchmarks.bench_trace import load_trace
from kvstore.store_config import TierSpec
from kvstore.trace_replay import plan


def test_the_model_gives_the_plans_figures_under_both_fills() -> None:
    trace = load_trace("conversation")[:1000]
    distinct = len({b for r in trace for b in r.blocks})
    cpu, disk = (distinct // 50) * 512, (distinct // 10) * 512
    for fill in ("write", "demote"):
        model = replay(trace, cpu, disk, fill)
        seen = plan(trace, [TierSpec(url="cpu", budget=cpu), TierSpec(url="disk:///t", budget=disk, fill=fill)], 1)
        assert (model.hit_tokens, model.disk_tokens) == (seen.hit_tokens, seen.tiers[1].bytes_written)
        assert model.prompt_tokens == seen.prompt_tokens and model.hit_tokens > 0


def test_filters_decide_what_the_disk_is_written() -> None:
    trace = load_trace("conversation")[:1000]
    distinct = len({b for r in trace for b in r.blocks})
    cpu, disk = (distinct // 20) * 512, (distinct // 5) * 512
    plain = replay(trace, cpu, disk, "demote")
    told = replay(trace, cpu, disk, "demote", oracle(Context.of(trace)))
    used = replay(trace, cpu, disk, "demote", used_in_cpu)
    nothing = replay(trace, cpu, disk, "demote", lambda jobs, tiers: [False] * len(jobs))
    assert nothing.disk_tokens == 0 < used.disk_tokens < told.disk_tokens < plain.disk_tokens
    assert told.hit_tokens >= plain.hit_tokens > nothing.hit_tokens  # dropping only what never returns loses nothing


def test_the_table_marks_what_meets_the_target() -> None:
    pair = (0.02, 0.10)
    rows = run(load_trace("conversation")[:2000], [pair], [pair], [0.5])  # the learned filter fitted too
    assert set(rows[0]) >= {"none", "oracle", "used in cpu", "write hit rate", "learned top 50%"}
    assert 0 < rows[0]["learned read back"] < 1 and rows[0]["learned top 50%"]["fewer"] > 1
    md = render({"trace": "conversation", "requests": 2000, "date": "today", "rows": rows})
    assert "| 2% + 10% |" in md and md.count("learned top 50%") == 1
    assert meets({"hit": 0.98, "fewer": 2.0}) and not meets({"hit": 0.979, "fewer": 3.0})
    assert not meets({"hit": 1.2, "fewer": 1.99})
