"""The soak's servers (benchmarks/soak.py): `kvtier serve`, or `vllm serve` (vLLM's CPU build
from .venv-vllm, started as `kvtier-vllm serve`) with KVTierConnector, over the same tiers;
each also started without a connector as the reference for the answers. `figures()` maps a
server's /metrics samples onto the names the soak records (kvtier serve's), so one report reads
both.

vLLM's /metrics has no counterpart for some of kvtier serve's figures (`UNAVAILABLE_VLLM`):
the connector's pins, loads in flight, pending stores and slow-tier writes live in the worker
process, the tiers' breaker state in its storage manager, and vLLM reports block use only as
`vllm:kv_cache_usage_perc` (a fraction, its blocks with a ref count above 0) and no ref sum.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import psutil

from benchmarks.bench_serving_vs_vllm import VLLM_VENV, vllm_serve
from harness.serve import ServeProcess

# kvtier serve: a small engine prefix cache (--num-gpu-blocks of 16 tokens) so the tiers are used
KVTIER_ARGS = ["--device", "cpu", "--dtype", "float32", "--max-num-seqs", "8"]
# vllm serve: the same model and precision; vLLM's own prefix cache off (as tests/vllm run it),
# so every reuse is the connector's, from the tiers
VLLM_ARGS = ["--max-num-seqs", "8", "--max-model-len", "4096", "--no-enable-prefix-caching"]  # + vllm_serve's
VLLM_CHUNK_SIZE = 256  # the connector's chunk on vLLM, as tests/vllm use it
KEPT = {"kvtier:prompt_tokens_total", "kvtier:prefix_cache_hits_total", "kvtier:num_requests_running",
        "kvtier:num_requests_waiting"}  # of kvtier serve's /metrics, besides kvtier:kv_* (no histograms)
# vLLM's name -> the soak's (kvtier serve's) name for the same figure
VLLM_NAMES = {"vllm:prompt_tokens_total": "kvtier:prompt_tokens_total",
              "vllm:prefix_cache_hits_total": "kvtier:prefix_cache_hits_total",
              "vllm:num_requests_running": "kvtier:num_requests_running",
              "vllm:num_requests_waiting": "kvtier:num_requests_waiting",
              "vllm:kv_cache_usage_perc": "kvtier:kv_blocks_in_use"}
# kvtier's own figures on vllm serve: the metric table's names (connector/metric_table.py), kept as they are
SHARED = ("kvtier:kv_load_error_tokens_total", "kvtier:kv_dropped_store_bytes_total", "kvtier:kv_stored_tokens_total",
          "kvtier:kv_connector_hit_tokens_total", "kvtier:kv_tier_hit_tokens_total")
UNAVAILABLE_VLLM = ["kv_block_refs", "kv_load_holds", "kv_loads_in_flight", "kv_pending_stores",
                    "kv_slow_tier_writes_pending", "kv_tier_breaker_state", "kv_tier_timeouts_total",
                    "kv_tier_breaker_opens_total", "kv_tier_dropped_writes_total"]


class Server(Protocol):
    url: str

    def rss(self) -> int: ...

    def stop(self) -> None: ...

    def log(self) -> str: ...


def tree_rss(pid: int) -> int:
    """Returns the RSS in bytes of process `pid` and its descendants (0 if it is gone)."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


class KvtierServer:
    """`kvtier serve` with `tiers` as its --kv-tier list (none: no connector) and `blocks` KV
    blocks."""

    def __init__(self, model: str, tiers: list[str], chunk_size: int, blocks: int) -> None:
        args = ["--num-gpu-blocks", str(blocks), *(a for t in tiers for a in ("--kv-tier", t))]
        if tiers:
            args += ["--chunk-size", str(chunk_size)]
        self.proc = ServeProcess("--model", model, *KVTIER_ARGS, *args)
        self.url = self.proc.url

    def rss(self) -> int:
        return tree_rss(self.proc.proc.pid)

    def stop(self) -> None:
        self.proc.stop()

    def log(self) -> str:
        return self.proc.log()


class VllmServer:
    """`kvtier-vllm serve` from .venv-vllm (bench_serving_vs_vllm's vllm_serve) with
    KVTierConnector over `tiers` (none: no connector: the reference); its log in `log`."""

    def __init__(self, model: str, tiers: list[str], log: Path) -> None:
        if not (VLLM_VENV / "bin" / "kvtier-vllm").exists():
            raise FileNotFoundError(f"--engine vllm needs vLLM's environment in {VLLM_VENV} (make vllm-install)")
        extra = {"tiers": tiers, "chunk_size": VLLM_CHUNK_SIZE} if tiers else None
        self.serve = vllm_serve(Path(model), log, extra, VLLM_ARGS)
        self.url = self.serve.url

    def rss(self) -> int:
        return tree_rss(self.serve.proc.pid)  # the API server and its EngineCore child

    def stop(self) -> None:
        self.serve.close()

    def log(self) -> str:
        return self.serve.child.log()


def start_server(engine: str, model: str, tiers: list[str], chunk_size: int, work: Path,
                 kvtier_blocks: int = 512) -> Server:
    """Returns a started server of `engine` ("kvtier" or "vllm") over `tiers` (none: no
    connector); `chunk_size` and `kvtier_blocks` (KV blocks) are kvtier serve's (vllm serve:
    VLLM_CHUNK_SIZE, and no prefix cache of its own)."""
    if engine == "kvtier":
        return KvtierServer(model, tiers, chunk_size, kvtier_blocks)
    if engine == "vllm":
        return VllmServer(model, tiers, work / f"vllm-{'tiers' if tiers else 'reference'}.log")
    raise ValueError(f"engine must be 'kvtier' or 'vllm', not {engine!r}")


def figures(engine: str, metrics: dict[str, float]) -> dict[str, float]:
    """Returns the samples the soak keeps of one /metrics scrape, under kvtier serve's names."""
    if engine == "kvtier":
        return {k: v for k, v in metrics.items() if k.startswith("kvtier:kv_") or k in KEPT}
    # counters vLLM shows only once incremented: absent means 0 (never a gauge: absent is unknown)
    out: dict[str, float] = {"kvtier:kv_dropped_store_bytes_total": 0.0, "kvtier:kv_load_error_tokens_total": 0.0}
    for k, v in metrics.items():
        if k in VLLM_NAMES:
            out[VLLM_NAMES[k]] = v
        elif k.startswith(SHARED):
            out[k] = v
    return out


def unavailable(engine: str) -> list[str]:
    """Returns the figures (kvtier serve's names, without `kvtier:`) this engine does not expose."""
    return UNAVAILABLE_VLLM if engine == "vllm" else []
