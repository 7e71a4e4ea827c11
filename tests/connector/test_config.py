"""Connector configuration: every accepted form, overrides, and errors that name the key."""

from __future__ import annotations

import pytest

from connector.connector_config import ConnectorConfig, make_config
from connector.engine_connector import EngineConnector, build_connector
from kvstore.store_config import KVStoreConfig, TierSpec


def test_forms_and_overrides(tmp_path):
    urls = ["cpu?budget=1GiB", f"disk://{tmp_path}/kv"]
    cfg = make_config(urls, chunk_size=64, codec="lz4", save_decode_tokens=True, save_unfull_chunk=False)
    assert [t.url for t in cfg.kvstore.tiers] == ["cpu", f"disk://{tmp_path}/kv"]
    assert cfg.kvstore.tiers[0].budget == 2**30
    assert all(t.codec == "lz4" for t in cfg.kvstore.tiers)
    assert (cfg.chunk_size, cfg.save_decode_tokens, cfg.save_unfull_chunk) == (64, True, False)
    assert [t.url for t in make_config("cpu").kvstore.tiers] == ["cpu"]
    assert make_config({"tiers": ["cpu"], "chunk_size": 32, "save_unfull_chunk": False}).save_unfull_chunk is False
    ks = KVStoreConfig(tiers=[TierSpec("cpu")])
    assert make_config(ks, codec="int8", chunk_size=16).chunk_size == 16
    assert ks.tiers[0].codec == "raw"  # overrides never touch the caller's objects
    base = ConnectorConfig(kvstore=ks, chunk_size=32)
    assert make_config(base).chunk_size == 32 and make_config(base, chunk_size=8).chunk_size == 8
    assert base.chunk_size == 32


def test_yaml_with_connector_keys_and_env(tmp_path):
    path = tmp_path / "kv.yaml"
    path.write_text("chunk_size: 128\nsave_unfull_chunk: false\nmax_pending_store_bytes: 64MiB\n"
                    "tiers:\n  - {url: cpu, budget: 2GiB}\n")
    cfg = make_config(str(path))
    assert (cfg.chunk_size, cfg.save_unfull_chunk, cfg.max_pending_store_bytes) == (128, False, 64 * 2**20)
    env_cfg = ConnectorConfig.load(path, env={"KVTIER_CHUNK_SIZE": "32", "KVTIER_TIERS": "cpu,device"})
    assert env_cfg.chunk_size == 32 and [t.url for t in env_cfg.kvstore.tiers] == ["cpu", "device"]
    assert env_cfg.save_unfull_chunk is False  # env overrides only what it names


@pytest.mark.parametrize("kwargs,message", [
    (dict(source=["cpu"], chunk_size=0), "chunk_size"),
    (dict(source=["cpu"], codec="zip"), "codec"),
    (dict(source=["ftp://x"]), "tiers[0].url"),
    (dict(source=[]), "tiers"),
    (dict(source={"tiers": ["cpu"], "bogus": 1}), "bogus"),
    (dict(source={"save_unfull_chunk": "yes"}), "save_unfull_chunk"),
    (dict(source={"max_pending_store_bytes": "lots"}), "max_pending_store_bytes"),
    (dict(source=42), "int"),
])
def test_bad_config_names_the_key(kwargs, message):
    source = kwargs.pop("source")
    with pytest.raises(ValueError) as err:
        make_config(source, **kwargs)
    assert message in str(err.value)


def test_build_connector_passes_instances_through_and_needs_an_engine():
    conn = build_connector(["cpu"], chunk_size=16)
    try:
        assert isinstance(conn, EngineConnector) and conn.config.chunk_size == 16
        assert build_connector(conn) is conn
        with pytest.raises(ValueError, match="no overrides"):
            build_connector(conn, chunk_size=32)
        with pytest.raises(RuntimeError, match="register_model"):
            conn.worker.register_kv_caches([])
        with pytest.raises(RuntimeError, match="register_model"):
            _ = conn.planner.keyspace
    finally:
        conn.shutdown()


