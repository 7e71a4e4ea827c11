"""Config: YAML and KVTIER_* env loading, sizes, and errors that name the offending key."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.registry import backend_class, create_backend
from kvstore.store_config import KVStoreConfig, TierSpec, parse_size


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
queue_size: 16
tiers:
  - {{url: cpu, budget: 2GiB}}
  - {{url: "disk://{tmp_path}/d", budget: 10GB, codec: lz4, eviction: fifo, options: {{fsync: true}}}}
  - "redis://127.0.0.1:6379/2?codec=int8&ttl_s=60"
""")
    cfg = KVStoreConfig.load(path, env={})
    assert cfg.queue_size == 16
    assert [t.scheme for t in cfg.tiers] == ["cpu", "disk", "redis"]
    assert cfg.tiers[0].budget == 2 * 2**30 and cfg.tiers[1].budget == 10 * 10**9
    assert (cfg.tiers[1].codec, cfg.tiers[1].eviction, cfg.tiers[1].options) == ("lz4", "fifo", {"fsync": True})
    assert (cfg.tiers[2].codec, cfg.tiers[2].options) == ("int8", {"ttl_s": 60})

    env = {"KVTIER_CONFIG": str(path), "KVTIER_QUEUE_FULL": "drop_new",
           "KVTIER_TIERS": "device?budget=1GiB,cpu?budget=8GiB&codec=int8"}
    cfg = KVStoreConfig.load(env=env)
    assert cfg.queue_full == "drop_new" and cfg.queue_size == 16
    assert [(t.url, t.budget, t.codec) for t in cfg.tiers] == [("device", 2**30, "raw"), ("cpu", 8 * 2**30, "int8")]


@pytest.mark.parametrize("data, key", [
    ({"queue_sise": 256}, "queue_sise"),
    ({"queue_size": "256"}, "queue_size"),
    ({"queue_size": 0}, "queue_size"),
    ({"chunk_size": 256}, "chunk_size"),  # the connector's key, not kvstore's
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


def test_every_key_has_a_kvtier_variable() -> None:
    from dataclasses import fields

    from kvstore.store_config import KVSTORE_SETTINGS

    rows = {s.key: s.env for s in KVSTORE_SETTINGS}
    assert set(rows) == {f.name for f in fields(KVStoreConfig)}
    env = {"KVTIER_TIERS": "cpu?budget=1GiB",
           "KVTIER_QUEUE_SIZE": "8", "KVTIER_QUEUE_FULL": "drop_new", "KVTIER_BACKOFF_INITIAL_S": "0.5",
           "KVTIER_BACKOFF_MAX_S": "2", "KVTIER_INTEGRITY_KEY": "k" * 16, "KVTIER_BREAKER_FAILURES": "3",
           "KVTIER_FLUSH_TIMEOUT_S": "1.5"}
    assert set(env) == set(rows.values())
    cfg = KVStoreConfig.load(env=env)
    assert (cfg.tiers[0].budget, cfg.queue_size, cfg.queue_full, cfg.backoff_initial_s, cfg.backoff_max_s,
            cfg.integrity_key, cfg.breaker_failures, cfg.flush_timeout_s) == (
        2**30, 8, "drop_new", 0.5, 2.0, "k" * 16, 3, 1.5)
    for key, bad in (("breaker_failures", 0), ("flush_timeout_s", 0), ("flush_timeout_s", "soon")):
        with pytest.raises(ValueError, match=key):
            KVStoreConfig.from_dict({key: bad})
    # the older name of the secret still works; the documented one wins
    assert KVStoreConfig.load(env={"KVTIER_KV_KEY": "a" * 16}).integrity_key == "a" * 16
    both = {"KVTIER_KV_KEY": "a" * 16, "KVTIER_INTEGRITY_KEY": "b" * 16}
    assert KVStoreConfig.load(env=both).integrity_key == "b" * 16


def test_unknown_key_suggests_and_lists_every_key() -> None:
    with pytest.raises(ValueError) as info:
        KVStoreConfig.from_dict({"queuesize": 64})
    msg = str(info.value)
    assert msg.startswith("queuesize: unknown config key (did you mean queue_size?)")
    assert all(k in msg for k in ("tiers", "queue_full", "integrity_key"))


@pytest.mark.parametrize("text,where", [
    ("chunk_size: 64\ntiers: [cpu\n", ":3:1"),
    ("chunk_size: 64\n  queue_size: 3\n", ":2:13"),
    ("tiers:\n\t- cpu\n", ":2:1"),
])
def test_yaml_syntax_error_names_file_and_line(tmp_path: Path, text: str, where: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        KVStoreConfig.from_yaml(path)
    msg = str(info.value)
    assert msg.startswith(f"config: {path}{where}: YAML syntax error: ") and "\n" not in msg, msg
    with pytest.raises(ValueError, match="cannot read"):
        KVStoreConfig.from_yaml(tmp_path / "missing.yaml")
