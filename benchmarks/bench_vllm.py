"""kvtier's connector inside vLLM (CPU build), every figure a ratio within one run.

Each arm is a fresh vLLM `LLM` in a child process, with vLLM's prefix cache off (every reused
token comes through the connector) and the same prompts:
- none: no connector (cold TTFT without any store: the store-overhead baseline)
- kvtier cpu / disk / redis: warm over cold TTFT at 1k, 2k and 4k tokens
                                      (targets at 2k and 4k: cpu <= 0.12, redis <= 0.2)
- ExampleConnector: vLLM's in-tree connector that stores safetensors on disk; kvtier's
  disk tier's warm TTFT over its                                         (target <= 0.5)
- SimpleCPUOffloadConnector, LMCacheConnectorV1: what they do on this backend. lmcache
  pulls CUDA packages and other pins, so it lives apart: a venv over `.venv-vllm`
  (`python -m venv /tmp/lmc`, a `.pth` naming .venv-vllm's site-packages, then
  `/tmp/lmc/bin/pip install lmcache==0.5.6`), passed as `--lmcache-python /tmp/lmc/bin/python`
- store overhead: kvtier cpu's cold TTFT storing over not storing, in one process, requests
  interleaved (a request's `kv_transfer_params` {"kvtier.skip_save": true} stores nothing)
                                                                         (target <= 1.05)
  (kvtier cpu's cold TTFT over the "none" arm's is shown too: separate processes differ by up
  to 15% here between two runs of the same arm)
- kvtier cpu tp1 / tp2: one random model of SmolLM2's size with 8 query and 2 KV heads, at
  tensor_parallel_size 1 and 2 (one core per rank): warm over cold TTFT at 2k tokens (TP=2
  target <= 0.15), and load rate per token TP=2 over TP=1 (rank 0's load seconds and loaded
  tokens, vLLM's connector stats)                                       (target >= 0.8)
- kvtier cpu vs vLLM's hit: vLLM's prefix cache on, in one process, per prompt: its own
  prefix-cache hit, then (that cache reset) kvtier's cpu tier's, alternating; TTFT of the
  tier's hit over vLLM's own                                              (target <= 1.05)
- lookup: the scheduler side's lookup of an 8k-token prompt held in a cpu tier, over the
  lookup channel to one worker and to two ranks (this process: the planner, a `LookupServer`
  per rank, real sockets); its latency and round trips per rank, reported
- stall: p99 of the running decodes' step times while a stored 4k prompt loads (from its
  arrival until its load ended: the step that then computes it with them is reported apart,
  as `joined`), over the same decodes with no load                       (target <= 1.2)

    make bench-vllm     (= .venv-vllm/bin/python -m benchmarks.bench_vllm [--quick] [--reps N]
                         [--only ARM ...] [--lmcache-python PY] [--dtype bfloat16])

`--dtype bfloat16` runs the model in bfloat16 (vLLM's CPU attention then picks "amx" on a Xeon
with AMX tiles, named in the results) with the arms none, kvtier cpu (its pages decoded, no
stall row) and kvtier cpu tiles (`cpu_page_form: tiles`), into vllm_bfloat16.*.

Writes benchmarks/results/vllm.json and vllm.md. TTFT here is the wall time of a greedy
one-token `generate`; medians of `--reps` prompts. `--quick` checks that the script runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import process

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"


TP_MODEL = {"model_type": "llama", "hidden_size": 512, "intermediate_size": 1536, "num_attention_heads": 8,
            "num_key_value_heads": 2, "head_dim": 64, "num_hidden_layers": 30, "vocab_size": 49152,
            "max_position_embeddings": 8192}
"""The TP arms' model: SmolLM2-135M's layers, head size and vocabulary, with 8 query and 2 KV
heads (SmolLM2's 3 KV heads do not split over two ranks)."""


def token_ids(n: int, salt: int) -> list[int]:
    """Deterministic, varied token ids (no tokenizer round trip)."""
    return [(i * 7919 + salt * 104729 + 13) % 40000 + 100 for i in range(n)]


def attention_isa(dtype: str) -> str:
    """Returns the kernels vLLM's CPU attention picks here for the default model in `dtype` at
    its CPU default block size (128)."""
    import torch
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return str(_get_attn_isa(getattr(torch, dtype), 128, 64))


# ---- the child: one LLM, one arm ---------------------------------------------------------
def child(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm.config import KVTransferConfig

    kvt = KVTransferConfig(**spec["kv"]) if spec["kv"] else None
    llm = LLM(model=spec["model"], dtype=spec.get("dtype", "float32"), enforce_eager=True, max_model_len=4608,
              enable_prefix_caching=bool(spec.get("versus_engine_hit")), kv_transfer_config=kvt, seed=0,
              disable_log_stats=False, tensor_parallel_size=spec.get("tp", 1))
    one = SamplingParams(temperature=0.0, max_tokens=1)
    unstored = SamplingParams(temperature=0.0, max_tokens=1,
                              extra_args={"kv_transfer_params": {"kvtier.skip_save": True}})

    def ttft(ids: list[int], params: Any = one) -> float:
        t0 = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        return time.perf_counter() - t0

    ttft(token_ids(64, 999))  # warm-up: first-call costs out of the figures
    if spec.get("versus_engine_hit"):
        return {"versus": {str(n): versus_engine_hit(llm, ttft, n, spec["reps"]) for n in spec["sizes"]}}
    out: dict[str, Any] = {"ttft": {}}
    for n in spec["sizes"]:
        ttft(token_ids(n, 900 + n))  # and each size's first-shape costs
        cold, warm = [], []
        for rep in range(spec["reps"]):
            ids = token_ids(n, n + rep)
            cold.append(ttft(ids))
            time.sleep(0.5)  # the store lands (kvtier queues it; the others write in the step)
            warm.append(ttft(ids))
        out["ttft"][str(n)] = {"cold_s": statistics.median(cold), "warm_s": statistics.median(warm)}
        if spec.get("store_overhead"):  # cold with and without storing, interleaved in this process
            stored, skipped = [], []
            for rep in range(spec["reps"]):
                skipped.append(ttft(token_ids(n, 3000 + n + rep), unstored))
                time.sleep(0.5)
                stored.append(ttft(token_ids(n, 4000 + n + rep)))
                time.sleep(0.5)
            out["ttft"][str(n)] |= {"cold_stored_s": statistics.median(stored),
                                    "cold_unstored_s": statistics.median(skipped)}
    if spec.get("stall"):
        out["stall"] = stall(llm, spec["stall"], spec["reps"])
    if spec.get("load_rate"):
        out["load"] = kvtier_counters(("load_seconds", "connector_hit_tokens"))
    return out


def versus_engine_hit(llm: Any, ttft: Any, n: int, reps: int) -> dict[str, float]:
    """Returns the median TTFT of an `n`-token prompt hit in vLLM's own prefix cache and, the
    same prompt, in kvtier's cpu tier (vLLM's cache reset before), alternating per prompt."""
    ttft(token_ids(n, 5000 + n))  # this size's first-shape costs
    engine, tier = [], []
    for rep in range(reps):
        ids = token_ids(n, 6000 + n + rep)
        ttft(ids)  # computed and stored; vLLM's prefix cache keeps its blocks
        time.sleep(0.5)  # the store lands
        for _ in range(2):
            engine.append(ttft(ids))
            if not llm.reset_prefix_cache():  # vLLM's own only: the connector's tiers stay
                raise RuntimeError("vLLM did not reset its prefix cache")
            tier.append(ttft(ids))  # the tier's hit; vLLM's cache holds the blocks again after
    return {"engine_hit_s": statistics.median(engine), "tier_hit_s": statistics.median(tier)}


def lookup_latency(model: str, reps: int) -> dict[str, Any]:
    """Returns the scheduler side's lookup of an 8192-token prompt held in a cpu tier, asked
    over the lookup channel of one worker and of two ranks (the default model's KV heads split
    1 + 2): median milliseconds and round trips per rank per lookup."""
    import torch

    from connector.connector_config import make_config
    from connector.connector_metrics import ConnectorMetrics
    from connector.planner import KVTierPlanner
    from connector.presence import LocalHeldKeys, Presence
    from connector.vllm.lookup_channel import LookupClient, LookupServer
    from engine.model_config import ModelConfig
    from engine.sampling_params import SamplingParams
    from engine.sequence import Sequence
    from kvstore.storage_manager import StorageManager
    from kvstore.store_config import KVStoreConfig, TierSpec

    mc = ModelConfig.from_pretrained(model)
    config = make_config(["cpu"], chunk_size=256)
    ks = config.keyspace(mc, torch.bfloat16).for_heads(0, mc.num_kv_heads)
    ids = token_ids(8192, 77)
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, heads in (("1 rank", [(0, mc.num_kv_heads)]), ("2 ranks", [(0, 1), (1, mc.num_kv_heads)])):
            stores = [StorageManager.from_config(KVStoreConfig(tiers=[TierSpec(url="cpu")])) for _ in heads]
            servers, remotes = [], []
            for r, (storage, (lo, hi)) in enumerate(zip(stores, heads)):
                rank_ks = ks.for_heads(lo, hi)
                value = torch.zeros(1, 2, 1, 1, 1)  # existence is all a lookup asks
                storage.batched_put([(k, value) for k in rank_ks.stored_keys(rank_ks.spans(ids))])
                path = Path(tmp) / f"{len(heads)}-{r}.sock"
                servers.append(LookupServer(LocalHeldKeys(storage), path, rank_ks))
                remotes.append(LookupClient(path))
            planner = KVTierPlanner(config, Presence(remotes, heads), ConnectorMetrics())
            planner.register_model(mc, torch.bfloat16, 128, ks)
            times = []
            for rep in range(max(5, reps * 5)):
                seq = Sequence(f"r{rep}", ids, SamplingParams(max_tokens=1))
                t0 = time.perf_counter()
                hit, _ = planner.get_num_new_matched_tokens(seq, 0)
                times.append(time.perf_counter() - t0)
                assert hit == len(ids) - 1, hit
                planner.request_finished(seq, [])
            out[label] = {"ms": statistics.median(times) * 1e3,
                          "round_trips_per_rank": sum(r.questions for r in remotes) / len(times) / len(remotes)}
            for r in remotes:
                r.close()
            for server in servers:
                server.close()
            for storage in stores:
                storage.close()
    return out


def kvtier_counters(names: tuple[str, ...]) -> dict[str, float]:
    """Returns kvtier's counters `kvtier:<name>_total` as this process's vLLM stat logger
    recorded them (rank 0's figures with tensor parallel, docs/vllm.md)."""
    from prometheus_client import REGISTRY

    time.sleep(1.0)  # the stat logger's last interval
    out = dict.fromkeys(names, 0.0)
    for family in REGISTRY.collect():
        for sample in family.samples:
            for name in names:
                if sample.name == f"kvtier:{name}_total":
                    out[name] += sample.value
    return out


def stall(llm: Any, n: int, reps: int) -> dict[str, float]:
    """p99 step time of 4 running decodes while a stored `n`-token prompt loads, and with no load."""
    from vllm import SamplingParams, TokensPrompt

    engine = llm.llm_engine
    decode = SamplingParams(temperature=0.0, max_tokens=160, ignore_eos=True)
    one = SamplingParams(temperature=0.0, max_tokens=1)
    loaded, alone, joined = [], [], []
    for rep in range(reps):
        doc = token_ids(n, 5000 + rep)
        llm.generate([TokensPrompt(prompt_token_ids=doc)], one, use_tqdm=False)  # stored
        time.sleep(0.5)
        for arm, steps in (("load", loaded), ("alone", alone)):
            for i in range(4):
                engine.add_request(f"{arm}{rep}-{i}", TokensPrompt(prompt_token_ids=token_ids(64, 7000 + 10 * rep + i)),
                                   decode)
            for _ in range(8):  # past the decodes' prefill
                engine.step()
            window: list[float] = []
            if arm == "load":
                engine.add_request(f"doc{rep}", TokensPrompt(prompt_token_ids=doc), one)
            while True:
                t0 = time.perf_counter()
                outs = engine.step()
                window.append(time.perf_counter() - t0)
                if arm == "load" and any(o.request_id == f"doc{rep}" and o.finished for o in outs):
                    joined.append(window.pop())  # the doc's own forward: not a load stall
                    break
                if arm == "alone" and len(window) >= max(8, len(loaded) // (rep + 1)):
                    break
            steps += window
            while engine.has_unfinished_requests():
                engine.step()
    q = statistics.quantiles
    return {"p99_load_s": q(loaded, n=100)[98], "p99_alone_s": q(alone, n=100)[98],
            "steps_load": len(loaded), "steps_alone": len(alone), "max_joined_s": max(joined)}


# ---- the parent: arms, one after the other -------------------------------------------------
def run_arm(name: str, spec: dict[str, Any], log_dir: Path) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(REPO), **spec.get("env", {}))
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "3")
    log = log_dir / f"{name.replace(' ', '_')}.log"
    result = log.with_suffix(".json")
    t0 = time.perf_counter()
    with log.open("w") as f:
        proc = process.run([spec.get("python", sys.executable), __file__, "--child",
                            json.dumps({**spec, "out": str(result)})],
                           cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=3600)
    if proc.returncode or not result.exists():
        text = log.read_text(errors="replace").splitlines()
        errors = [ln.strip() for ln in text if "Error" in ln and "Traceback" not in ln] or text[-1:]
        return {"error": f"exit {proc.returncode}: {errors[0] if errors else ''}"}
    out = json.loads(result.read_text())
    out["seconds"] = round(time.perf_counter() - t0, 1)
    said = [ln for ln in log.read_text(errors="replace").splitlines() if spec.get("watch", "\0") in ln]
    if said:  # what the connector said about itself (e.g. LMCache's degraded mode)
        out["said"] = said[-1].strip()[-160:]
    return out


def kvtier(tier: str, chunk: int = 256, **more: Any) -> dict[str, Any]:
    return {"kv_connector": "KVTierConnector", "kv_connector_module_path": "connector.vllm", "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"tiers": [tier], "chunk_size": chunk, **more}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--only", action="append", help="rerun only this arm (repeatable) into the last results")
    ap.add_argument("--lmcache-python", help="an interpreter that has lmcache next to this vLLM (see above)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="the model's dtype (default: float32; bfloat16 runs its own arms, above)")
    args = ap.parse_args()
    if args.child:  # the result goes to a file: vLLM's processes share this one's stdout
        spec = json.loads(args.child)
        Path(spec["out"]).write_text(json.dumps(child(spec)))
        return 0

    from engine.default_model import ensure_default_model
    from harness.model import make_checkpoint
    from harness.redis import start_redis

    model = str(ensure_default_model())
    tmp = Path(tempfile.mkdtemp(prefix="kvtier-bench-vllm-"))
    tp_model = str(make_checkpoint(tmp / "tp-model", TP_MODEL, seed=0, tokenizer_dir=Path(model), keep_config=False))
    sizes = [256, 512] if args.quick else [1024, 2048, 4096]
    reps = 1 if args.quick else args.reps
    redis = start_redis()
    base = {"model": model, "sizes": sizes, "reps": reps, "dtype": args.dtype}
    arms = {
        "none": {**base, "kv": None},
        "kvtier cpu": {**base, "kv": kvtier("cpu?budget=3GiB"), "stall": 512 if args.quick else 4096,
                       "store_overhead": True},
        "kvtier cpu vs vLLM's hit": {**base, "kv": kvtier("cpu?budget=3GiB"), "versus_engine_hit": True},
        "kvtier disk": {**base, "kv": kvtier(f"disk://{tmp}/kvtier")},
        "kvtier redis": {**base, "kv": kvtier(redis.url)},
        # tensor parallel: a random model SmolLM2's size whose KV heads split over two ranks
        "kvtier cpu tp1": {**base, "model": tp_model, "sizes": sizes[-2:-1], "kv": kvtier("cpu?budget=3GiB"),
                           "load_rate": True},
        "kvtier cpu tp2": {**base, "model": tp_model, "sizes": sizes[-2:-1], "kv": kvtier("cpu?budget=3GiB"),
                           "load_rate": True, "tp": 2, "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}},
        "ExampleConnector": {**base, "kv": {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                                            "kv_connector_extra_config": {"shared_storage_path": f"{tmp}/example"}}},
        "SimpleCPUOffloadConnector": {**base, "sizes": sizes[-1:], "kv": {"kv_connector": "SimpleCPUOffloadConnector",
                                                                          "kv_role": "kv_both"}},
        "LMCacheConnectorV1": {**base, "sizes": sizes[-1:], "kv": {"kv_connector": "LMCacheConnectorV1",
                                                                   "kv_role": "kv_both"},
                               "python": args.lmcache_python or sys.executable, "watch": "RuntimeError: No supported",
                               "env": {"LMCACHE_LOCAL_CPU": "True", "LMCACHE_CHUNK_SIZE": "256",
                                       "LMCACHE_MAX_LOCAL_CPU_SIZE": "4"}},
    }
    if args.dtype != "float32":  # the connector's own figures in this dtype, decoded and as tiles
        arms = {"none": arms["none"], "kvtier cpu": {**arms["kvtier cpu"], "stall": 0},
                "kvtier cpu tiles": {**base, "kv": kvtier("cpu?budget=3GiB", cpu_page_form="tiles")}}
    res: dict[str, Any] = {"quick": args.quick, "platform": platform.platform(), "sizes": sizes, "reps": reps,
                           "dtype": args.dtype, "attention_isa": attention_isa(args.dtype),
                           "vllm_env": {k: os.environ.get(k) for k in ("VLLM_CPU_OMP_THREADS_BIND",
                                                                        "VLLM_CPU_KVCACHE_SPACE")}}
    suffix = ("_quick" if args.quick else "") + ("" if args.dtype == "float32" else f"_{args.dtype}")
    if args.only:  # rerun these arms into the last run's results (its sizes and reps)
        unknown = set(args.only) - set(arms) - {"lookup"}
        if unknown:
            ap.error(f"--only: no arm {sorted(unknown)}; arms: {', '.join(arms)}")
        res = json.loads((RESULTS / f"vllm{suffix}.json").read_text())
        arms = {n: {**arms[n], "sizes": [n_ for n_ in arms[n]["sizes"] if n_ in res["sizes"]], "reps": res["reps"]}
                for n in args.only if n in arms}
    try:
        for name, spec in arms.items():
            print(f"arm {name} ...", file=sys.stderr, flush=True)
            res[name] = run_arm(name, spec, tmp)
    finally:
        redis.stop()
    if not args.only or "lookup" in args.only:
        res["lookup"] = lookup_latency(model, reps)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"vllm{suffix}.json").write_text(json.dumps(res, indent=2) + "\n")
    table = render(res)
    (RESULTS / f"vllm{suffix}.md").write_text(table)
    print(table)
    return 0


def render(res: dict[str, Any]) -> str:
    sizes = [str(n) for n in res["sizes"]]

    def ratio(arm: str, n: str) -> float | None:
        t = res.get(arm, {}).get("ttft", {}).get(n)
        return t["warm_s"] / t["cold_s"] if t else None

    lines = [f"The model in {res.get('dtype', 'float32')}; vLLM's CPU attention runs its "
             f"{res.get('attention_isa', '?')!r} kernels here.", "",
             "| figure | " + " | ".join(f"{n} tok" for n in sizes) + " | target |",
             "|---|" + "---:|" * len(sizes) + "---|"]
    targets = {"kvtier cpu": "<= 0.12 (2k, 4k)", "kvtier cpu tiles": "<= 0.12 (2k, 4k)", "kvtier disk": "-",
               "kvtier redis": "<= 0.2 (2k, 4k)", "ExampleConnector": "-"}
    targets = {arm: t for arm, t in targets.items() if arm in res}
    for arm, target in targets.items():
        cells = [f"{r:.3f}" if (r := ratio(arm, n)) is not None else "n/a" for n in sizes]
        lines.append(f"| warm/cold TTFT, {arm} | " + " | ".join(cells) + f" | {target} |")
    for arm in targets:
        t = res[arm].get("ttft", {})
        cells = [f"{t[n]['warm_s'] * 1e3:.0f} ms" if n in t else "n/a" for n in sizes]
        lines.append(f"| warm TTFT, {arm} | " + " | ".join(cells) + " | cost growth |")
    ex = res.get("ExampleConnector", {}).get("ttft", {})
    dk = res.get("kvtier disk", {}).get("ttft", {})
    cells = [f"{dk[n]['warm_s'] / ex[n]['warm_s']:.2f}x" if n in dk and n in ex else "n/a" for n in sizes]
    if ex and dk:
        lines.append("| warm TTFT, kvtier disk / ExampleConnector | " + " | ".join(cells) + " | <= 0.5x |")
    no, cpu = res.get("none", {}).get("ttft", {}), res.get("kvtier cpu", {}).get("ttft", {})
    cells = [f"{cpu[n]['cold_s'] / no[n]['cold_s']:.3f}" if n in cpu and n in no else "n/a" for n in sizes]
    lines.append("| cold TTFT, kvtier cpu / no connector (separate processes) | " + " | ".join(cells) + " | - |")
    cells = [f"{cpu[n]['cold_stored_s'] / cpu[n]['cold_unstored_s']:.3f}" if "cold_stored_s" in cpu.get(n, {})
             else "n/a" for n in sizes]
    lines.append("| store overhead: cold TTFT storing / not storing (`kvtier.skip_save`), one process, "
                 "interleaved | " + " | ".join(cells) + " | <= 1.05 |")
    vs = res.get("kvtier cpu vs vLLM's hit", {}).get("versus", {})
    if vs:
        cells = [f"{vs[n]['tier_hit_s'] / vs[n]['engine_hit_s']:.2f}x ({vs[n]['tier_hit_s'] * 1e3:.0f} / "
                 f"{vs[n]['engine_hit_s'] * 1e3:.0f} ms)" if n in vs else "n/a" for n in sizes]
        lines.append("| TTFT of a kvtier cpu tier hit / vLLM's own prefix-cache hit, same prompt, one process, "
                     "alternating | " + " | ".join(cells) + " | <= 1.05x |")
    for label, lk in res.get("lookup", {}).items():
        lines.append(f"| scheduler-side lookup of an 8192-token prompt held in a cpu tier, {label} (lookup channel) | "
                     + " | ".join([""] * (len(sizes) - 1)) + f" | {lk['ms']:.2f} ms, "
                     f"{lk['round_trips_per_rank']:.0f} round trip(s) per rank | - |")
    st = res.get("kvtier cpu", {}).get("stall")
    if st:
        lines.append(f"| stall: p99 decode step while a {sizes[-1]}-token hit loads / with no load | "
                     + " | ".join([""] * (len(sizes) - 1)) + f" | {st['p99_load_s'] / st['p99_alone_s']:.2f} "
                     f"({st['p99_load_s'] * 1e3:.0f} / {st['p99_alone_s'] * 1e3:.0f} ms; the step computing the loaded "
                     f"prompt with them: {st.get('max_joined_s', 0) * 1e3:.0f} ms) | <= 1.2 |")
    tp1, tp2 = res.get("kvtier cpu tp1", {}), res.get("kvtier cpu tp2", {})
    for arm, r in (("tp1", tp1), ("tp2", tp2)):
        for n, t in r.get("ttft", {}).items():
            lines.append(f"| warm/cold TTFT, kvtier cpu, TP={arm[-1]} (8-head random model), {n} tok | "
                         + " | ".join([""] * (len(sizes) - 1)) + f" | {t['warm_s'] / t['cold_s']:.3f} | "
                         + ("<= 0.15 |" if arm == "tp2" else "- |"))
    if tp1.get("load", {}).get("load_seconds") and tp2.get("load", {}).get("load_seconds"):
        rate = [r["load"]["connector_hit_tokens"] / r["load"]["load_seconds"] for r in (tp1, tp2)]
        lines.append("| load rate per token, TP=2 / TP=1 (rank 0's loads: tokens / seconds) | "
                     + " | ".join([""] * (len(sizes) - 1)) + f" | {rate[1] / rate[0]:.2f} ({rate[1]:.0f} / "
                     f"{rate[0]:.0f} tokens/s) | >= 0.8 |")
    for arm in ("SimpleCPUOffloadConnector", "LMCacheConnectorV1"):
        r = res.get(arm, {})
        if not r:
            continue
        if "error" in r:
            what = "fails: " + r["error"][-300:].replace("|", "/")
        else:
            n = sizes[-1]
            t = r["ttft"][n]
            what = f"runs; warm/cold {ratio(arm, n):.3f} at {n} tokens (prefix caching off)"
            if n in cpu:
                what += f", cold TTFT {t['cold_s'] / cpu[n]['cold_s']:.2f}x kvtier cpu's"
            if "said" in r:
                what += f"; it says: {r['said']}"
        lines.append(f"| {arm} | {what} | | |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
