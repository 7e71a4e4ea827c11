"""`kvtier router` end to end: two real `kvtier serve` processes sharing a real cache server
behind a real router on loopback, the official `openai` client; a producer/consumer pair
behind a disaggregated router; answers compared with a single server's (greedy, identical)."""

from __future__ import annotations

import concurrent.futures
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness.cache_server import CacheServerProcess
from harness.polling import wait_until
from harness.redis import free_port
from harness.serve import RouterProcess, ServeProcess
from harness.text import long_text
from kvstore.backends.server_client import CacheServerClient

pytestmark = pytest.mark.slow
ENGINE = ["--device", "cpu", "--dtype", "float32", "--num-gpu-blocks", "384", "--max-num-seqs", "8"]
ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # two engines on two cores
KILLED_TOKENS = 96  # the killed request's length: decode steps enough to be killed while it runs
NAME = "SmolLM2-135M-Instruct"


def _prompt(tag: str) -> str:
    return f"Notes {tag}.\n\n{long_text(12)}\n\nIn one sentence, what do notes {tag} describe?"


def _complete(url: str, prompt: str, max_tokens: int = 12, stream: bool = False,
              ignore_eos: bool = False) -> tuple[str, int]:
    """Returns (text, cached_tokens) of a greedy completion through the official client."""
    c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    extra = {"ignore_eos": True} if ignore_eos else None
    if stream:
        chunks = c.completions.create(model=NAME, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
                                      stream_options={"include_usage": True}, extra_body=extra)
        text, cached = "", -1
        for ch in chunks:
            text += "".join(choice.text for choice in ch.choices)
            if ch.usage is not None:
                details = ch.usage.prompt_tokens_details
                cached = details.cached_tokens if details is not None and details.cached_tokens is not None else 0
        return text, cached
    r = c.completions.create(model=NAME, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body=extra)
    details = r.usage.prompt_tokens_details if r.usage is not None else None
    return r.choices[0].text, (details.cached_tokens or 0) if details is not None else 0