def test_every_key_has_a_kvtier_variable():
    from dataclasses import fields

    from connector.blend.blend_config import BlendConfig
    from connector.connector_config import all_settings

    keys = {s.key for s in all_settings()}
    own = {f.name for f in fields(ConnectorConfig)} - {"kvstore", "extensions"}
    want = {f.name for f in fields(KVStoreConfig)} | own | {f"blend.{f.name}" for f in fields(BlendConfig)}
    assert keys == want
    assert all(s.env == "KVTIER_" + s.key.replace(".", "_").upper() for s in all_settings())
    env = {"KVTIER_TIERS": "cpu", "KVTIER_SAVE_UNFULL_CHUNK": "false", "KVTIER_MAX_PENDING_STORE_BYTES": "64MiB",
           "KVTIER_CHUNK_SIZE": "64", "KVTIER_SAVE_DECODE_TOKENS": "yes", "KVTIER_STORE_QUEUE_SIZE": "7",
           "KVTIER_QUEUE_SIZE": "9", "KVTIER_USE_LAYERWISE": "0", "KVTIER_BLEND_ENABLED": "1",
           "KVTIER_BLEND_RATIO": "0.3",
           "KVTIER_BLEND_CHECK_LAYER": "2", "KVTIER_BLEND_NARROWING": "8:0.1,12:0.05",
           "KVTIER_BLEND_SEPARATOR": " || ", "KVTIER_BLEND_SEGMENT_KV": "standalone"}
    cfg = ConnectorConfig.load(env=env)
    assert (cfg.save_unfull_chunk, cfg.max_pending_store_bytes, cfg.use_layerwise) == (False, 64 * 2**20, False)
    assert (cfg.chunk_size, cfg.save_decode_tokens) == (64, True)
    # Two queues, two keys: the connector's store queue and the storage manager's writer.
    assert (cfg.store_queue_size, cfg.kvstore.queue_size) == (7, 9)
    b = cfg.extensions["blend"]
    assert (b.enabled, b.ratio, b.check_layer, b.narrowing, b.separator, b.segment_kv) == (
        True, 0.3, 2, [(8, 0.1), (12, 0.05)], " || ", "standalone")


def test_env_blend_keys_merge_into_the_yaml_section(tmp_path):
    path = tmp_path / "kv.yaml"
    path.write_text("tiers: [cpu]\nblend: {enabled: true, ratio: 0.5}\n")
    cfg = ConnectorConfig.load(path, env={"KVTIER_BLEND_CHECK_LAYER": "3"})
    b = cfg.extensions["blend"]
    assert (b.enabled, b.ratio, b.check_layer) == (True, 0.5, 3)
    path.write_text("tiers: [cpu]\nblend: true\n")
    assert ConnectorConfig.load(path, env={"KVTIER_BLEND_RATIO": "0.25"}).extensions["blend"].ratio == 0.25
    with pytest.raises(ValueError, match="^KVTIER_BLEND_NARROWING: expected layer:ratio"):
        ConnectorConfig.load(env={"KVTIER_BLEND_NARROWING": "8"})


def test_unknown_key_lists_connector_keys_too():
    with pytest.raises(ValueError) as info:
        make_config({"tiers": ["cpu"], "save_unfull_chunks": True})
    msg = str(info.value)
    assert msg.startswith("save_unfull_chunks: unknown config key (did you mean save_unfull_chunk?)")
    for key in ("tiers", "chunk_size", "save_unfull_chunk", "max_pending_store_bytes", "blend", "use_layerwise"):
        assert key in msg


def test_yaml_syntax_error_names_the_file_and_line(tmp_path):
    path = tmp_path / "kv.yaml"
    path.write_text("tiers: [cpu]\nchunk_size: 64\nblend: {enabled: true\n")
    with pytest.raises(ValueError) as info:
        ConnectorConfig.load(path, env={})
    assert str(info.value).startswith(f"config: {path}:4:1: YAML syntax error")
    with pytest.raises(ValueError, match=f"config: {path}:4:1"):
        ConnectorConfig.load(env={"KVTIER_CONFIG": str(path)})


def test_cli_reports_a_yaml_syntax_error_in_one_line(tmp_path, capsys):
    from kvtier.cli import main

    path = tmp_path / "kv.yaml"
    path.write_text("tiers: [cpu\n")
    assert main(["generate", "hello", "--device", "cpu", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"config: {path}:2:1: YAML syntax error" in err and "Traceback" not in err


def test_lmcache_env_variables_other_than_the_config_file_are_one_warning(caplog):
    import logging

    caplog.set_level(logging.WARNING, logger="kvtier.connector")
    cfg = ConnectorConfig.load(env={"LMCACHE_CHUNK_SIZE": "64", "LMCACHE_LOCAL_CPU": "True"})
    assert cfg.chunk_size == 256
    assert caplog.messages == ["LMCACHE_CHUNK_SIZE, LMCACHE_LOCAL_CPU not read by kvtier (only LMCACHE_CONFIG_FILE "
                               "is); use the KVTIER_* variables, see docs/configuration.md"]


@pytest.mark.slow
def test_budget_smaller_than_one_chunk_fails_at_start_up(default_model_path, capsys):
    from engine import LLM
    from kvtier.cli import main

    with pytest.raises(ValueError) as info:
        LLM(str(default_model_path), device="cpu", dtype="float32", num_gpu_blocks=64,
            kv_connector=["cpu?budget=4GiB", "cpu?budget=5"])
    msg = str(info.value)
    assert msg.startswith("tiers[1] cpu: budget=5 bytes is smaller than one chunk (")
    assert "did you mean 5GB or 5GiB?" in msg
    argv = ["generate", "hello", "--device", "cpu", "--dtype", "float32", "--kv-tier", "cpu?budget=5"]
    assert main(argv) == 2
    assert "tiers[0] cpu: budget=5 bytes is smaller than one chunk" in capsys.readouterr().err
