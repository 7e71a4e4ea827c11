"""LMCache configs read as kvtier's: every mapped key lands where the table says (with its
notice), keys kvtier cannot honour are errors naming them, and an LMCache YAML runs the real
default model end to end over the tiers it describes (hits on a repeat)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from connector.connector_config import ConnectorConfig, make_config
from connector.lmcache_compat import LMCACHE_KEYS, is_lmcache, lookup
from engine import LLM, SamplingParams
from harness.text import long_text

GIB = 2**30


def test_lmcache_yaml_maps_every_key_with_a_notice(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvtier.connector")
    path = tmp_path / "lmcache.yaml"
    path.write_text(f"""\
chunk_size: 64
local_cpu: true
max_local_cpu_size: 2.5
local_disk: "file://{tmp_path}/disk/"
max_local_disk_size: 10
remote_url: "redis://127.0.0.1:6379"
remote_serde: "naive"
cache_policy: FIFO
save_decode_cache: true
save_unfull_chunk: false
enable_blending: true
blend_recompute_ratios: [0.2, 0.1]
blend_check_layers: [1, 4]
blend_special_str: " ## "
use_layerwise: true
enable_pd: false
lmcache_instance_id: "lmcache_default_instance"
""")
    cfg = ConnectorConfig.load(path, env={})
    tiers = cfg.kvstore.tiers
    assert [(t.url, t.budget, t.codec, t.eviction) for t in tiers] == [
        ("cpu", int(2.5 * GIB), "raw", "fifo"),
        (f"disk://{tmp_path}/disk/", 10 * GIB, "raw", "fifo"),
        ("redis://127.0.0.1:6379", None, "raw", "fifo"),
    ]
    assert (cfg.chunk_size, cfg.save_decode_tokens, cfg.save_unfull_chunk) == (64, True, False)
    b = cfg.extensions["blend"]
    assert (b.enabled, b.ratio, b.check_layer, b.narrowing, b.separator) == (True, 0.2, 1, [(4, 0.1)], " ## ")
    assert cfg.use_layerwise is False  # kvtier's CacheBlend loads whole chunks: ignored, with a warning
    notices = [r.getMessage() for r in caplog.records]
    for key in ("chunk_size", "max_local_cpu_size", "local_disk", "remote_url", "remote_serde", "cache_policy",
                "save_decode_cache", "save_unfull_chunk", "enable_blending", "blend_recompute_ratios",
                "blend_check_layers", "blend_special_str"):
        assert any(m.startswith("LMCache config: ") and key in m and "->" in m for m in notices), key
    assert any("use_layerwise ignored" in m for m in notices)
    assert any("lmcache_instance_id has no effect" in m for m in notices)
    assert any("enable_pd=False ignored" in m for m in notices)


def test_defaults_follow_lmcache_for_tiers() -> None:
    cfg = make_config({"remote_url": "redis://h:6379", "remote_serde": "lz4"})
    assert [(t.url, t.budget, t.codec) for t in cfg.kvstore.tiers] == [
        ("cpu", 5 * GIB, "raw"), ("redis://h:6379", None, "lz4")]
    assert [t.url for t in make_config({"local_device": "cuda", "max_local_cache_size": 1,
                                        "local_cpu": False}).kvstore.tiers] == ["device"]
    assert not is_lmcache({"chunk_size": 64, "save_unfull_chunk": True})  # shared keys: read as kvtier's


@pytest.mark.parametrize("data,message", [
    ({"local_cpu": True, "enable_pd": True, "pd_role": "sender"}, "enable_pd: LMCache's enable_pd has no kvtier"),
    ({"local_cpu": True, "pd_role": "receiver"}, "pd_role: LMCache's pd_role has no kvtier meaning"),
    ({"local_cpu": True, "enable_p2p": True}, "enable_p2p:"),
    ({"remote_url": "lm://localhost:65432"}, "remote_url: 'lm://localhost:65432' is LMCache's own server"),
    ({"remote_url": "mooncakestore://x:1"}, "remote_url: the mooncakestore:// remote has no kvtier tier"),
    ({"remote_url": "redis://h:1", "remote_serde": "cachegen"}, "remote_serde: 'cachegen' has no kvtier codec"),
    ({"local_disk": "/tmp/x"}, "max_local_disk_size: local_disk needs a disk budget"),
    ({"local_disk": "relative/dir", "max_local_disk_size": 1}, "local_disk: expected an absolute path"),
    ({"max_local_cpu_size": "5GB"}, "max_local_cpu_size: expected a size in GB"),
    ({"local_cpu": False}, "local_cpu: the LMCache config leaves no tier"),
    ({"local_cpu": True, "cache_policy": "LFU"}, "cache_policy: 'LFU' has no kvtier eviction policy"),
    ({"local_cpu": True, "tiers": ["cpu"]}, "tiers: a kvtier key in an LMCache config"),
    ({"local_cpu": True, "blend_check_layers": [1, 2], "blend_recompute_ratios": [0.1]},
     "blend_check_layers/blend_recompute_ratios: one ratio per layer"),
    ({"local_cpu": True, "max_local_cpu_sise": 5}, "max_local_cpu_sise: not a kvtier key, nor an LMCache key"),
    ({"local_cpu": True, "blend_check_layers": [1, 4]}, "blend_check_layers/blend_recompute_ratios: several"),
])
def test_keys_kvtier_cannot_honour_are_errors_naming_them(data: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        make_config(data)
    assert str(info.value).startswith(message), str(info.value)


def test_unknown_lmcache_key_suggests_and_lists_lmcache_keys() -> None:
    with pytest.raises(ValueError) as info:
        make_config({"local_cpu": True, "max_local_cpu_sise": 5})
    msg = str(info.value)
    assert "did you mean max_local_cpu_size?" in msg and "remote_url" in msg and "pd_*" in msg


def test_every_table_row_is_reachable() -> None:
    for row in LMCACHE_KEYS:
        name = row.name[:-1] + "x" if row.name.endswith("*") else row.name
        assert lookup(name) == row


@pytest.mark.slow
def test_lmcache_yaml_runs_the_default_model_with_hits_on_a_repeat(tmp_path: Path, default_model_path: Path,
                                                                  redis_server, monkeypatch) -> None:
    """An LMCache YAML named by LMCACHE_CONFIG_FILE alone enables the connector in LLM();
    the repeat is served from the mapped tiers (the engine's own prefix cache is off)."""
    path = tmp_path / "lmcache.yaml"
    path.write_text(f"""\
chunk_size: 64
local_cpu: false
local_disk: "file://{tmp_path}/disk/"
max_local_disk_size: 2
remote_url: "{redis_server.url}"
remote_serde: "naive"
""")
    for var in ("KVTIER_CONFIG", "KVTIER_TIERS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", str(path))
    params = SamplingParams(temperature=0.0, max_tokens=4)
    prompt = long_text(2)
    with LLM(str(default_model_path), device="cpu", dtype="float32", enable_prefix_caching=False,
             num_gpu_blocks=128) as llm:
        conn = llm.engine.kv_connector
        assert conn is not None
        assert [t.url for t in conn.config.kvstore.tiers] == [f"disk://{tmp_path}/disk/", redis_server.url]
        first = llm.generate(prompt, params)[0]
        assert conn.flush(60)
        second = llm.generate(prompt, params)[0]
        n = len(first.prompt_token_ids)
        assert first.num_cached_tokens == 0
        assert second.num_cached_tokens == n - 1  # the last prompt token is always computed
        assert second.outputs[0].token_ids == first.outputs[0].token_ids
        stats = conn.storage.stats()
        assert all(s.bytes_stored > 0 for s in stats.values()), stats
