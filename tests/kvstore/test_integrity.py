"""K/V integrity against forgery: with a shared secret, values carry a keyed MAC and a value
that was re-encoded with a valid checksum but without the key is a miss, on real tiers."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import xxhash

from kvstore import serde
from kvstore.storage_manager import StorageManager
from kvstore.store_config import KVStoreConfig
from tests.fixtures.tiers import chunk, ckey

SECRET = "a shared secret of 32 characters"


@pytest.fixture(autouse=True)
def no_key_after() -> Iterator[None]:
    """The integrity key is per process: every test here leaves none behind."""
    yield
    serde.set_integrity_key(None)


def _forged(key: str, kv: torch.Tensor) -> memoryview:
    """A writer without the secret re-encodes other K/V: a valid checksum and key tag, no MAC."""
    saved = serde._mac_key
    serde.set_integrity_key(None)
    try:
        return serde.encode(key, kv)
    finally:
        serde._mac_key = saved


def test_serde_refuses_values_without_a_valid_mac() -> None:
    serde.set_integrity_key(SECRET)
    kv = chunk(1)
    good = serde.encode(ckey(1), kv)
    assert torch.equal(serde.decode(ckey(1), good), kv)
    forged = _forged(ckey(1), torch.zeros_like(kv))
    with pytest.raises(serde.SerdeError, match="no MAC"):
        serde.decode(ckey(1), forged)
    serde.set_integrity_key("another secret, also long enough")
    with pytest.raises(serde.SerdeError, match="MAC mismatch"):
        serde.decode(ckey(1), good)
    serde.set_integrity_key(None)  # a reader without the secret still reads (checksum only)
    assert torch.equal(serde.decode(ckey(1), good), kv)
    with pytest.raises(ValueError, match="16 bytes"):
        serde.set_integrity_key("short")


def test_a_forged_header_flag_cannot_skip_the_mac() -> None:
    serde.set_integrity_key(SECRET)
    good = bytearray(serde.encode(ckey(2), chunk(2)))
    # flip a payload byte and patch the checksum: corruption caught by the checksum is not the point
    good[-1] ^= 0xFF
    h = xxhash.xxh3_64()
    h.update(bytes(good[: serde._CHECKSUM_OFFSET]) + bytes(8) + bytes(good[serde._CHECKSUM_OFFSET + 8 :]))
    struct.pack_into("<Q", good, serde._CHECKSUM_OFFSET, h.intdigest())
    with pytest.raises(serde.SerdeError, match="MAC mismatch"):
        serde.decode(ckey(2), good)


@pytest.mark.parametrize("kind", ["redis", "disk", "cache_server"])
def test_forged_values_in_a_shared_tier_are_misses(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    url = f"disk://{tmp_path}/d" if kind == "disk" else request.getfixturevalue(
        "redis_server" if kind == "redis" else "cache_server").url
    cfg = KVStoreConfig.load(env={"KVTIER_TIERS": url, "KVTIER_KV_KEY": SECRET})
    assert cfg.integrity_key == SECRET and SECRET not in repr(cfg)
    mgr = StorageManager.from_config(cfg)
    keys = [ckey(i) for i in range(4)]
    mgr.batched_put([(k, chunk(i)) for i, k in enumerate(keys)])
    tier = mgr.tiers[0]
    tier._batched_put_bytes([(keys[1], _forged(keys[1], torch.zeros_like(chunk(1))))])  # the forger's write
    got = [kv for kv, _ in mgr.fetch(keys)]
    assert got[1] is None  # a miss (recompute), never the forged zeros
    assert all(torch.equal(got[i], chunk(i)) for i in (0, 2, 3))
    assert tier.stats().corrupt == 1
    mgr.close()
    # without the key configured, the same deployment trusts checksums only (no MAC checked)
    StorageManager.from_config(KVStoreConfig.load(env={"KVTIER_TIERS": url})).close()
    assert not serde.integrity_enabled()


def test_integrity_key_is_checked() -> None:
    with pytest.raises(ValueError, match="integrity_key: a shared secret needs at least 16 bytes"):
        KVStoreConfig.from_dict({"integrity_key": "hunter2"})
    with pytest.raises(ValueError, match="integrity_key: expected str"):
        KVStoreConfig.from_dict({"integrity_key": 12345678901234567890})


@pytest.mark.parametrize("secret", [None, SECRET])
def test_a_value_checked_piece_by_piece_decodes_as_a_whole_one(secret: str | None) -> None:
    """The disk tier checks a value as it reads it (serde.ValueCheck): any split into pieces
    accepts what `decode` accepts and refuses a flipped byte wherever it lands."""
    serde.set_integrity_key(secret)
    kv = chunk(3)
    value = bytes(serde.encode(ckey(3), kv))

    def checked(data: bytes, first: int, step: int, key: str = ckey(3)) -> serde.CheckedValue:
        check = serde.ValueCheck(key)
        check.feed(data[:first])
        for i in range(first, len(data), step):
            check.feed(data[i : i + step])
        return serde.CheckedValue(data, check)

    header_len = serde.read_header(value).header_len
    for first, step in [(serde.MAX_HEADER_LEN, 1000), (header_len, 7), (len(value), 1)]:
        assert torch.equal(serde.decode(ckey(3), checked(value, first, step)), kv)
    for at in (5, serde._CHECKSUM_OFFSET + 2, header_len + 3, len(value) - 1):
        bad = bytearray(value)
        bad[at] ^= 0x01
        with pytest.raises(serde.SerdeError):
            serde.decode(ckey(3), checked(bytes(bad), serde.MAX_HEADER_LEN, 4096))
    with pytest.raises(serde.SerdeError, match="checked 200 bytes"):  # a piece went missing
        serde.decode(ckey(3), serde.CheckedValue(value, checked(value[:200], 200, 1).check))
    with pytest.raises(serde.SerdeError, match="different key"):
        serde.decode(ckey(4), checked(value, serde.MAX_HEADER_LEN, 4096))
    with pytest.raises(serde.SerdeError, match="different key"):
        serde.decode(ckey(4), checked(value, serde.MAX_HEADER_LEN, 4096, key=ckey(4)))
