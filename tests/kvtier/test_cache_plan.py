"""`kvtier cache plan`: a request trace replayed offline through the tiers given prints the
hit rate, prefill saved and bytes written per tier (the figures of kvstore/trace_replay.py's
`plan`), as text or JSON; a bad trace, tier or size is a one-line error naming it (exit 2)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from kvstore.store_config import TierSpec
from kvstore.trace_replay import plan
from kvstore.traces import read_trace
from kvtier.cli import main as cli_main

TRACE = Path(__file__).resolve().parents[2] / "benchmarks" / "traces" / "mooncake" / "conversation_trace.jsonl.gz"
PER_TOKEN = 1000
BLOCK = 512 * PER_TOKEN


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The first 800 requests of Mooncake's conversation trace, as a user's own file."""
    path = tmp_path_factory.mktemp("trace") / "slice.jsonl"
    with gzip.open(TRACE, "rt") as f:
        path.write_text("".join(line for _, line in zip(range(800), f)))
    return path


def test_plan_prints_the_replays_figures(trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tiers = [f"cpu?budget={100 * BLOCK}", f"disk:///var/kv?budget={1000 * BLOCK}&fill=demote"]
    argv = ["cache", "plan", "--trace", str(trace), "--kv-bytes-per-token", str(PER_TOKEN)]
    for url in tiers:
        argv += ["--tier", url]
    assert cli_main(argv + ["--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    expected = plan(read_trace(trace), [TierSpec.from_url(u) for u in tiers], PER_TOKEN)
    assert shown["requests"] == 800 and shown["hit_tokens"] == expected.hit_tokens > 0
    assert [t["bytes_written"] for t in shown["tiers"]] == [t.bytes_written for t in expected.tiers]
    assert [t["capacity_blocks"] for t in shown["tiers"]] == [100, 1000]
    assert cli_main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"800 requests, {expected.prompt_tokens:,} prompt tokens; hit rate "
                               f"{expected.hit_rate:.3f}: {expected.hit_tokens:,} prompt tokens not computed again")
    assert lines[1].startswith(f"cpu: 100 blocks; served {expected.tiers[0].hit_tokens:,} tokens")
    assert lines[2].startswith(f"disk:///var/kv: 1,000 blocks; served {expected.tiers[1].hit_tokens:,} tokens")


@pytest.mark.parametrize(("extra", "message"), [
    (["--trace", "/nonexistent/t.jsonl", "--tier", "cpu"], "--trace: cannot read /nonexistent/t.jsonl"),
    (["--tier", "cpu?budget=lots"], "--tier[0].budget: invalid size 'lots'"),
    (["--tier", "cpu?fill=demote"], "tier cpu: fill=demote takes what a cpu or device tier above it evicts; no tier"),
    (["--tier", "cpu", "--kv-bytes-per-token", "0"], "--kv-bytes-per-token: must be a positive size"),
    (["--tier", "cpu?eviction=mru"], "unknown policy 'mru'"),
])
def test_a_bad_plan_is_a_one_line_error(trace: Path, capsys: pytest.CaptureFixture[str], extra: list[str],
                                        message: str) -> None:
    argv = ["cache", "plan", *(["--trace", str(trace)] if "--trace" not in extra else []), *extra]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtier cache: error: ") and message in err and len(err.strip().splitlines()) == 1
