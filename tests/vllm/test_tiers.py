"""A repeated 2k-token prompt is loaded from each tier by a real vLLM (prefix caching off),
with the tokens of the cold run."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import vllm
from packaging.version import Version

from tests.fixtures.cache_server import CacheServerProcess
from tests.fixtures.redis_server import RedisServer
from tests.fixtures.vllm import VllmLLM, start_together

# (tier, use_layerwise): background loads from every tier; layer-by-layer loads in the
# request's first step (vLLM's synchronous path, its forward waiting per layer) from one.
CASES = [("cpu", False), ("disk", False), ("redis", False), ("kvtier", False), ("disk", True)]
Case = tuple[str, bool]


class TierLLMs:
    """One vLLM per case, each with its own tier and nothing else. A case's vLLM starts
    together with the next selected case's (`start_together`) and serves only its own test;
    the used ones are closed together, before the next start (or at the end)."""

    def __init__(self, model: Path, selected: list[Case], tmp: pytest.TempPathFactory, redis: RedisServer) -> None:
        self.model, self.selected, self.tmp, self.redis = model, selected, tmp, redis
        self.ready: dict[Case, VllmLLM] = {}  # started, its test not run yet
        self.used: list[VllmLLM] = []
        self.cache_servers: list[CacheServerProcess] = []

    def _url(self, tier: str) -> str:
        if tier == "disk":
            return f"disk://{self.tmp.mktemp('disk') / 'kv'}"
        if tier == "redis":  # emptied again by its test, as the `redis_server` fixture does
            if not self.redis.alive():
                self.redis.restart()
            return self.redis.url
        if tier == "kvtier":  # a fresh one per case, as the `cache_server` fixture gives
            self.cache_servers.append(CacheServerProcess("--max-bytes", "256MiB"))
            return self.cache_servers[-1].url
        return tier

    def _starter(self, case: Case) -> Callable[[], VllmLLM]:
        tier, layerwise = case
        config = {"tiers": [self._url(tier)], "chunk_size": 256, "use_layerwise": layerwise}
        log = self.tmp.mktemp(f"vllm-{tier}-{'layerwise' if layerwise else 'background'}") / "vllm.log"
        return lambda: VllmLLM(self.model, config, log)

    def _close(self, llms: list[VllmLLM]) -> None:
        """Closes `llms` side by side (each waits seconds for vLLM's shutdown)."""
        with concurrent.futures.ThreadPoolExecutor(max(1, len(llms))) as pool:
            list(pool.map(VllmLLM.close, llms))

    @contextmanager
    def use(self, case: Case) -> Iterator[VllmLLM]:
        """Yields the case's vLLM (started with the next case's if not started yet) for one test."""
        if case not in self.ready:
            self._close(self.used)
            self.used = []
            later = self.selected[self.selected.index(case) + 1:] if case in self.selected else []
            pair = [case, *later[:1]]
            self.ready.update(zip(pair, start_together(*[self._starter(c) for c in pair])))
        llm = self.ready.pop(case)
        try:
            yield llm
        finally:
            self.used.append(llm)

    def close(self) -> None:
        self._close([*self.used, *self.ready.values()])
        for server in self.cache_servers:
            server.kill()


@pytest.fixture(scope="module")
def tier_llms(request: pytest.FixtureRequest, default_model_path: Path, tmp_path_factory: pytest.TempPathFactory,
              redis_server_session: RedisServer) -> Iterator[TierLLMs]:
    selected = [tuple(item.callspec.params[k] for k in ("tier", "layerwise")) for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec")]
    llms = TierLLMs(default_model_path, [c for c in CASES if c in selected], tmp_path_factory, redis_server_session)
    yield llms
    llms.close()


@pytest.mark.parametrize(("tier", "layerwise"), CASES)
def test_the_second_run_loads_the_prompt_from_the_tier(tier: str, layerwise: bool, tier_llms: TierLLMs,
                                                       request: pytest.FixtureRequest, prompt_2k: list[int]) -> None:
    if tier == "redis":
        request.getfixturevalue("redis_server")  # the session's Redis, emptied: nothing of other tests
    with tier_llms.use((tier, layerwise)) as llm:
        if tier == "cpu":  # a request that asks not to be stored leaves nothing to load
            skipped = llm.generate([prompt_2k], kv_transfer_params={"kvtier.skip_save": True})
            assert skipped["metrics"].get("kvtier:stored_tokens_total", 0) == 0
        cold = llm.generate([prompt_2k])
        warm = llm.generate([prompt_2k])
        if tier == "cpu":  # vLLM's reset_prefix_cache(reset_connector=True) empties the cpu tier
            assert llm.command(op="reset_prefix_cache", connector=True)["ok"]
            assert llm.generate([prompt_2k], max_tokens=1)["outputs"][0]["cached"] == 0
    assert cold["outputs"][0]["cached"] == 0
    assert warm["outputs"][0]["tokens"] == cold["outputs"][0]["tokens"]
    assert warm["outputs"][0]["cached"] >= 0.9 * len(prompt_2k), llm.tail()
    loaded = warm["metrics"].get("kvtier:connector_hit_tokens_total", 0) - cold["metrics"].get(
        "kvtier:connector_hit_tokens_total", 0)
    assert loaded == warm["outputs"][0]["cached"]
    if Version(vllm.__version__).release < (0, 32):
        return  # vLLM counts hits per source from 0.32 on
    # vLLM's own per-source hit counter names the tier: host memory, disk, else unspecified
    source = {"cpu": "host", "disk": "disk"}.get(tier, "external_unspecified")
    by_source = f"vllm:prompt_tokens_cached_by_source.{source}"
    assert warm["metrics"][by_source] - cold["metrics"].get(by_source, 0) == loaded
