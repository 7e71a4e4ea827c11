"""`cache_salt` in the connector's keys: a salt's chunks (prefix chains and CacheBlend
segments) are its own in every tier, one salt shares as before, unsalted keys are unchanged."""

from __future__ import annotations

import pytest

from connector.blend.blend_api import blend_stats, stored_segment
from connector.connector_config import ConnectorConfig
from connector.engine_connector import EngineConnector, build_connector
from engine import SamplingParams
from harness.text import PARAGRAPHS
from kvkeys.keyspace import Keyspace
from kvkeys.tenants import key_tenant, tenant_prefix, tenant_tag
from tests.fixtures.connector import CHUNK, GREEDY, assert_idle, engine

# Computed by the code before salts existed (commit e936ad1): stored chunks stay valid.
GOLDEN_KEYS = ["kvtier:m0:float16:v1:c4:474f1c555bbe772003f20a71e1e2902a",
               "kvtier:m0:float16:v1:c4:60f13a2673c987a4bfdb7bd2b7d9af13",
               "kvtier:m0:float16:v1:c4:3be5bf4c4a65283930f67d96444a472b"]
GOLDEN_SEGMENT_KEYS = ["kvtier:m0:float16:v1:c4:7184aa22982b1343dfac224e828f4997",
                       "kvtier:m0:float16:v1:c4:6c7e94d69e82ede1dcb544f2f064c28c"]


def test_unsalted_keys_are_unchanged_salted_keys_carry_the_tenant() -> None:
    ks = Keyspace("m0", "float16", 4, 2)
    assert [s.key for s in ks.spans(list(range(10)))] == GOLDEN_KEYS
    assert [s.key for s in ks.segment_spans(list(range(6)), "in_context")] == GOLDEN_SEGMENT_KEYS
    assert ks.for_salt(None) is ks and all(key_tenant(k) is None for k in GOLDEN_KEYS)
    a, b = ks.for_salt("tenant-a"), ks.for_salt("tenant-b")
    assert a is ks.for_salt("tenant-a")
    for salted, salt in ((a, "tenant-a"), (b, "tenant-b")):
        keys = [s.key for s in salted.spans(list(range(10)))] + [
            s.key for s in salted.segment_spans(list(range(6)), "in_context")]
        assert all(k.startswith(tenant_prefix(tenant_tag(salt))) for k in keys)
        assert {key_tenant(k) for k in keys} == {tenant_tag(salt)}
        assert "tenant-" + salt not in "".join(keys).replace(tenant_prefix(tenant_tag(salt)), "")
    # Whole chains differ, not only the tag: the hash part of no key is shared.
    hashes = [{s.key.rsplit(":", 1)[1] for s in k.spans(list(range(10)))} for k in (ks, a, b)]
    assert not (hashes[0] & hashes[1]) and not (hashes[1] & hashes[2]) and not (hashes[0] & hashes[2])
    assert a.for_salt(None).spans(list(range(10)))[0].key == GOLDEN_KEYS[0]


@pytest.mark.slow
def test_tenants_share_only_within_their_salt(default_model_path, prompt_ids, reference) -> None:
    conn = build_connector(["cpu"], chunk_size=CHUNK)
    with engine(default_model_path, conn) as llm:
        def run(salt: str | None) -> tuple[list[int], int]:
            prompt = {"prompt_token_ids": prompt_ids} if salt is None else {"prompt_token_ids": prompt_ids,
                                                                             "cache_salt": salt}
            out = llm.generate(prompt, GREEDY)[0]
            assert conn.flush(timeout=60)
            return list(out.outputs[0].token_ids), out.num_cached_tokens

        n = len(prompt_ids)
        assert run("tenant-a") == (reference, 0)
        assert run("tenant-b") == (reference, 0)  # neither the engine's blocks nor a's chunks
        assert run(None) == (reference, 0)
        assert run("tenant-a") == (reference, n - 1)  # the engine's own blocks, then its chunks' tail
        assert llm.reset_prefix_cache()
        assert run("tenant-b") == (reference, n - 1)  # from the tier: b's own chunks
        assert run(None) == (reference, n - 1)
        assert run("tenant-c") == (reference, 0)
        for salt in ("tenant-a", "tenant-b", "tenant-c", None):
            assert conn.lookup(prompt_ids, salt)["0:cpu"] == n - 1
        assert conn.lookup(prompt_ids, "tenant-d")["0:cpu"] == 0
        ks = conn.planner.keyspace
        for salt in ("tenant-a", "tenant-b"):
            keys = ks.stored_keys(ks.for_salt(salt).spans(prompt_ids))
            assert all(k.startswith(tenant_prefix(tenant_tag(salt))) for k in keys)
        # The engine forgets one tenant's blocks, no one else's.
        assert llm.engine.forget_tenant("tenant-b") > 0
        assert llm.engine.num_cached_prefix_tokens(prompt_ids, "tenant-b") == 0
        assert llm.engine.num_cached_prefix_tokens(prompt_ids, "tenant-c") > 0
        assert_idle(llm, conn)


