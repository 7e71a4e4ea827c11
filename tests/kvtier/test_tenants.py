"""Tenants end to end (issue #30): two `kvtier serve` processes sharing Redis and the cache
server, tenants mapped from API keys (`--tenants`), the openai client. A tenant never gets
another's cached tokens, in the engine or across processes; its own repeat hits; tokens are
identical either way; `/kv/lookup` counts only the caller's tenant; an attacker's timing probe
finds nothing it would find without salts."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from scipy.stats import mannwhitneyu

from connector.key_families import INDEX_KEY
from harness import process
from harness.cache_server import CacheServerProcess
from harness.polling import wait_until
from harness.redis import RedisServer
from harness.serve import ServeProcess, metrics
from harness.text import long_text
from kvkeys.tenants import key_tenant, tenant_tag

pytestmark = pytest.mark.slow
ADMIN = "sk-operator"
KEYS = {"alice": "sk-alice-1", "bob": "sk-bob-2"}
SALTS = {"alice": "tenant-alice", "bob": "tenant-bob"}
CHUNK = 128
ENGINE_ARGS = ["--device", "cpu", "--dtype", "float32", "--num-gpu-blocks", "512", "--max-num-seqs", "4",
               "--chunk-size", str(CHUNK)]
DOC = long_text(13) + "\n\nSummarise the sections above in one sentence:"  # 520 tokens


@pytest.fixture(scope="module")
def stores(redis_server_session: RedisServer) -> Iterator[tuple[RedisServer, CacheServerProcess]]:
    redis_server_session.client().flushall()
    cache = CacheServerProcess("--max-bytes", "512MiB")
    yield redis_server_session, cache
    cache.kill()


@pytest.fixture(scope="module")
def servers(default_model_path: Path, stores, tmp_path_factory) -> Iterator[list[ServeProcess]]:
    """Two servers over the same Redis and cache server, with the same tenants file."""
    redis, cache = stores
    tenants = tmp_path_factory.mktemp("tenants") / "tenants.json"
    # alice is named (her figures in /metrics carry tenant="alice"); bob's salt is unnamed ("other")
    tenants.write_text(json.dumps({KEYS["alice"]: {"cache_salt": SALTS["alice"], "name": "alice"},
                                   KEYS["bob"]: SALTS["bob"]}))
    args = ["--model", str(default_model_path), *ENGINE_ARGS, "--kv-tier", redis.url, "--kv-tier", cache.url,
            "--api-key", ADMIN, "--tenants", str(tenants)]
    procs = [ServeProcess(*args, wait=False) for _ in range(2)]
    for p in procs:
        p.wait_ready()
    yield procs
    for p in procs:
        assert p.stop() == 0, p.log()[-3000:]


def client(server: ServeProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=300)


def complete(server: ServeProcess, key: str, prompt: str, salt: str | None = None,
             max_tokens: int = 8) -> tuple[str, int]:
    """Returns (text, cached tokens) of a greedy completion."""
    extra = {"cache_salt": salt} if salt is not None else None
    r = client(server, key).completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=max_tokens,
                                               temperature=0, extra_body=extra)
    return r.choices[0].text, r.usage.prompt_tokens_details.cached_tokens


def lookup(server: ServeProcess, key: str, prompt: str, salt: str | None = None) -> httpx.Response:
    body = {"prompt": prompt} | ({"cache_salt": salt} if salt is not None else {})
    return httpx.post(server.url + "/kv/lookup", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def test_two_tenants_one_document_across_processes(servers, stores) -> None:
    a, b = servers
    redis, cache = stores
    alice, bob = KEYS["alice"], KEYS["bob"]
    text, cached = complete(a, alice, DOC)
    assert cached == 0
    n = lookup(a, ADMIN, DOC).json()["num_tokens"]
    assert 4 * CHUNK < n < 5 * CHUNK  # four full chunks and a tail
    # Alice's chunks reach both shared tiers (written behind the request: wait for them).
    wait_until(lambda: min(lookup(b, alice, DOC).json()["tiers"].values()) >= n - 1, 60.0, 0.2)
    found = lookup(b, alice, DOC).json()
    assert found["max_hit_tokens"] == n - 1 and set(found["tiers"].values()) == {n - 1}
    # Nobody else learns anything from a lookup: bob, the operator unsalted, another salt.
    assert lookup(b, bob, DOC).json()["max_hit_tokens"] == 0
    assert lookup(a, bob, DOC).json()["engine_prefix_cache_tokens"] == 0
    assert lookup(b, ADMIN, DOC).json()["max_hit_tokens"] == 0
    assert lookup(b, ADMIN, DOC, "tenant-carol").json()["max_hit_tokens"] == 0
    assert lookup(b, ADMIN, DOC, SALTS["alice"]).json()["max_hit_tokens"] == n - 1
    # Every stored key is alice's, named by her tag and never by her salt (but the index of key families).
    keys = [k.decode() for k in redis.client().scan_iter(count=1000) if k.decode() != INDEX_KEY]
    assert keys and {key_tenant(k) for k in keys} == {tenant_tag(SALTS["alice"])}
    assert not any(SALTS["alice"] in k for k in keys)
    from kvstore.backends.server_client import CacheServerClient

    cs = CacheServerClient("127.0.0.1", cache.port, connect_timeout=5, timeout=30)
    try:
        assert all(cs.exists_many([k.encode() for k in keys]))
    finally:
        cs.close()
    # Bob, same document, on the other process: nothing cached; alice's repeat there hits.
    assert complete(b, bob, DOC) == (text, 0)
    assert complete(b, alice, DOC) == (text, n - 1)
    assert complete(a, alice, DOC) == (text, n - 1)  # its own prefix cache, then the tiers
    assert complete(a, ADMIN, DOC) == (text, 0)  # unsalted shares only with unsalted


def tenant_figures(server: ServeProcess) -> tuple[dict[tuple[str, str], float], str]:
    """Returns ((metric, tenant label) -> value of the per-tenant figures, the whole exposition)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("kvtier:kv_tenant_"):
                out[(s.name.removesuffix("_total"), s.labels["tenant"])] = s.value
    return out, text


