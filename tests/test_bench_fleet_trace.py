"""benchmarks/bench_fleet_trace.py's scaling of a trace: two prompts share exactly the token ids
of the blocks they share in the trace, each block scaled to the given tokens, the last one to
its share."""

from __future__ import annotations

from benchmarks.bench_fleet_trace import hit_tokens, prompt_ids, scaled
from kvstore.traces import Request


def test_prompts_share_exactly_the_blocks_the_trace_says_they_share() -> None:
    a, b = scaled([Request(1300, (7, 8, 9)), Request(1024, (7, 8))], 16)
    assert (a.input_length, b.input_length) == (41, 32)  # 1300 / 512 blocks of 16 tokens
    ids_a, ids_b = prompt_ids(a), prompt_ids(b)
    assert len(ids_a) == 41 and len(ids_b) == 32
    assert ids_a[:32] == ids_b  # blocks 7 and 8
    c = prompt_ids(scaled([Request(1024, (7, 5))], 16)[0])
    assert c[:16] == ids_a[:16] and c[16:] != ids_a[16:32]  # block 7 shared, then another block


def test_a_hit_that_reached_the_last_prompt_token_counts_the_whole_prompt() -> None:
    assert hit_tokens(100, 99) == 100  # the engine computed the last token; the replay counts the block
    assert hit_tokens(100, 64) == 64
    assert hit_tokens(1, 0) == 0
