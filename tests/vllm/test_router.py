"""`kvtier router --policy kv-aware` across two `vllm serve` backends with kvtier's connector,
each with its own `cpu` tier, so a hit is local to one backend. The backends' `/kv/lookup`
(connector/vllm/lookup_route.py) answers what the connector then loads; the router sends each
prompt to the backend holding it, also where prefix-hash alone would pick the other one. One
backend runs as `kvtier-vllm serve` (which adds the route by itself, its worker in the engine
core's process), the other as vLLM's own server with `--middleware`, in vLLM's default layout,
with an API key (the router passes the client's on). That one also answers kvtier's cache-control
routes (`/kv/inspect`, `/kv/pin`, `/kv/unpin`, `/kv/clear`), its worker in its own process
answering over the lookup channel; they run last, as `clear` empties its tier. A third
backend keeps vLLM's own prefix cache on: its lookup counts that cache (asked of the
connector's scheduler side, in vLLM's engine core), and the router sends a prompt there for it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from harness import process
from harness.process import repo_env
from harness.serve import RouterProcess
from harness.text import long_text
from harness.vllm import VllmServer, close_together, start_together
from kvtier.router.backends import Backend
from kvtier.router.policy import PrefixHash
from kvtier.router.prompt_view import view_request
from kvtier.vllm_cli import LOOKUP_MIDDLEWARE

CONFIG = {"tiers": ["cpu?budget=1GiB"], "chunk_size": 256}
HIT = "kvtier:kv_connector_hit_tokens_total"
KEY = "router-test-key"  # the middleware backend's --api-key (the other has none and ignores it)
AUTH = {"Authorization": f"Bearer {KEY}"}
CPU = "0:cpu"
PREFIX_CACHE_FLAGS = ("--max-model-len", "4096", "--enable-prompt-tokens-details")  # vLLM's prefix cache on
SKIP_SAVE = {"kvtier.skip_save": True}  # the connector stores nothing: a hit can only be vLLM's own


@pytest.fixture(scope="module")
def started(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[VllmServer]]:
    """The two backends without vLLM's own prefix cache (ENGINE_FLAGS), then one with it."""
    logs = tmp_path_factory.mktemp("vllm-router")
    servers = start_together(lambda: VllmServer(default_model_path, CONFIG, logs / "cli.log", cli=True,
                                                worker_in_engine=True),
                             lambda: VllmServer(default_model_path, CONFIG, logs / "middleware.log", "kv_both",
                                                "--middleware", LOOKUP_MIDDLEWARE, "--api-key", KEY),
                             lambda: VllmServer(default_model_path, CONFIG, logs / "prefix-cache.log", cli=True,
                                                worker_in_engine=True, engine_flags=PREFIX_CACHE_FLAGS))
    yield servers
    close_together(*servers)


@pytest.fixture(scope="module")
def backends(started: list[VllmServer]) -> list[VllmServer]:
    return started[:2]


@pytest.fixture(scope="module")
def prefix_cached(started: list[VllmServer]) -> VllmServer:
    return started[2]


@pytest.fixture(scope="module")
def router(backends: list[VllmServer]) -> Iterator[RouterProcess]:
    # A generous lookup timeout: this tests the choice, not the latency of a busy 2-core machine.
    proc = RouterProcess(*[f"--backend={s.url}" for s in backends], "--policy", "kv-aware",
                         "--lookup-timeout", "5", "--health-interval", "0.2")
    yield proc
    assert proc.stop() == 0, proc.log()[-3000:]


@pytest.fixture(scope="module")
def tokenizer(default_model_path: Path) -> Any:
    return AutoTokenizer.from_pretrained(default_model_path)


def _ids(tokenizer: Any, tag: str, n: int) -> list[int]:
    """`n` token ids of a document starting with `tag` (distinct tags: distinct chunk chains)."""
    ids = tokenizer(f"{tag}\n\n{long_text(n // 30)}")["input_ids"][:n]
    assert len(ids) == n
    return list(ids)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=300)


def _complete(url: str, ids: list[int], max_tokens: int = 4, cache_salt: str | None = None,
              **extra: Any) -> list[int]:
    return list(_completion(url, ids, max_tokens, cache_salt, **extra).choices[0].token_ids)