def test_metrics_label_hits_loads_and_stores_by_tenant(servers) -> None:
    """Runs after the two-tenant test: on b, alice (named) loaded the document from the shared
    tiers and bob (unnamed: "other") stored it; on a, the operator's unsalted request ("none")."""
    a, b = servers
    n = lookup(b, ADMIN, DOC).json()["num_tokens"]
    on_b, text_b = tenant_figures(b)
    assert {label for _, label in on_b} == {"alice", "other", "none"}  # bounded: names, other, none
    assert on_b[("kvtier:kv_tenant_hit_tokens", "alice")] == n - 1
    assert on_b[("kvtier:kv_tenant_loaded_bytes", "alice")] > 0
    assert on_b[("kvtier:kv_tenant_hit_tokens", "other")] == 0 and on_b[("kvtier:kv_tenant_stored_bytes", "other")] > 0
    # stores count once they ran, behind the request
    stored = wait_until(lambda: tenant_figures(a)[0][("kvtier:kv_tenant_stored_tokens", "none")] >= 4 * CHUNK,
                        60.0, 0.2)
    assert stored, tenant_figures(a)[0]
    on_a, text_a = tenant_figures(a)
    assert on_a[("kvtier:kv_tenant_stored_tokens", "alice")] >= 4 * CHUNK  # the document's full chunks
    assert on_a[("kvtier:kv_tenant_hit_tokens", "none")] == 0
    assert not any(salt in text for salt in SALTS.values() for text in (text_a, text_b))  # salts are secrets


