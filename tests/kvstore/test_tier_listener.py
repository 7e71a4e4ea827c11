"""A storage manager's listener hears what each tier stored (after the write, only what it
accepted), evicted to make room, and lost to `delete`, on every kind of tier (real Redis)."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.redis import RedisServer
from kvstore.registry import create_backend
from kvstore.storage_manager import StorageManager
from kvstore.store_config import TierSpec
from tests.fixtures.tiers import TIER_KINDS, chunk, ckey, tier_spec


class Heard:
    def __init__(self) -> None:
        self.stored: list[tuple[str, str]] = []
        self.removed: list[tuple[str, str]] = []

    def stored_(self, tier: str, keys: list[str]) -> None:
        self.stored += [(tier, k) for k in keys]

    def removed_(self, tier: str, keys: list[str]) -> None:
        self.removed += [(tier, k) for k in keys]


class Listener:
    def __init__(self, heard: Heard) -> None:
        self.stored, self.removed = heard.stored_, heard.removed_


def _nbytes(i: int) -> int:
    kv = chunk(i)
    return kv.numel() * kv.element_size()


@pytest.mark.parametrize("kind", TIER_KINDS)
def test_stores_evictions_and_deletes_are_heard(kind: str, tmp_path: Path, redis_server: RedisServer) -> None:
    # room for two chunks (and the byte tiers' framing), not three
    spec = tier_spec(kind, tmp_path, redis_server.url, budget=2 * _nbytes(0) + 2048)
    tier = create_backend(spec)
    heard = Heard()
    with StorageManager([tier], names=[spec.url]) as sm:
        sm.set_listener(Listener(heard))
        sm.batched_put([(ckey(0), chunk(0))])
        sm.batched_put([(ckey(1), chunk(1))])
        assert heard.stored == [(tier.name, ckey(0)), (tier.name, ckey(1))] and heard.removed == []
        sm.batched_put([(ckey(2), chunk(2))])  # evicts the least recently used: chunk 0
        assert heard.stored[-1] == (tier.name, ckey(2))
        assert heard.removed == [(tier.name, ckey(0))]
        assert sm.batched_contains([ckey(0), ckey(1), ckey(2)]) == [False, True, True]
        sm.delete(ckey(1))
        assert heard.removed == [(tier.name, ckey(0)), (tier.name, ckey(1))]
        sm.delete(ckey(1))  # already gone: nothing more to hear
        assert len(heard.removed) == 2


def test_a_refused_chunk_is_not_heard_as_stored(tmp_path: Path) -> None:
    tier = create_backend(TierSpec("cpu", budget=_nbytes(0) // 2))
    heard = Heard()
    with StorageManager([tier]) as sm:
        sm.set_listener(Listener(heard))
        sm.batched_put([(ckey(0), chunk(0))])
        assert heard.stored == [] and heard.removed == []


def test_a_slow_tier_is_heard_after_its_background_write(tmp_path: Path) -> None:
    tiers = [create_backend(TierSpec("cpu")), create_backend(TierSpec(f"disk://{tmp_path}/d"))]
    heard = Heard()
    with StorageManager(tiers) as sm:
        sm.set_listener(Listener(heard))
        sm.batched_put([(ckey(0), chunk(0))])
        assert sm.flush(30)
        assert sorted(heard.stored) == [("cpu", ckey(0)), ("disk", ckey(0))]