def _completion(url: str, ids: list[int], max_tokens: int = 4, cache_salt: str | None = None,
                **extra: Any) -> Any:
    body: dict[str, Any] = {"return_token_ids": True, "ignore_eos": True, **extra}
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    return _client(url).completions.create(model="default", prompt=ids, max_tokens=max_tokens, temperature=0.0,
                                           extra_body=body)


def _lookup(server: VllmServer, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}/kv/lookup", json=body, headers=AUTH, timeout=30)


def _wait_hit(server: VllmServer, body: dict[str, Any], expected: int, timeout: float = 60.0) -> dict[str, Any]:
    """Returns the lookup answer once it reports `expected` hit tokens (the stores landed)."""
    deadline = time.monotonic() + timeout
    while True:
        answer = _lookup(server, body).json()
        if answer["max_hit_tokens"] == expected:
            return dict(answer)
        assert time.monotonic() < deadline, f"{server.url} still answers {answer}, not {expected} hit tokens"
        time.sleep(0.2)


def _hits(servers: list[VllmServer]) -> list[float]:
    return [s.metrics().get(HIT, 0.0) for s in servers]


def _router_metrics(router: RouterProcess) -> dict[tuple[str, str], float]:
    text = httpx.get(router.url + "/metrics", timeout=10).text
    return {(s.name, s.labels.get("backend", "")): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _sent(router_metrics: dict[tuple[str, str], float], server: VllmServer) -> float:
    """Returns how many requests the router sent to `server`, by its metrics."""
    return router_metrics.get(("kvtier:router_requests_total", server.url), 0.0)


def _hash_order(servers: list[VllmServer], ids: list[int]) -> list[VllmServer]:
    """Returns `servers` in prefix-hash order for `ids`: where the router's last tie-break sends them."""
    view = view_request({"model": "default", "prompt": ids})
    ranked = asyncio.run(PrefixHash().rank(view, [Backend(s.url) for s in servers], {}))
    return [next(s for s in servers if s.url == b.url) for b in ranked.order]


def test_lookup_answers_what_the_connector_then_loads(backends: list[VllmServer], tokenizer: Any) -> None:
    cli, server = backends
    ids = _ids(tokenizer, "Direct lookup.", 2048)
    first = _lookup(server, {"model": "default", "prompt_token_ids": ids}).json()
    assert first == {"model": "default", "num_tokens": 2048, "engine_prefix_cache_tokens": 0, "tiers": {"0:cpu": 0},
                     "max_hit_tokens": 0, "num_requests_running": 0, "num_requests_waiting": 0}
    cold = _complete(server.url, ids)
    answer = _wait_hit(server, {"prompt_token_ids": ids}, 2047)  # never the last token
    assert answer["tiers"] == {"0:cpu": 2047}
    # whole chunks of 256: a shorter prompt holds the chunks it covers, a longer one all 8
    assert _lookup(server, {"prompt_token_ids": ids[:1000]}).json()["max_hit_tokens"] == 768
    assert _lookup(server, {"prompt_token_ids": [*ids, 5, 6, 7]}).json()["max_hit_tokens"] == 2048
    assert _lookup(cli, {"prompt_token_ids": ids}).json()["max_hit_tokens"] == 0  # the other cpu tier

    before = server.metrics().get(HIT, 0.0)
    assert _complete(server.url, ids) == cold
    assert server.metrics()[HIT] - before == answer["max_hit_tokens"]


def test_vllms_cache_salt_keys_the_connectors_chunks(backends: list[VllmServer], tokenizer: Any) -> None:
    """vLLM's own per-request `cache_salt` reaches the connector: a salted request's chunks are
    found only under its salt (by lookup and by a load), never without it or under another."""
    server = backends[1]
    ids = _ids(tokenizer, "Salted tenant document.", 1024)
    cold = _complete(server.url, ids, cache_salt="tenant-a")
    _wait_hit(server, {"prompt_token_ids": ids, "cache_salt": "tenant-a"}, 1023)
    assert _lookup(server, {"prompt_token_ids": ids}).json()["max_hit_tokens"] == 0
    assert _lookup(server, {"prompt_token_ids": ids, "cache_salt": "tenant-b"}).json()["max_hit_tokens"] == 0
    before = server.metrics().get(HIT, 0.0)
    assert _complete(server.url, ids, cache_salt="tenant-b") == cold  # computed: nothing of tenant-a's loads
    assert server.metrics().get(HIT, 0.0) == before
    assert _complete(server.url, ids, cache_salt="tenant-a") == cold  # tenant-a's repeat loads its chunks
    assert server.metrics()[HIT] - before == 1023


def test_text_and_chat_are_tokenized_as_vllm_serves_them(backends: list[VllmServer]) -> None:
    """The route's token count equals the request's `usage.prompt_tokens`, and once the request's
    chunks are stored every one but the last token is found: the same token ids."""
    server = backends[1]
    text = f"Text prompt.\n\n{long_text(8)}"
    done = _client(server.url).completions.create(model="default", prompt=text, max_tokens=2, temperature=0.0)
    assert done.usage is not None
    n = done.usage.prompt_tokens
    assert _wait_hit(server, {"prompt": text}, n - 1)["num_tokens"] == n

    messages: Any = [{"role": "system", "content": "Answer briefly."},
                     {"role": "user", "content": f"Chat prompt.\n\n{long_text(8)}"}]
    chat = _client(server.url).chat.completions.create(model="default", messages=messages, max_tokens=2,
                                                       temperature=0.0)
    assert chat.usage is not None
    n = chat.usage.prompt_tokens
    assert _wait_hit(server, {"model": "default", "messages": messages}, n - 1)["num_tokens"] == n
    # without the generation prompt the template renders fewer tokens: honoured as vLLM's /tokenize does
    bare = _lookup(server, {"messages": messages, "add_generation_prompt": False}).json()
    assert bare["num_tokens"] < n


def test_load_is_vllms_own(backends: list[VllmServer], tokenizer: Any) -> None:
    server = backends[1]
    ids = _ids(tokenizer, "Load.", 64)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(_complete, server.url, ids, 64)  # decodes for seconds: long enough to be seen
        seen = 0
        while not running.done() and not seen:
            seen = _lookup(server, {"prompt_token_ids": ids}).json()["num_requests_running"]
            time.sleep(0.05)
        running.result()
    assert seen == 1
    deadline = time.monotonic() + 30
    while (now := _lookup(server, {"prompt_token_ids": ids}).json())["num_requests_running"]:
        assert time.monotonic() < deadline, now
        time.sleep(0.2)


@pytest.mark.parametrize(("body", "status", "message"), [
    (b"{not json", 400, "not JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (b"{}", 400, "exactly one of prompt, prompt_token_ids or messages"),
    (b'{"prompt": "a", "prompt_token_ids": [1]}', 400, "exactly one of"),
    (b'{"prompt_token_ids": [1, -1]}', 400, "non-negative integers"),
    (b'{"prompt_token_ids": [1, 49152]}', 400, "past the vocabulary"),
    (b'{"prompt_token_ids": [' + b", ".join([b"1"] * 4097) + b"]}", 400, "max_model_len"),
    (b'{"messages": [{"rol": "user"}]}', 400, "vLLM could not tokenize the messages"),
    (b'{"model": "other", "prompt": "a"}', 404, "does not exist"),
])
def test_a_bad_body_is_refused_naming_the_problem(backends: list[VllmServer], body: bytes, status: int,
                                                  message: str) -> None:
    r = httpx.post(f"{backends[1].url}/kv/lookup", content=body, headers={"content-type": "application/json", **AUTH},
                   timeout=30)
    assert r.status_code == status and message in r.json()["error"]["message"], r.text


def test_other_routes_are_vllms(backends: list[VllmServer]) -> None:
    server = backends[1]
    assert httpx.get(f"{server.url}/kv/lookup", timeout=30).status_code == 405
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    assert httpx.post(f"{server.url}/tokenize", json={"prompt": "hi"}, timeout=30).json()["count"] >= 1
    assert httpx.post(f"{server.url}/kv/lookups", json={}, timeout=30).status_code == 404


def test_router_sends_each_prompt_to_the_backend_holding_it(backends: list[VllmServer], router: RouterProcess,
                                                            tokenizer: Any, prompt_2k: list[int]) -> None:
    # Each prompt is stored on the backend prefix-hash ranks last for it: only the lookups can
    # send it there.
    holder, other = reversed(_hash_order(backends, prompt_2k))
    cold = _complete(holder.url, prompt_2k)
    _wait_hit(holder, {"prompt_token_ids": prompt_2k}, 2047)
    second = _ids(tokenizer, "Notes 0.", 1024)
    for k in range(1, 100):  # the other prompt goes where prefix-hash would send the first
        if _hash_order(backends, second)[0] is holder:
            break
        second = _ids(tokenizer, f"Notes {k}.", 1024)
    _complete(other.url, second)
    _wait_hit(other, {"prompt_token_ids": second}, 1023)

    for ids, on, expected in ((prompt_2k, holder, 2047), (prompt_2k, holder, 2047), (prompt_2k, holder, 2047),
                              (second, other, 1023), (second, other, 1023)):
        hits, routed = _hits(backends), _router_metrics(router)
        tokens = _complete(router.url, ids)
        if ids is prompt_2k:
            assert tokens == cold
        loaded = [after - b for after, b in zip(_hits(backends), hits)]
        assert loaded == [expected if s is on else 0 for s in backends]
        now = _router_metrics(router)
        assert [_sent(now, s) - _sent(routed, s) for s in backends] == [1 if s is on else 0 for s in backends]
        hit_key = ("kvtier:router_routed_hit_tokens_total", on.url)
        assert now[hit_key] - routed.get(hit_key, 0) == expected


def test_a_prompt_first_sent_through_the_router_stays_where_it_went(backends: list[VllmServer],
                                                                   router: RouterProcess, tokenizer: Any) -> None:
    ids = _ids(tokenizer, "Routed first.", 512)
    routed = _router_metrics(router)
    cold = _complete(router.url, ids)
    now = _router_metrics(router)
    (on,) = [s for s in backends if _sent(now, s) > _sent(routed, s)]
    _wait_hit(on, {"prompt_token_ids": ids}, 511)
    for _ in range(2):
        hits = _hits(backends)
        assert _complete(router.url, ids) == cold
        assert [after - b for after, b in zip(_hits(backends), hits)] == [511 if s is on else 0 for s in backends]


def test_lookup_counts_vllms_own_prefix_cache_and_the_router_follows_it(
        backends: list[VllmServer], prefix_cached: VllmServer, tokenizer: Any) -> None:
    """A prompt run with the connector storing nothing is held only by vLLM's own prefix cache:
    /kv/lookup reports it (whole blocks, never the last token, only for the salt it ran with),
    the router sends the prompt there though prefix-hash ranks the other backend first, vLLM
    serves it from that cache, and once vLLM's cache is cleared the lookup reports nothing."""
    other = backends[0]
    ids = _ids(tokenizer, "Engine cache 0.", 1000)
    for k in range(1, 100):  # prefix-hash alone would send the prompt to the other backend
        if _hash_order([other, prefix_cached], ids)[0] is other:
            break
        ids = _ids(tokenizer, f"Engine cache {k}.", 1000)
    assert _engine_tokens(prefix_cached, ids) == 0
    first = _completion(prefix_cached.url, ids, kv_transfer_params=SKIP_SAVE)
    assert first.usage.prompt_tokens_details.cached_tokens == 0

    held = _lookup(prefix_cached, {"prompt_token_ids": ids}).json()
    engine = held["engine_prefix_cache_tokens"]
    assert 500 < engine < 1000 and held["tiers"] == {CPU: 0} and held["max_hit_tokens"] == engine  # 7 blocks of 128
    assert _engine_tokens(prefix_cached, ids[:engine + 1]) == engine  # whole blocks, the last token left
    assert _engine_tokens(prefix_cached, ids[:engine]) < engine
    assert _engine_tokens(prefix_cached, ids, cache_salt="t") == 0
    assert _lookup(other, {"prompt_token_ids": ids}).json()["max_hit_tokens"] == 0

    router = RouterProcess(f"--backend={other.url}", f"--backend={prefix_cached.url}", "--policy", "kv-aware",
                           "--lookup-timeout", "5", "--health-interval", "0.2")
    try:
        again = _completion(router.url, ids, kv_transfer_params=SKIP_SAVE)
        now = _router_metrics(router)
    finally:
        assert router.stop() == 0, router.log()[-3000:]
    assert (_sent(now, prefix_cached), _sent(now, other)) == (1, 0)
    assert now[("kvtier:router_routed_hit_tokens_total", prefix_cached.url)] == engine
    assert again.usage.prompt_tokens_details.cached_tokens == engine  # vLLM's own cache served it
    assert again.choices[0].token_ids == first.choices[0].token_ids

    assert _ok(_kv(prefix_cached, "/kv/clear", {"all": True}))["engine_reset"] is True
    assert _engine_tokens(prefix_cached, ids) == 0


def _engine_tokens(server: VllmServer, ids: list[int], **body: Any) -> int:
    return int(_lookup(server, {"prompt_token_ids": ids, **body}).json()["engine_prefix_cache_tokens"])


def _kv(server: VllmServer, route: str, body: dict[str, Any], key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.post(f"{server.url}{route}", json=body, headers=headers, timeout=120)


def _ok(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 200, r.text
    return dict(r.json())


def _holders(server: VllmServer, ids: list[int]) -> list[dict[str, Any]]:
    """Returns per chunk of `ids` the tiers holding it, with their figures (/kv/inspect)."""
    return [c["tiers"] for c in _ok(_kv(server, "/kv/inspect", {"prompt_token_ids": ids}))["chunks"]]


def test_the_cache_control_routes_refuse_without_the_key_and_name_bad_fields(backends: list[VllmServer]) -> None:
    server = backends[1]
    for route in ("/kv/inspect", "/kv/pin", "/kv/unpin", "/kv/clear"):
        assert _kv(server, route, {"prompt_token_ids": [1, 2]}, key=None).status_code == 401, route
    assert _kv(server, "/kv/clear", {"all": True}, key="wrong").status_code == 401
    assert httpx.get(f"{server.url}/kv/inspect", headers=AUTH, timeout=30).status_code == 405
    for route, body, status, message in (
            ("/kv/pin", {"prompt_token_ids": [1, 2], "ttl_s": -1}, 400, "ttl_s must be"),
            ("/kv/pin", {"prompt_token_ids": [1, 2], "tier": "redis"}, 400, "0:cpu"),
            ("/kv/pin", {"prompt_token_ids": [7, 8, 9]}, 409, "holds none of this prompt"),
            ("/kv/inspect", {"prompt_token_ids": [1, 49152]}, 400, "past the vocabulary"),
            ("/kv/clear", {}, 400, "exactly one of cache_salt, all (true), older_than_s or stored_model"),
            ("/kv/clear", {"all": True, "older_than_s": 5}, 400, "exactly one of"),
            ("/kv/clear", {"all": True, "model": "default"}, 400, "not model")):
        r = _kv(server, route, body)
        assert r.status_code == status and message in r.json()["error"]["message"], (route, body, r.text)


def test_inspect_pin_clear_unpin_on_vllm_serve(backends: list[VllmServer], tokenizer: Any) -> None:
    """kvtier serve's shapes, answered by the worker's tiers: a request's chunks are in the cpu
    tier; a pin keeps them through a clear of idle chunks that removes the rest; unpin releases
    them; `kvtier cache inspect` reads the same; a clear of everything empties the tier; prefetch
    with compute runs the prompt and stores it, drop removes it, a budget changes at run time."""
    server = backends[1]
    kept, dropped = _ids(tokenizer, "Pinned document.", 1024), _ids(tokenizer, "Idle document.", 512)
    for ids in (kept, dropped):
        _complete(server.url, ids)
        _wait_hit(server, {"prompt_token_ids": ids}, len(ids) - 1)

    seen = _ok(_kv(server, "/kv/inspect", {"model": "default", "prompt_token_ids": kept}))
    assert (seen["model"], seen["engine_prefix_cache_tokens"], seen["num_tokens"], seen["chunk_size"]) == (
        "default", 0, 1024, 256)
    assert [(c["start"], c["end"]) for c in seen["chunks"]] == [(0, 256), (256, 512), (512, 768), (768, 1024)]
    figures = [c["tiers"][CPU] for c in seen["chunks"]]
    assert all(set(c["tiers"]) == {CPU} for c in seen["chunks"])
    assert all(f["bytes"] > 0 and not f["pinned"] for f in figures)
    assert seen["tiers"][CPU]["can_pin"] and seen["tiers"][CPU]["pinned_entries"] == 0
    assert seen["tiers"][CPU]["by_tenant"] is None  # no salt asked: no tenant's usage shown

    pinned = _ok(_kv(server, "/kv/pin", {"prompt_token_ids": kept, "tier": "cpu"}))
    assert (pinned["tier"], pinned["chunks"], pinned["of_chunks"], pinned["tokens"]) == (CPU, 4, 4, 1024)
    assert pinned["new_bytes"] == pinned["pinned_bytes"] == sum(f["bytes"] for f in figures)
    assert all(t[CPU]["pinned"] and t[CPU]["pin_expires_in_s"] is None for t in _holders(server, kept))

    # every chunk was last used before this inspect's answer: older_than_s below its idle time takes them all
    idle = [t[CPU]["idle_s"] for t in _holders(server, dropped)] + [f["idle_s"] for f in figures]
    cleared = _ok(_kv(server, "/kv/clear", {"older_than_s": max(min(idle), 1e-3)}))
    assert cleared["cleared"] == "idle" and cleared["tiers"][CPU] > 0 and cleared["errors"] == {}, cleared
    assert all(set(t) == {CPU} for t in _holders(server, kept))  # pinned: kept
    assert _holders(server, dropped) == [{}, {}]
    assert _lookup(server, {"prompt_token_ids": dropped}).json()["max_hit_tokens"] == 0

    released = _ok(_kv(server, "/kv/unpin", {"prompt_token_ids": kept}))
    assert released["released"] == pinned["pinned_entries"] and released["pinned_entries"] == 0, released
    assert not any(t[CPU]["pinned"] for t in _holders(server, kept))

    cmd = [sys.executable, "-m", "kvtier", "cache", "inspect", "--url", server.url, "--api-key", KEY,
           "--token-ids", ",".join(map(str, kept))]
    r = process.run(cmd, capture_output=True, text=True, timeout=120, env=repo_env())
    assert r.returncode == 0, r.stderr
    assert [set(c["tiers"]) for c in json.loads(r.stdout)["chunks"]] == [{CPU}] * 4

    tenant = _ok(_kv(server, "/kv/clear", {"cache_salt": "tenant-a"}))
    assert tenant["cleared"] == "tenant" and tenant["engine_blocks"] is None and tenant["errors"] == {}, tenant
    everything = _ok(_kv(server, "/kv/clear", {"all": True}))
    assert everything["cleared"] == "all" and everything["engine_reset"] is True, everything
    assert everything["tiers"][CPU] >= pinned["pinned_entries"]
    after = _ok(_kv(server, "/kv/inspect", {"prompt_token_ids": kept}))
    assert after["tiers"][CPU]["entries"] == 0 and all(c["tiers"] == {} for c in after["chunks"])

    # prefetch with compute runs the prompt through vLLM, whose worker stores it; drop removes it
    warmed = _ok(_kv(server, "/kv/prefetch", {"prompt_token_ids": kept, "tier": "cpu", "compute": True}))
    assert warmed["ran_request"]["prompt_tokens"] == 1024 and warmed["held_tokens"] == 1024, warmed
    assert all(set(t) == {CPU} for t in _holders(server, kept))
    gone = _ok(_kv(server, "/kv/drop", {"prompt_token_ids": kept, "tier": "cpu"}))
    assert gone["tier"] == CPU and gone["removed"] > 0 and gone["removed"] % 4 == 0, gone  # values: per KV head
    assert _holders(server, kept) == [{}] * 4
    # a budget changed at run time, answered with the tier's figures, then put back
    for size, expected in (("512MiB", 512 << 20), ("1GiB", 1 << 30)):
        budget = _ok(_kv(server, "/kv/budget", {"tier": "cpu", "budget": size}))
        assert budget["tier"] == CPU and budget["byte_budget"] == expected, budget
