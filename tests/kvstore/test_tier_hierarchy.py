"""Tiers as a hierarchy (`fill=demote`): a tier below a cpu tier gets only what the cpu tier
evicts, decoded and whole, instead of every chunk stored; a hit there is promoted and, evicted
again, not written twice; write-through stays the default; a demote tier that nothing can fill
is refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvstore.backends.disk import DiskBackend
from kvstore.backends.memory import CPUBackend
from kvstore.storage_manager import StorageManager
from kvstore.store_config import KVStoreConfig, TierSpec


def _kv(seed: int) -> torch.Tensor:
    return torch.randn(2, 2, 4, 2, 8, generator=torch.Generator().manual_seed(seed))


NBYTES = _kv(0).nbytes


def _manager(tmp_path: Path, fill: str, codec: str = "raw") -> StorageManager:
    cpu = CPUBackend(byte_budget=2 * NBYTES if codec == "raw" else None, codec=codec)
    return StorageManager([cpu, DiskBackend(tmp_path / "disk")], names=["cpu", "disk"], fills=["write", fill])


@pytest.mark.parametrize("fill", ["write", "demote"])
def test_the_tier_below_gets_every_chunk_or_only_the_evicted_ones(tmp_path: Path, fill: str) -> None:
    with _manager(tmp_path, fill) as sm:
        sm.batched_put([(f"k{i}", _kv(i)) for i in range(3)])  # the cpu tier holds 2: k0 is evicted
        assert sm.flush(10)
        disk = sm.tiers[1]
        assert disk.batched_contains(["k0", "k1", "k2"]) == ([True] * 3 if fill == "write" else [True, False, False])
        assert sm.stats()["disk"].bytes_stored == (3 if fill == "write" else 1) * NBYTES
        assert [t for _, t in sm.fetch(["k0", "k1", "k2"])] == [1, 0, 0]  # every chunk still found
        assert torch.equal(sm.fetch(["k0"])[0][0], _kv(0))


def test_a_promoted_chunk_evicted_again_is_not_written_twice(tmp_path: Path) -> None:
    with _manager(tmp_path, "demote") as sm:
        sm.batched_put([(f"k{i}", _kv(i)) for i in range(3)])
        assert sm.flush(10)
        (kv, tier), = sm.fetch(["k0"])
        assert tier == 1
        sm.promote([("k0", kv, tier)])  # k0 back in cpu: k1 is evicted, demoted
        assert sm.flush(10)
        assert sm.tiers[0].batched_contains(["k0", "k1", "k2"]) == [True, False, True]
        assert sm.tiers[1].batched_contains(["k0", "k1", "k2"]) == [True, True, False]
        sm.batched_put([("k3", _kv(3)), ("k4", _kv(4))])  # evicts k2 and k0; k0 is on disk already
        assert sm.flush(10)
        assert sm.stats()["disk"].bytes_stored == 3 * NBYTES  # k0, k1, k2: each written once
        for i in range(5):
            assert torch.equal(sm.fetch([f"k{i}"])[0][0], _kv(i))


def test_an_encoded_cpu_tier_demotes_decoded_chunks(tmp_path: Path) -> None:
    with StorageManager([CPUBackend(byte_budget=3000, codec="lz4"), DiskBackend(tmp_path / "disk")],
                        names=["cpu", "disk"], fills=["write", "demote"]) as sm:
        sm.batched_put([(f"k{i}", _kv(i)) for i in range(4)])
        assert sm.flush(10)
        keys = ["k0", "k1", "k2", "k3"]
        on_disk = [k for k, h in zip(keys, sm.tiers[1].batched_contains(keys)) if h]
        assert on_disk, "the lz4 tier of 3000 bytes cannot hold four chunks"
        for key in on_disk:
            assert torch.equal(sm.tiers[1].batched_get([key])[0], _kv(int(key[1:])))


def test_deleted_chunks_are_not_demoted(tmp_path: Path) -> None:
    with _manager(tmp_path, "demote") as sm:
        sm.batched_put([("k0", _kv(0))])
        sm.delete("k0")
        sm.operations.set_budget("cpu", byte_budget=0)  # evicts nothing: nothing is left
        assert sm.flush(10)
        assert sm.tiers[1].batched_contains(["k0"]) == [False]


def test_a_budget_cut_demotes_what_it_evicts(tmp_path: Path) -> None:
    with _manager(tmp_path, "demote") as sm:
        sm.batched_put([("k0", _kv(0)), ("k1", _kv(1))])
        sm.operations.set_budget("cpu", byte_budget=NBYTES)
        assert sm.flush(10)
        assert sm.tiers[1].batched_contains(["k0", "k1"]) == [True, False]


def test_fill_is_a_tier_setting_checked_by_name(tmp_path: Path) -> None:
    config = KVStoreConfig.from_dict({"tiers": ["cpu?budget=1MiB", f"disk://{tmp_path}/d?fill=demote"]})
    assert [t.fill for t in config.tiers] == ["write", "demote"]
    with StorageManager.from_config(config) as sm:
        assert sm.fills == ["write", "demote"]
    with pytest.raises(ValueError, match=r"0:cpu: fill=demote takes the chunks the tier above evicts, and no tier "
                                         r"is above it"):
        StorageManager.from_config(KVStoreConfig.from_dict({"tiers": ["cpu?fill=demote"]}))
    with pytest.raises(ValueError, match=r"fill: unknown fill 'lazy'; choose one of \['write', 'demote'\]"):
        TierSpec.from_url("cpu?fill=lazy")
    below_disk = KVStoreConfig.from_dict({"tiers": ["cpu", f"disk://{tmp_path}/d", f"disk://{tmp_path}/e?fill=demote"]})
    with pytest.raises(ValueError, match=r"2:disk://.*/e: fill=demote takes the chunks the tier above evicts, "
                                         r"and the tier above, 1:disk://.*/d, cannot \(a cpu or device tier can\)"):
        StorageManager.from_config(below_disk)
