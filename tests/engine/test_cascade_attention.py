"""Cascade attention (engine/cascade_attention.py): decode rows that share their first blocks
attend them once, as a group, through the prefill kernel's tiles, and their own keys through
the decode kernel, which merges the two; against the gather + SDPA path of the same step."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams, cascade_attention
from engine import paged_attention as paged_attention_module
from engine.attention_metadata import AttentionMetadata
from engine.cascade_attention import MIN_PREFIX, MIN_ROWS, find_shared_prefixes
from engine.kv_cache import slot_mapping
from engine.paged_attention import build_plan, paged_attention

CPU = torch.device("cpu")
BS = 16


def _shared_case(groups: list[tuple[int, list[int]]], seed: int, hq: int = 9, hkv: int = 3,
                 d: int = 64) -> tuple[torch.Tensor, ...]:
    """A decode step over a random cache: per group (prefix length, each row's own keys after
    it), rows whose tables begin with the prefix's whole blocks (shared, as the prefix cache
    shares them), then blocks of their own."""
    g = torch.Generator().manual_seed(seed)
    tables_rows, lens = [], []
    next_block = 0
    for prefix, owns in groups:
        shared = list(range(next_block, next_block + prefix // BS))
        next_block += len(shared)
        for own in owns:
            n = prefix + own
            mine = list(range(next_block, next_block + -(-n // BS) - len(shared)))
            next_block += len(mine)
            tables_rows.append(shared + mine)
            lens.append(n)
    num_blocks = next_block + 3
    perm = torch.randperm(num_blocks, generator=g)  # blocks scattered over the cache
    width = max(len(r) for r in tables_rows) + 2
    tables = torch.zeros(len(lens), width, dtype=torch.long)
    for i, r in enumerate(tables_rows):
        tables[i, :len(r)] = perm[torch.tensor(r)]
    kv = torch.randn(2, num_blocks, BS, hkv, d, generator=g)
    rows = torch.arange(len(lens))
    slots = slot_mapping(tables, rows, torch.tensor(lens) - 1, BS)
    meta = AttentionMetadata(slot_mapping=slots, block_tables=tables, query_start_loc=list(range(len(lens) + 1)),
                             seq_lens=lens, block_size=BS)
    q = torch.randn(len(lens), hq, d, generator=g)
    k, v = kv.flatten(1, 2)[:, slots]
    return q, k, v, kv, meta  # type: ignore[return-value]


# Two groups that take the cascade (own keys up to past the decode kernel's 512-key partition;
# a prefix not a whole number of blocks), a pair too small to, and a lone row; then one group
# over a prefix long enough to be attended in several key ranges.
CASES = [
    [(1100, [1, 17, 300, 600, 2, 9, 40, 3]), (1030, [5, 1, 40, 9, 7, 2, 300, 11, 4]), (1400, [3, 8]), (50, [900])],
    [(2048, [700, 1200, 1, 513, 3, 9, 60, 100])],
]


@pytest.fixture(params=[1, 4], ids=["1-thread", "4-threads"])
def threads(request: pytest.FixtureRequest):
    """Torch threads for the kernels: with 4, 8 rows are few enough for the decode kernel to
    split them into key partitions, and the prefix is merged as one more."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("groups", CASES)
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (8, 1, 128), (6, 3, 24)])
@pytest.mark.parametrize("softcap", [None, 1.5])
def test_cascade_equals_the_gather_path(ops, threads: int, groups: list, hq: int, hkv: int, d: int,
                                        softcap: float | None) -> None:
    q, k, v, kv, meta = _shared_case(groups, seed=3, hq=hq, hkv=hkv, d=d)
    ref = paged_attention(q, k, v, kv, build_plan(meta, CPU), 0.2, softcap)
    plan = build_plan(meta, CPU, cpu_ops=ops)
    shared = plan.decode_shared
    assert shared is not None  # the path under test
    expected = [(sum(len(o) for _, o in groups[:i]), len(owns), p // BS * BS) for i, (p, owns) in enumerate(groups)
                if len(owns) >= MIN_ROWS]
    assert list(zip(shared.first_rows.tolist(), shared.num_rows.tolist(), shared.prefix_lens.tolist())) == expected
    got = paged_attention(q, k, v, kv, plan, 0.2, softcap)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_shared_prefixes_are_whole_blocks_that_leave_every_row_a_key() -> None:
    prefix = MIN_PREFIX + 2 * BS  # blocks 0..n-1 shared by every row
    n = prefix // BS
    tables = torch.zeros(MIN_ROWS + 2, n + 4, dtype=torch.long)
    tables[:, :n] = torch.arange(n)
    tables[:, n:] = torch.arange(MIN_ROWS + 2).unsqueeze(1) * 10 + 1000 + torch.arange(4)  # own blocks
    lens = [prefix + 5] * (MIN_ROWS + 2)
    shared, starts = find_shared_prefixes(tables, lens, BS)
    assert shared is not None and shared.prefix_lens.tolist() == [prefix] and starts == [prefix] * len(lens)
    lens[2] = prefix  # a row whose keys are all shared: the prefix stops a block earlier
    shared, starts = find_shared_prefixes(tables, lens, BS)
    assert shared is not None and shared.prefix_lens.tolist() == [prefix - BS] and starts[2] == prefix - BS
    tables[3, 0] = 999  # row 3 shares nothing: the rows before it and after it are too few to pay
    shared, starts = find_shared_prefixes(tables, lens, BS)
    assert shared is None and starts == [0] * len(lens)
    short = tables.clone()
    short[:, MIN_PREFIX // BS - 1:] = torch.arange(len(lens)).unsqueeze(1) + 2000  # shared < MIN_PREFIX
    assert find_shared_prefixes(short, lens, BS) == (None, [0] * len(lens))


def test_prefix_kernel_refuses_bad_inputs(ops) -> None:
    q, _, _, kv, meta = _shared_case([(300, [1, 2, 3, 4])], seed=5)
    out, lse = torch.empty_like(q), torch.empty(q.shape[:2])
    one, four = torch.tensor([0]), torch.tensor([4])
    table = meta.block_tables[:1]
    with pytest.raises(RuntimeError, match="no keys"):
        ops.paged_prefix_attention(q, kv, table, one, four, one * 0, 0.1, 0.0, out, lse)
    with pytest.raises(RuntimeError, match="more keys than its block table"):
        ops.paged_prefix_attention(q, kv, table[:, :2], one, four, torch.tensor([300]), 0.1, 0.0, out, lse)
    with pytest.raises(RuntimeError, match="lse must be"):
        ops.paged_prefix_attention(q, kv, table, one, four, torch.tensor([300]), 0.1, 0.0, out, lse[:2])
    with pytest.raises(RuntimeError, match="go together"):
        ops.paged_decode_attention(q, kv, meta.block_tables, one.repeat(4), torch.tensor(meta.seq_lens), 0.1, 512,
                                   0.0, out, None)


def test_generations_identical_with_and_without_the_cascade(ops, monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy tokens of requests over one shared document, as the engine batches them, are the
    same with the cascade and with every row attending its whole context (the thresholds,
    which only weigh speed, lowered to this short document)."""
    monkeypatch.setattr(cascade_attention, "MIN_ROWS", 4)
    monkeypatch.setattr(cascade_attention, "MIN_PREFIX", 256)
    doc = "Blocks of the paged KV cache hold keys and values of sixteen tokens each. " * 20
    prompts = [doc + q for q in ("Summarise it.", "What is a block?", "Count the tokens.", "Why pages?")]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    used = []

    def spy(tables: torch.Tensor, lens: list[int], block_size: int):
        found = find_shared_prefixes(tables, lens, block_size)
        used.append(found[0] is not None)
        return found

    warm = SamplingParams(max_tokens=1)  # the document first: the prompts then share its cached blocks
    outs = {}
    with LLM(kv_cache_memory_bytes=256 << 20) as llm:
        llm.generate([doc], warm)
        monkeypatch.setattr(paged_attention_module, "find_shared_prefixes", spy)
        outs["cascade"] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert any(used), "no step took the cascade"
        monkeypatch.setattr(paged_attention_module, "find_shared_prefixes",
                            lambda tables, lens, block_size: (None, [0] * len(lens)))
        llm.reset_prefix_cache()
        llm.generate([doc], warm)
        outs["whole"] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert outs["cascade"] == outs["whole"]
