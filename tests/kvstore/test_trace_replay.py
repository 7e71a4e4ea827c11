"""kvstore/trace_replay.py: traces in Mooncake's format read as they are, malformed lines named;
a two-tier replay through the storage manager writes the slower tier only with what the cpu
tier evicts under demotion and finds every block either way; a plan's figures add up and follow
the budgets it is given, a prompt's short last block taking its own tokens' bytes."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from kvstore.backends.disk import DiskBackend
from kvstore.backends.memory import CPUBackend
from kvstore.storage_manager import StorageManager
from kvstore.store_config import TierSpec
from kvstore.trace_replay import TOKEN_BYTES, plan, replay_manager
from kvstore.traces import Request, read_trace

TRACES = Path(__file__).resolve().parents[2] / "benchmarks" / "traces" / "mooncake"


def _write(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_trace_is_read_in_arrival_order_with_its_blocks(tmp_path: Path) -> None:
    rows = [{"timestamp": 5, "input_length": 1000, "output_length": 9, "hash_ids": [1, 2]},
            {"timestamp": 1, "input_length": 512, "hash_ids": [1]}]
    plain = read_trace(_write(tmp_path / "t.jsonl", rows))
    gz = tmp_path / "t.jsonl.gz"
    with gzip.open(gz, "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    assert plain == read_trace(gz) == [Request(512, (1,)), Request(1000, (1, 2))]
    assert plain[1].block_tokens(1) == 488
    conversation = read_trace(TRACES / "conversation_trace.jsonl.gz")
    assert len(conversation) == 12031 and conversation[0].blocks[0] == 0


@pytest.mark.parametrize(("row", "message"), [
    ("{not json", r"t.jsonl:2: not JSON"),
    ({"input_length": "7", "hash_ids": [1]}, r"t.jsonl:2: input_length must be a token count"),
    ({"input_length": 7, "hash_ids": "1"}, r"t.jsonl:2: hash_ids must be a list of ints"),
    ({"input_length": 7, "hash_ids": [1], "timestamp": "noon"}, r"t.jsonl:2: timestamp must be a number"),
    ({"input_length": 2000, "hash_ids": [1]}, r"t.jsonl:2: 1 hash_ids do not cover input_length 2000 in blocks "
                                               r"of 512 tokens \(--block-tokens\)"),
])
def test_a_malformed_request_is_named_by_line_and_field(tmp_path: Path, row: object, message: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"input_length": 3, "hash_ids": [0]}) + "\n"
                    + (row if isinstance(row, str) else json.dumps(row)) + "\n")
    with pytest.raises(ValueError, match=message):
        read_trace(path)


def test_a_two_tier_replay_demotes_instead_of_writing_through(tmp_path: Path) -> None:
    trace = read_trace(TRACES / "synthetic_trace.jsonl.gz")[:150]
    blocks = len({b for r in trace for b in r.blocks})
    first: dict[int, int] = {}  # each block's tokens where it first appears (and is stored)
    for r in trace:
        for i, b in enumerate(r.blocks):
            first.setdefault(b, r.block_tokens(i))
    seen = {}
    for fill in ("write", "demote"):
        cpu = CPUBackend(byte_budget=(blocks // 20) * 512 * TOKEN_BYTES)
        disk = DiskBackend(tmp_path / fill)  # unbounded: every block stays findable
        with StorageManager([cpu, disk], names=["cpu", "disk"], fills=["write", fill], queue_size=4096) as sm:
            seen[fill] = replay_manager(trace, sm)
    write, demote = seen["write"], seen["demote"]
    assert write.tally.hit_tokens == demote.tally.hit_tokens > 0
    assert write.hit_tokens == demote.hit_tokens  # the same tokens served by each tier
    assert sum(write.hit_tokens.values()) == write.tally.hit_tokens
    assert write.tokens_stored["cpu"] == demote.tokens_stored["cpu"]  # the same chunks stored and promoted
    assert write.tokens_stored["disk"] == sum(first.values())  # every block, once, at its tokens
    assert 0 < demote.tokens_stored["disk"] < sum(first.values())  # what the cpu tier evicted, once each


def test_a_plan_follows_its_budgets_and_adds_up() -> None:
    trace = read_trace(TRACES / "conversation_trace.jsonl.gz")[:1500]
    block = 512 * 1000  # 1000 bytes of K/V per token
    small = plan(trace, [TierSpec.from_url(f"cpu?budget={200 * block}")], 1000)
    big = plan(trace, [TierSpec.from_url(f"cpu?budget={200 * block}"),
                       TierSpec.from_url(f"disk:///unused?budget={2000 * block}&fill=demote")], 1000)
    assert small.prompt_tokens == big.prompt_tokens == sum(r.input_length for r in trace)
    assert 0 < small.hit_rate < big.hit_rate < 1
    assert small.tiers[0].capacity_blocks == 200 and big.tiers[1].capacity_blocks == 2000
    assert big.hit_tokens == sum(t.hit_tokens for t in big.tiers)
    assert big.tiers[1].bytes_written > 0
    unbounded = plan(trace, [TierSpec.from_url("cpu")], 1000)  # stores each block once, where it first appears
    first: dict[int, int] = {}
    for r in trace:
        for i, b in enumerate(r.blocks):
            first.setdefault(b, r.block_tokens(i))
    assert unbounded.tiers[0].bytes_written == sum(first.values()) * 1000 < len(first) * block
    with pytest.raises(ValueError, match=r"tier disk:///b: fill=demote takes what a cpu or device tier above it "
                                         r"evicts; the tier above is disk"):
        plan(trace, [TierSpec.from_url("cpu"), TierSpec.from_url("disk:///a"),
                     TierSpec.from_url("disk:///b?fill=demote")], 1000)


def test_a_short_last_block_takes_its_own_tokens_of_a_budget() -> None:
    # Two prompts of 1.5 blocks each, then the first again: a budget of 3 full blocks holds all
    # four blocks (two full, two of 256 tokens), as a tier holds a short last chunk's bytes.
    trace = [Request(768, (1, 2)), Request(768, (3, 4)), Request(768, (1, 2))]
    seen = plan(trace, [TierSpec.from_url(f"cpu?budget={3 * 512 * 1000}")], 1000)
    assert seen.tiers[0].capacity_blocks == 3
    assert seen.hit_tokens == 768 and seen.tiers[0].bytes_written == 2 * 768 * 1000
    tight = plan(trace, [TierSpec.from_url(f"cpu?budget={3 * 512 * 1000 - 1000}")], 1000)
    assert tight.hit_tokens == 0  # one token short: the first prompt's blocks were evicted
