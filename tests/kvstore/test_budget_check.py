"""A tier budget that cannot hold one chunk is an error naming the tier and suggesting units;
one that holds only a few chunks is a warning."""

from __future__ import annotations

import logging

import pytest

from kvstore.budget_check import FEW_CHUNKS, check_tier_budgets, encoded_chunk_bytes
from kvstore.store_config import TierSpec

CHUNK = 256 * 92160  # 256 tokens of the default model's float32 K/V (30 layers x 2 x 3 heads x 64 x 4 bytes)


def test_budget_smaller_than_one_chunk_is_an_error_suggesting_units() -> None:
    tiers = [TierSpec("cpu").validate(), TierSpec.from_url("cpu?budget=5")]
    with pytest.raises(ValueError) as info:
        check_tier_budgets(tiers, CHUNK, 4)
    msg = str(info.value)
    assert msg.startswith(f"tiers[1] cpu: budget=5 bytes is smaller than one chunk ({CHUNK} bytes with codec raw)")
    assert "did you mean 5GB or 5GiB?" in msg and "\n" not in msg
    with pytest.raises(ValueError, match=r"^tiers\[0\] disk:///x: budget=1048576 bytes"):
        check_tier_budgets([TierSpec.from_url("disk:///x?budget=1MiB")], CHUNK, 4)


def test_small_budget_is_a_warning_and_codecs_shrink_the_chunk(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvtier.kvstore")
    few = TierSpec.from_url(f"cpu?budget={3 * CHUNK}")
    assert check_tier_budgets([few, TierSpec.from_url("cpu?budget=4GiB")], CHUNK, 4) == [caplog.messages[0]]
    assert "holds only 3 chunk(s)" in caplog.messages[0]
    assert check_tier_budgets([TierSpec.from_url(f"cpu?budget={FEW_CHUNKS * CHUNK}")], CHUNK, 4) == []
    # an int4 tier stores a chunk in an eighth of its float32 bytes: a budget of CHUNK // 8 holds one
    assert encoded_chunk_bytes(CHUNK, 4, "int4") == CHUNK // 8
    check_tier_budgets([TierSpec.from_url(f"cpu?budget={CHUNK // 8}&codec=int4")], CHUNK, 4)
    assert check_tier_budgets([TierSpec.from_url("kvtier://h:1")], CHUNK, 4) == []  # budget lives on the server