def test_forgetting_a_tenant_leaves_no_key_and_others_hits_unchanged(servers, stores) -> None:
    """Runs after the two-tenant test: alice and bob each hold the document on server b."""
    a, b = servers
    redis, cache = stores
    n = lookup(b, ADMIN, DOC).json()["num_tokens"]
    before_bob = lookup(b, KEYS["bob"], DOC).json()
    assert before_bob["max_hit_tokens"] == n - 1
    auth = {"Authorization": f"Bearer {KEYS['bob']}"}
    assert httpx.post(b.url + "/kv/forget_tenant", json={"cache_salt": SALTS["alice"]}, headers=auth).status_code == 403
    r = httpx.post(b.url + "/kv/forget_tenant", json={"cache_salt": SALTS["alice"]},
                   headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)
    assert r.status_code == 200, r.text
    report = r.json()
    assert report["errors"] == {} and report["engine_blocks"] > 0
    assert all(v > 0 for v in report["tiers"].values()) and len(report["tiers"]) == 2
    alice_prefix = f"kvtier:tenant-{tenant_tag(SALTS['alice'])}:"
    assert not list(redis.client().scan_iter(match=alice_prefix + "*"))
    assert any(key_tenant(k.decode()) == tenant_tag(SALTS["bob"]) for k in redis.client().scan_iter())
    from kvstore.backends.server_client import CacheServerClient

    cs = CacheServerClient("127.0.0.1", cache.port, connect_timeout=5, timeout=30)
    try:
        assert cs.delete_prefix(alice_prefix.encode()) == 0  # the server scans its memory and disk: none left
    finally:
        cs.close()
    assert lookup(b, KEYS["alice"], DOC).json()["max_hit_tokens"] == 0
    assert lookup(b, KEYS["bob"], DOC).json() | {"num_requests_running": 0, "num_requests_waiting": 0} == \
        before_bob | {"num_requests_running": 0, "num_requests_waiting": 0}


def test_cli_forgets_a_tenant_in_a_disk_directory(tmp_path) -> None:
    import sys

    import torch

    from kvkeys.tenants import tenant_prefix
    from kvstore.storage_manager import StorageManager
    from kvstore.store_config import KVStoreConfig, TierSpec

    url = f"disk://{tmp_path / 'kv'}"
    storage = StorageManager.from_config(KVStoreConfig(tiers=[TierSpec.from_url(url, "t")]))
    kv = torch.zeros(1, 2, 4, 1, 8, dtype=torch.float16)
    for salt in ("tenant-x", "tenant-y"):
        storage.batched_put([(f"{tenant_prefix(tenant_tag(salt))}m:float16:v1:c4:{i:032x}", kv) for i in range(3)])
    storage.batched_put([("kvtier:m:float16:v1:c4:" + "0" * 32, kv)])
    storage.close()
    out = process.run([sys.executable, "-m", "kvtier", "forget-tenant", "--cache-salt", "tenant-x",
                       "--kv-tier", url], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["errors"] == {} and list(report["tiers"].values()) == [3]
    names = sorted(p.name for p in (tmp_path / "kv").iterdir() if p.name.endswith(".kvc"))
    assert len(names) == 4 and not any(tenant_tag("tenant-x") in n for n in names)


def test_salts_are_validated_and_forced_from_keys(servers) -> None:
    a = servers[0]
    for bad in ["", 5, "a/b", "x" * 129]:
        r = httpx.post(a.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1, "cache_salt": bad},
                       headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text
    with pytest.raises(openai.PermissionDeniedError, match="cache_salt"):
        complete(a, KEYS["bob"], "hi", salt=SALTS["alice"])
    assert lookup(a, KEYS["bob"], "hi", SALTS["alice"]).status_code == 403
    assert complete(a, KEYS["bob"], "hi", salt=SALTS["bob"], max_tokens=1)[1] == 0  # its own salt: fine
    with pytest.raises(openai.AuthenticationError):
        complete(a, "sk-nobody", "hi")
    r = httpx.post(a.url + "/kv/reset_prefix_cache", headers={"Authorization": f"Bearer {KEYS['bob']}"})
    assert r.status_code == 403
    chat = client(a, KEYS["bob"]).chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "hi"}], max_tokens=1,
        extra_body={"cache_salt": SALTS["bob"]})
    assert chat.usage.completion_tokens == 1
    with pytest.raises(openai.PermissionDeniedError):
        client(a, KEYS["alice"]).chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "hi"}], max_tokens=1,
            extra_body={"cache_salt": SALTS["bob"]})


