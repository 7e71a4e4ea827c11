"""Config: YAML and KVTIER_* env loading, sizes, and errors that name the offending key."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.config import KVStoreConfig, TierSpec, parse_size
from kvstore.registry import backend_class, create_backend


def test_parse_size() -> None:
    assert parse_size("4GiB") == 4 * 2**30
    assert parse_size("512MB") == 512 * 10**6
    assert parse_size("1.5G") == int(1.5 * 2**30)
    assert parse_size(1024) == 1024 and parse_size(None) is None
    for bad in ("4 parsecs", "-1GiB", "", True, 2.5):
        with pytest.raises(ValueError, match="budget"):
            parse_size(bad, "budget")  # type: ignore[arg-type]


def test_yaml_then_env_overrides(tmp_path: Path) -> None:
    path = tmp_path / "kv.yaml"
    path.write_text(f"""
chunk_size: 128
queue_size: 16
tiers:
  - {{url: cpu, budget: 2GiB}}
  - {{url: "disk://{tmp_path}/d", budget: 10GB, codec: lz4, eviction: fifo, options: {{fsync: true}}}}
  - "redis://127.0.0.1:6379/2?codec=int8&ttl_s=60"
""")
    cfg = KVStoreConfig.load(path, env={})
    assert cfg.chunk_size == 128 and cfg.queue_size == 16
    assert [t.scheme for t in cfg.tiers] == ["cpu", "disk", "redis"]
    assert cfg.tiers[0].budget == 2 * 2**30 and cfg.tiers[1].budget == 10 * 10**9
    assert (cfg.tiers[1].codec, cfg.tiers[1].eviction, cfg.tiers[1].options) == ("lz4", "fifo", {"fsync": True})
    assert (cfg.tiers[2].codec, cfg.tiers[2].options) == ("int8", {"ttl_s": 60})

    env = {"KVTIER_CONFIG": str(path), "KVTIER_CHUNK_SIZE": "256", "KVTIER_SAVE_DECODE_TOKENS": "true",
           "KVTIER_TIERS": "device?budget=1GiB,cpu?budget=8GiB&codec=int8"}
    cfg = KVStoreConfig.load(env=env)
    assert cfg.chunk_size == 256 and cfg.save_decode_tokens and cfg.queue_size == 16
    assert [(t.url, t.budget, t.codec) for t in cfg.tiers] == [("device", 2**30, "raw"), ("cpu", 8 * 2**30, "int8")]


@pytest.mark.parametrize("data, key", [
    ({"chunk_sise": 256}, "chunk_sise"),
    ({"chunk_size": "256"}, "chunk_size"),
    ({"chunk_size": 0}, "chunk_size"),
    ({"save_decode_tokens": 1}, "save_decode_tokens"),
    ({"queue_full": "block"}, "queue_full"),
    ({"tiers": []}, "tiers"),
    ({"tiers": [{"url": "ftp://x"}]}, "tiers[0].url"),
    ({"tiers": [{"url": "cpu"}, {"url": "redis://"}]}, "tiers[1].url"),
    ({"tiers": [{"url": "redis://h:99999"}]}, "tiers[0].url"),
    ({"tiers": [{"url": "disk://"}]}, "tiers[0].url"),
    ({"tiers": [{"url": "cpu", "budget": -5}]}, "tiers[0].budget"),
    ({"tiers": [{"url": "cpu", "budget": "lots"}]}, "tiers[0].budget"),
    ({"tiers": [{"url": "cpu", "codec": "zip"}]}, "tiers[0].codec"),
    ({"tiers": [{"url": "cpu", "eviction": "random"}]}, "tiers[0].eviction"),
    ({"tiers": [{"url": "cpu", "bugdet": 5}]}, "tiers[0].bugdet"),
    ({"tiers": [{"budget": 5}]}, "tiers[0].url"),
])
def test_errors_name_the_key(data: dict, key: str) -> None:
    with pytest.raises(ValueError) as info:
        KVStoreConfig.from_dict(data)
    assert str(info.value).startswith(key), str(info.value)


def test_env_errors_name_the_variable() -> None:
    with pytest.raises(ValueError, match="^KVTIER_QUEUE_SIZE"):
        KVStoreConfig.load(env={"KVTIER_QUEUE_SIZE": "many"})
    with pytest.raises(ValueError, match=r"^KVTIER_TIERS\[1\].budget"):
        KVStoreConfig.load(env={"KVTIER_TIERS": "cpu,disk:///tmp/x?budget=-1"})


def test_registry_builds_by_scheme(tmp_path: Path) -> None:
    assert create_backend(TierSpec("cpu")).name == "cpu"
    assert create_backend(TierSpec(f"disk://{tmp_path}")).name == "disk"
    assert backend_class("redis+cluster").__name__ == "RedisBackend"
    assert backend_class("kvtier").__name__ == "CacheServerBackend"
    with pytest.raises(ValueError, match="unknown tier scheme"):
        backend_class("s3")