def _metrics(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _routed(url: str, backend: str) -> float:
    return _metrics(url).get(("kvtier:router_requests_total", (("backend", backend), ("role", "any"))), 0.0)


@pytest.fixture(scope="module")
def cluster(default_model_path: Path) -> Iterator[tuple[CacheServerProcess, list[ServeProcess], RouterProcess]]:
    """A cache server, two serve instances sharing it, and a kv-aware router over them."""
    cache = CacheServerProcess("--max-bytes", "1GiB")
    args = ["--model", str(default_model_path), *ENGINE, "--kv-tier", cache.url]
    servers = [ServeProcess(*args, env=ONE_THREAD, wait=False) for _ in range(2)]
    for s in servers:
        s.wait_ready()
    router = RouterProcess(*[f"--backend={s.url}" for s in servers], "--policy", "kv-aware",
                           "--health-interval", "0.2")
    yield cache, servers, router
    assert router.stop() == 0, router.log()[-3000:]
    for s in servers:
        s.stop()
    cache.stop()


def test_kv_aware_sends_a_prompt_to_the_instance_holding_it(cluster) -> None:
    _, servers, router = cluster
    prompts = {s.url: [_prompt(f"{i}-{j}") for j in range(2)] for i, s in enumerate(servers)}
    answers = {}
    for url, ps in prompts.items():  # each instance prefills its own two prompts, directly
        for p in ps:
            answers[p] = _complete(url, p)[0]
    for url, ps in prompts.items():
        for p in ps:
            before = {s.url: _routed(router.url, s.url) for s in servers}
            text, cached = _complete(router.url, p)
            after = {s.url: _routed(router.url, s.url) for s in servers}
            assert {u: after[u] - before[u] for u in after} == {u: float(u == url) for u in after}, p[:20]
            assert text == answers[p]
            assert cached >= 200  # the holder's own prefix cache answered it


def test_streams_through_the_router_equal_the_backend_answer(cluster) -> None:
    _, servers, router = cluster
    p = _prompt("stream")
    direct = _complete(servers[0].url, p)[0]
    text, cached = _complete(router.url, p, stream=True)
    assert text == direct and cached > 0
    m = _metrics(router.url)
    assert m[("kvtier:router_lookup_seconds_count", ())] >= 1
    assert all(m[("kvtier:router_backend_healthy", (("backend", s.url),))] == 1.0 for s in servers)


def test_round_robin_and_prefix_hash_routers_serve_the_same_answers(cluster) -> None:
    _, servers, _ = cluster
    p = _prompt("policies")
    want = _complete(servers[1].url, p)[0]
    for policy in ("round-robin", "prefix-hash"):
        r = RouterProcess(*[f"--backend={s.url}" for s in servers], "--policy", policy)
        try:
            got = [_complete(r.url, p)[0] for _ in range(2)]
            counts = [_routed(r.url, s.url) for s in servers]
        finally:
            assert r.stop() == 0
        assert got == [want, want]
        # round-robin alternates; prefix-hash keeps one prompt on one backend
        assert sorted(counts) == ([1.0, 1.0] if policy == "round-robin" else [0.0, 2.0])


def _healthy(router: RouterProcess, backend: ServeProcess) -> float:
    return _metrics(router.url)[("kvtier:router_backend_healthy", (("backend", backend.url),))]


def _wait_health(router: RouterProcess, backend: ServeProcess, want: float) -> None:
    healthy = wait_until(lambda: _healthy(router, backend) == want, 20.0, 0.1)
    assert healthy, f"{backend.url} never became healthy={want}"


def test_a_frozen_backend_is_skipped_and_used_again_once_it_answers(cluster) -> None:
    _, servers, router = cluster
    frozen = servers[1]
    frozen.proc.send_signal(signal.SIGSTOP)
    try:
        _wait_health(router, frozen, 0.0)  # its health check timed out
        before = _routed(router.url, frozen.url)
        for i in range(3):
            _complete(router.url, _prompt(f"frozen-{i}"), max_tokens=2)
        assert _routed(router.url, frozen.url) == before
    finally:
        frozen.proc.send_signal(signal.SIGCONT)
    _wait_health(router, frozen, 1.0)  # back in rotation after one passing check
    assert httpx.get(router.url + "/health", timeout=10).status_code == 200


def test_kv_aware_past_the_balance_threshold_routes_by_load(cluster) -> None:
    _, servers, router = cluster
    busy, idle = servers
    held = _prompt("balance")
    _complete(busy.url, held, max_tokens=1)  # only `busy` holds it in its own prefix cache
    strict = RouterProcess(*[f"--backend={s.url}" for s in servers], "--balance-threshold", "0", "--log-level=debug")
    long_body = {"prompt": "Count to a million:", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    try:
        with httpx.Client(base_url=busy.url, timeout=60) as c, c.stream("POST", "/v1/completions", json=long_body) as r:
            lines = r.iter_lines()  # kept: a collected line iterator closes the response
            next(lines)  # a first token: `busy` is running it
            look = httpx.post(busy.url + "/kv/lookup", json={"prompt": held}, timeout=10).json()
            assert look["num_requests_running"] == 1
            # Default threshold (16): the hit wins over a load of 1. Threshold 0: the load wins
            # (in this order: once `idle` has served it, both hold it).
            for url, want in ((router.url, busy.url), (strict.url, idle.url)):
                before = _routed(url, want)
                _complete(url, held, max_tokens=1)
                assert _routed(url, want) == before + 1, [x for x in strict.log().splitlines() if "ranking" in x]
    finally:
        assert strict.stop() == 0


def _aborts(url: str) -> float:
    key = ("kvtier:request_success_total", (("finished_reason", "abort"), ("model_name", NAME)))
    return _metrics(url).get(key, 0.0)


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_hanging_up_aborts_the_request_on_its_backend(cluster, stream: bool) -> None:
    _, servers, router = cluster
    before = sum(_aborts(s.url) for s in servers)
    body = {"prompt": _prompt(f"hangup-{stream}"), "max_tokens": 2000, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    with httpx.Client(base_url=router.url, timeout=60) as c:
        if stream:
            with c.stream("POST", "/v1/completions", json=body) as r:
                for n, _ in enumerate(r.iter_lines()):
                    if n >= 4:
                        break  # leaving the block closes the connection mid-stream
        else:
            with pytest.raises(httpx.ReadTimeout):
                c.post("/v1/completions", json=body, timeout=httpx.Timeout(60, read=3.0))
    wait_until(lambda: sum(_aborts(s.url) for s in servers) > before, 30.0, 0.1)
    assert sum(_aborts(s.url) for s in servers) == before + 1
    running = [_metrics(s.url)[("kvtier:num_requests_running", (("model_name", NAME),))] for s in servers]
    assert running == [0.0, 0.0]


def test_a_backend_killed_mid_request_is_routed_around(cluster) -> None:
    """Runs last of the cluster tests: it kills one instance."""
    _, servers, router = cluster
    alive, victim = servers
    held = _prompt("victim")
    # Only the victim holds it in its own prefix cache, so kv-aware sends it there.
    want = _complete(victim.url, held, max_tokens=KILLED_TOKENS, ignore_eos=True)[0]
    before = _routed(router.url, victim.url)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(_complete, router.url, held, KILLED_TOKENS, False, True)
        wait_until(lambda: pending.done() or _metrics(victim.url).get(  # until the victim runs it
            ("kvtier:num_requests_running", (("model_name", NAME),)), 0.0) >= 1, 60.0, 0.1)
        assert not pending.done(), "the request finished before the victim could be killed"
        victim.stop(signal.SIGKILL)
        assert pending.result(timeout=300)[0] == want  # retried whole on the live instance
    assert _routed(router.url, victim.url) - before == 1  # the one try it died in; never again
    for i in range(3):  # each succeeds (a failure raises), none goes to the dead instance
        _complete(router.url, held if i == 0 else _prompt(f"after-{i}"))
    m = _metrics(router.url)
    assert m[("kvtier:router_backend_healthy", (("backend", victim.url),))] == 0.0
    assert _routed(router.url, victim.url) - before == 1  # the health checks keep failing: still out
    assert m[("kvtier:router_backend_errors_total", (("backend", victim.url), ("kind", "connect")))] >= 1
    assert httpx.get(router.url + "/health", timeout=10).status_code == 200


@pytest.fixture(scope="module")
def disaggregated(default_model_path: Path, cluster) -> Iterator[tuple[ServeProcess, ServeProcess, RouterProcess]]:
    cache, _, _ = cluster
    base = ["--model", str(default_model_path), *ENGINE, "--kv-tier", cache.url]
    producer = ServeProcess(*base, "--kv-role", "producer", env=ONE_THREAD, wait=False)
    consumer = ServeProcess(*base, "--kv-role", "consumer", env=ONE_THREAD, wait=False)
    producer.wait_ready()
    consumer.wait_ready()
    router = RouterProcess("--prefill", producer.url, "--decode", consumer.url)
    yield producer, consumer, router
    assert router.stop() == 0, router.log()[-3000:]
    producer.stop()
    consumer.stop()


def test_disaggregated_answers_equal_a_single_server(cluster, disaggregated) -> None:
    _, servers, _ = cluster
    producer, consumer, router = disaggregated
    for i, stream in enumerate((False, True)):
        p = _prompt(f"pd-{i}")
        want = _complete(servers[0].url, p, max_tokens=24)[0]
        text, cached = _complete(router.url, p, max_tokens=24, stream=stream)
        assert text == want
        assert cached >= 200  # the consumer loaded the producer's K/V from the shared tier
    hit = _metrics(consumer.url)[("kvtier:kv_connector_hit_tokens_total", (("model_name", NAME),))]
    assert hit >= 400
    assert _metrics(router.url)[("kvtier:router_prefill_fallbacks_total", ())] == 0.0


def test_consumer_prefills_when_the_producers_store_is_missing(cluster, disaggregated) -> None:
    cache, servers, _ = cluster
    producer, consumer, _ = disaggregated
    p = _prompt("pd-missing")
    want = _complete(servers[0].url, p, max_tokens=24)[0]
    r = httpx.post(producer.url + "/v1/completions", json={"prompt": p, "max_tokens": 24, "temperature": 0},
                   timeout=300).json()
    assert r["usage"]["completion_tokens"] == 1  # a producer answers one token
    CacheServerClient("127.0.0.1", int(cache.url.rsplit(":", 1)[1])).clear()  # the K/V is lost in between
    text, cached = _complete(consumer.url, p, max_tokens=24)
    assert (text, cached) == (want, 0)


def test_a_dead_producer_falls_back_to_prefill_on_the_consumer(cluster, disaggregated) -> None:
    _, servers, _ = cluster
    _, consumer, _ = disaggregated
    router = RouterProcess("--prefill", f"http://127.0.0.1:{free_port()}", "--decode", consumer.url)
    try:
        p = _prompt("pd-dead")
        assert _complete(router.url, p, max_tokens=24)[0] == _complete(servers[0].url, p, max_tokens=24)[0]
        assert _metrics(router.url)[("kvtier:router_prefill_fallbacks_total", ())] == 1.0
    finally:
        assert router.stop() == 0