@pytest.mark.slow
def test_blend_segments_are_keyed_per_salt(default_model_path) -> None:
    from engine.model_loader import load_tokenizer

    tok = load_tokenizer(default_model_path)
    parts = [tok.encode("You answer briefly.\n"), tok.encode(PARAGRAPHS[0] + "\n"), tok.encode(PARAGRAPHS[1] + "\n"),
             tok.encode("Question: what is counted?")]
    ids = [t for p in parts for t in p]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    conn = build_connector({"tiers": ["cpu"], "chunk_size": 32, "blend": {"enabled": True, "ratio": 0.15}})
    with engine(default_model_path, conn, enable_prefix_caching=False, num_gpu_blocks=48) as llm:
        def hits(salt: str | None) -> int:
            before = blend_stats(conn)["segment_hits"]
            prompt = {"prompt_token_ids": ids, "segment_lens": [len(p) for p in parts], "cache_salt": salt}
            llm.generate(prompt, params)
            assert conn.flush(timeout=60)
            return int(blend_stats(conn)["segment_hits"] - before)

        assert hits("tenant-a") == 0
        assert hits("tenant-b") == 0
        assert hits(None) == 0
        assert hits("tenant-a") > 0 and hits("tenant-b") > 0 and hits(None) > 0
        for salt in ("tenant-a", None):
            assert stored_segment(conn, parts[1], "in_context", cache_salt=salt) is not None
        assert stored_segment(conn, parts[1], "in_context", cache_salt="tenant-c") is None


def test_tenant_tag_key_keys_the_tags_in_stored_keys() -> None:
    """`tenant_tag_key` (config, KVTIER_TENANT_TAG_KEY, or vLLM's kv_connector_extra_config):
    a salted key carries the HMAC tag; unsalted keys are unchanged; the key is never shown."""
    secret = "operator secret, 32 bytes long.."
    from_env = ConnectorConfig.load(env={"KVTIER_TENANT_TAG_KEY": secret})
    from_extra = ConnectorConfig.load(env={}, overrides={"tenant_tag_key": secret})
    assert from_env.tenant_tag_key == from_extra.tenant_tag_key == secret and secret not in repr(from_env)
    with pytest.raises(ValueError, match="tenant_tag_key: a shared secret needs at least 16 bytes"):
        ConnectorConfig.load(env={}, overrides={"tenant_tag_key": "short"})
    unkeyed = tenant_tag("tenant-a")
    connector = EngineConnector(from_extra)
    try:
        ks = Keyspace("m0", "float16", 4, 2)
        salted = ks.for_salt("tenant-a")
        assert salted.tenant == tenant_tag("tenant-a", secret) != unkeyed
        assert all(key_tenant(s.key) == salted.tenant for s in salted.spans(list(range(10))))
        assert [s.key for s in ks.spans(list(range(10)))] == GOLDEN_KEYS
    finally:
        connector.shutdown()
        ConnectorConfig().apply_tenant_tag_key()  # back to unkeyed for the tests after this one
    assert tenant_tag("tenant-a") == unkeyed
