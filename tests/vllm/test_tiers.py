"""A repeated 2k-token prompt (257 tokens in the 16-bit cases) is loaded from each tier of one process
by a real vLLM (prefix caching off), with the tokens of the cold run, its K/V in float16,
bfloat16, float32 and fp8 (in the page layout of the kernels vLLM picks on this CPU: "vec"
everywhere, "amx" for bfloat16 on a CPU with AMX tiles), decoded or moved as tiles; and vLLM's own
prefix cache together with the connector: the engine's hit and the connector's are never
double-counted."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import vllm
from packaging.version import Version

from connector.connector_metrics import PROM_COUNTERS
from harness.vllm import VllmLLM, close_together, start_together
from tests.fixtures.vllm import needs_fp8_kv

# The vLLM each case starts: (its tier, more connector config, more VllmLLM keywords; the
# model's dtype, float32 unless given, is its K/V's; a 16-bit case runs a 257-token prompt,
# two chunks of 128 and a token, as 16-bit math is slow on CPUs without native support). Background loads from
# each tier of this process; layer-by-layer loads in the request's first step (vLLM's
# synchronous path, its forward waiting per layer) from one. The shared tiers (Redis, the cache server) are loaded
# from by a fresh process in test_serve.py.
CASES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "cpu": ("cpu", {}, {}),
    "disk": ("disk", {"reset_clears_shared_tiers": True, "chunk_size": 128}, {"dtype": "bfloat16"}),
    "disk-layerwise": ("disk", {"use_layerwise": True, "chunk_size": 128}, {"dtype": "float16"}),
    "cpu-prefix-caching": ("cpu", {}, {"prefix_caching": True}),
    # fp8 K/V (vLLM's kv_cache_dtype "fp8", e4m3) of a bfloat16 model: bytes in the "vec" pages
    # (under vLLM's "amx" kernels, a CPU with AMX tiles, in their own format, moved as tiles)
    "cpu-fp8": ("cpu", {}, {"dtype": "bfloat16", "llm": {"kv_cache_dtype": "fp8"}}),
    # the pages moved as whole (block, KV head) tiles, never decoded: the path of any kernels'
    # pages kvtier does not decode, run here over the "vec" pages every x86 CPU has
    "cpu-tiles": ("cpu", {"cpu_page_form": "tiles"}, {}),
}


class TierLLMs:
    """One vLLM per case, each with its own tier and nothing else. A case's vLLM starts
    together with the next selected case's (`start_together`) and serves only its own test;
    the used ones are closed together, before the next start (or at the end)."""

    def __init__(self, model: Path, selected: list[str], tmp: pytest.TempPathFactory) -> None:
        self.model, self.selected, self.tmp = model, selected, tmp
        self.ready: dict[str, VllmLLM] = {}  # started, its test not run yet
        self.used: list[VllmLLM] = []

    def _starter(self, case: str) -> Callable[[], VllmLLM]:
        tier, extra, spec = CASES[case]
        log = self.tmp.mktemp(f"vllm-{case}") / "vllm.log"
        url = f"disk://{log.parent / 'kv'}" if tier == "disk" else tier
        config = {"tiers": [url], "chunk_size": 256, **extra}
        return lambda: VllmLLM(self.model, config, log, **spec)

    @contextmanager
    def use(self, case: str) -> Iterator[VllmLLM]:
        """Yields the case's vLLM (started with the next case's if not started yet) for one test."""
        if case not in self.ready:
            close_together(*self.used)
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
        close_together(*self.used, *self.ready.values())


@pytest.fixture(scope="module")
def tier_llms(request: pytest.FixtureRequest, default_model_path: Path,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[TierLLMs]:
    selected = [item.callspec.params["case"] for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec")
                and not any(m.args and m.args[0] for m in item.iter_markers("skipif"))]  # a skipped case starts none
    llms = TierLLMs(default_model_path, selected, tmp_path_factory)
    yield llms
    llms.close()


@pytest.mark.parametrize("case", ["cpu", "disk", "disk-layerwise", pytest.param("cpu-fp8", marks=needs_fp8_kv()),
                                  "cpu-tiles"])
def test_the_second_run_loads_the_prompt_from_the_tier(case: str, tier_llms: TierLLMs, prompt_2k: list[int]) -> None:
    tier, extra, spec = CASES[case]
    # 257 tokens: whole blocks of 128 (vLLM's CPU default) and the last token, which is always
    # computed; pages moved as tiles (fp8 under the amx kernels) load whole blocks only.
    prompt = prompt_2k[:257] if "dtype" in spec else prompt_2k
    with tier_llms.use(case) as llm:
        if tier == "cpu":  # a request that asks not to be stored leaves nothing to load (the cold
            # run's first two chunks below included)
            skipped = llm.generate([prompt[:512]], max_tokens=1, kv_transfer_params={"kvtier.skip_save": True})
            assert skipped["metrics"].get("kvtier:kv_stored_tokens_total", 0) == 0
        cold = llm.generate([prompt])
        warm = llm.generate([prompt])
        if extra.get("cpu_page_form") == "tiles":  # the worker said which layout moves its pages
            assert "VllmTileLayout" in llm.child.log() and ".vec-tiles-b" in llm.child.log(), llm.tail()
            # stored: the prompt's whole blocks (vLLM's CPU default: 128 tokens); loaded: all of
            # them but the last token, the last block's tile moved whole
            assert warm["outputs"][0]["cached"] == min(len(prompt) // 128 * 128, len(prompt) - 1), llm.tail()
        # vLLM's reset_prefix_cache(reset_connector=True) empties the cpu tier, and a shared tier
        # when the configuration says so (the first chunk and a token: no hit)
        if tier == "cpu" or extra.get("reset_clears_shared_tiers"):
            assert llm.command(op="reset_prefix_cache", connector=True)["ok"]
            chunk = extra.get("chunk_size", 256)
            assert llm.generate([prompt[:chunk + 1]], max_tokens=1)["outputs"][0]["cached"] == 0
    assert cold["outputs"][0]["cached"] == 0
    assert warm["outputs"][0]["tokens"] == cold["outputs"][0]["tokens"]
    assert warm["outputs"][0]["cached"] >= 0.9 * len(prompt), llm.tail()
    loaded = warm["metrics"].get("kvtier:kv_connector_hit_tokens_total", 0) - cold["metrics"].get(
        "kvtier:kv_connector_hit_tokens_total", 0)
    assert loaded == warm["outputs"][0]["cached"]
    # the metric table's names and meanings (connector/metric_table.py), as on kvtier serve: the
    # per-tier count is the prompt tokens loaded from the tier; the names used before are gone
    m = warm["metrics"]
    by_tier = "kvtier:kv_tier_hit_tokens_total"
    assert m.get(by_tier, 0) - cold["metrics"].get(by_tier, 0) == loaded
    assert not [k for k in m if k.removeprefix("kvtier:").removesuffix("_total") in PROM_COUNTERS]
    if Version(vllm.__version__).release < (0, 32):
        return  # vLLM counts hits per source from 0.32 on
    # vLLM's own per-source hit counter names the tier: host memory or disk
    source = {"cpu": "host", "disk": "disk"}[tier]
    by_source = f"vllm:prompt_tokens_cached_by_source.{source}"
    assert warm["metrics"][by_source] - cold["metrics"].get(by_source, 0) == loaded


@pytest.mark.parametrize("case", ["cpu-prefix-caching"])
def test_engine_hit_plus_connector_hit(case: str, tier_llms: TierLLMs, prompt_2k: list[int]) -> None:
    """`num_cached_tokens` is vLLM's own hit plus the connector's."""
    with tier_llms.use(case) as llm:
        cold = llm.generate([prompt_2k])
        assert llm.command(op="reset_prefix_cache")["ok"]
        half = llm.generate([prompt_2k[:1024]])  # the connector loads it; vLLM caches its blocks
        warm = llm.generate([prompt_2k])  # vLLM's hit for the first half, the connector's after it
    assert half["outputs"][0]["cached"] == 1023
    m0, m1 = half["metrics"], warm["metrics"]
    engine_hit = m1["vllm:prefix_cache_hits"] - m0["vllm:prefix_cache_hits"]
    external = m1["vllm:external_prefix_cache_hits"] - m0["vllm:external_prefix_cache_hits"]
    loaded = m1["kvtier:kv_connector_hit_tokens_total"] - m0["kvtier:kv_connector_hit_tokens_total"]
    assert engine_hit >= 768 and external > 0
    assert loaded == external  # the connector loaded only what vLLM's cache did not hold
    assert warm["outputs"][0]["cached"] == engine_hit + external == 2047
    assert warm["outputs"][0]["tokens"] == cold["outputs"][0]["tokens"]