def _probe(server: ServeProcess, victim: tuple[str, str | None], attacker: tuple[str, str | None],
           rounds: int) -> tuple[list[float], list[float], list[int]]:
    """An attacker's timing probe: per round the victim sends a new document, then the
    attacker sends that document and one nobody sent (alternating which goes first), timing
    each. Every request starts once the server has written the last one's K/V to its tiers: a
    store still running behind it would slow whichever request met it, hit or not. Returns
    (probe times, fresh times, the probes' cached tokens)."""
    probe, fresh, cached = [], [], []
    # ~225 tokens with the record line: a miss computes all, a hit only the last few, so a miss
    # takes about 5x a hit here and a stall of the machine (the other test worker) rarely
    # closes the gap; at ~65 tokens it was 2x and one CI run's stalls did
    body = long_text(5)
    for i in range(rounds):
        doc, other = (f"Record {uuid.uuid4().hex}.\n{body}" for _ in range(2))
        complete(server, victim[0], doc, victim[1], max_tokens=1)
        order = [(doc, probe), (other, fresh)]
        for prompt, times in order if i % 2 else order[::-1]:
            assert wait_until(lambda: _stores_written(server), 60.0, 0.02), "the server's stores never drained"
            t0 = time.perf_counter()
            _, hit = complete(server, attacker[0], prompt, attacker[1], max_tokens=1)
            times.append(time.perf_counter() - t0)
            if times is probe:
                cached.append(hit)
    return probe, fresh, cached


def _stores_written(server: ServeProcess) -> bool:
    """Returns whether the server has no store queued or being written to a slower tier."""
    m = metrics(server.url)
    return m["kvtier:kv_pending_stores"] == 0 and m["kvtier:kv_slow_tier_writes_pending"] == 0


def test_timing_probe_learns_nothing_across_tenants(servers) -> None:
    """Distributions, not single timings: a one-sided Mann-Whitney U test of "the probe is
    faster", 8 rounds against 8. Across salts it must not be: p > 0.002 is a false alarm in
    about 1 run of 500. The same probe without salts must be faster (p < 0.01), so the probe
    is shown able to see a hit; with 8 rounds that holds even when one probe lands on a stall
    of the machine (one probe slower than every fresh prompt still gives p = 0.005)."""
    a = servers[0]
    probe, fresh, cached = _probe(a, (KEYS["alice"], None), (KEYS["bob"], None), rounds=8)
    assert cached == [0] * 8
    salted_p = mannwhitneyu(probe, fresh, alternative="less").pvalue
    probe_u, fresh_u, cached_u = _probe(a, (ADMIN, None), (ADMIN, None), rounds=8)
    assert min(cached_u) > 0
    unsalted_p = mannwhitneyu(probe_u, fresh_u, alternative="less").pvalue
    assert unsalted_p < 0.01, (probe_u, fresh_u)
    assert salted_p > 0.002, (probe, fresh)


def test_router_lookup_carries_the_salt_and_tenant_files_are_checked(tmp_path) -> None:
    from kvtier.router.prompt_view import view_request
    from kvtier.server.tenant_auth import TenantKeys

    view = view_request({"prompt": "some document", "cache_salt": "tenant-x"})
    assert view.lookup == {"prompt": "some document", "cache_salt": "tenant-x"}
    f = tmp_path / "t.yaml"
    f.write_text("sk-a: tenant-a\nsk-b: tenant-b\n")
    keys = TenantKeys.load(f, "sk-admin")
    assert keys.match("Bearer sk-b") == (True, "tenant-b") and keys.match("Bearer sk-admin") == (True, None)
    assert keys.match("Bearer sk-c") == (False, None)
    f.write_text("sk-a: {cache_salt: tenant-a, name: team-a}\nsk-b: tenant-b\n")
    assert TenantKeys.load(f, "sk-admin").names == {"tenant-a": "team-a"}
    for text, problem in [("sk-a: ''\n", "entry 0: cache_salt"), ("sk-a: a/b\n", "entry 0: cache_salt"),
                          ("sk-a: {cache_salt: t, name: other}\n", "entry 0: name"),
                          ("sk-a: {cache_salt: t, name: 'a b'}\n", "entry 0: name"),
                          ("sk-a: {salt: t}\n", "entry 0: a mapping needs cache_salt"),
                          ("sk-a: {cache_salt: t, name: x}\nsk-b: {cache_salt: t, name: y}\n",
                           "entry 1: its cache_salt"),
                          ("- sk-a\n", "mapping"), ("sk-admin: t\n", "equals --api-key")]:
        f.write_text(text)
        with pytest.raises(ValueError, match=problem):
            TenantKeys.load(f, "sk-admin")
    with pytest.raises(ValueError, match="needs --api-key"):
        TenantKeys.load(f, None)
