"""Time to first token with the KV connector, as ratios within one run.

- long-document QA: 4k-token documents, several questions each. Cold = nothing stored;
  warm = the document's chunks come from one tier (the faster tiers emptied first), the
  question is computed. warm/cold TTFT per tier         (targets: cpu <= 1/50, redis <= 1/25)
- multi-round QA: users x rounds over a shared system prompt, each user with its own context
  and a growing history; an engine block pool too small to keep everyone's history. Mean TTFT
  of the follow-up rounds (round 1 has nothing to reuse in either arm) with engine prefix
  caching alone / with the connector too (cpu tier, decode tokens saved)   (target >= 3x)
- store overhead: cold TTFT (unique prompts) with the connector storing / without a
  connector                                                              (target <= 1.05)
- stall: 4 requests decoding when a 4k-token prompt arrives whose prefix only Redis holds
  (loaded in the background while they step); the longest engine step between its arrival
  and its first token, over the same with the prefix in the engine's own prefix cache
                                                                          (target <= 1.5)
- Redis vs cpu: the long-doc warm/cold of Redis over that of the cpu tier (target <= 1.3)
- layerwise: the long-doc and stall runs again with `use_layerwise` (one stored value per
  layer; a hit is scheduled at once and layer i of its forward waits only for layer i)
- layer fetch: what addressing one layer costs: a 4k prefix's chunks fetched from Redis as
  whole values (as the loader groups them) vs one value per layer and chunk, layer by layer

    .venv/bin/python -m benchmarks.bench_ttft [--quick] [--model DIR] [--device auto]
        [--redis-url URL | --no-redis]
        [--only long_doc,layerwise,stall,overhead,multi_round,layer_fetch]

Writes benchmarks/results/ttft.json and ttft.md and prints the table. `--quick` uses small
sizes just to check the script works; its figures mean little. The engine's prefix cache is
off in the document and overhead runs, so every reused token comes through the connector.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from connector.connector_config import make_config
from connector.engine_connector import EngineConnector, build_connector
from connector.loader import FETCH_GROUP
from engine import LLM, SamplingParams
from engine.model_config import ModelConfig
from engine.model_loader import resolve_model_path
from kvkeys.keyspace import chunk_key, layer_key
from kvstore.storage_manager import StorageManager

REPO = Path(__file__).resolve().parents[1]

RESULTS = REPO / "benchmarks" / "results"
ONE = SamplingParams(temperature=0.0, max_tokens=1)


def token_ids(n: int, vocab: int, salt: int) -> list[int]:
    """Deterministic, varied token ids (no tokenizer round trip needed)."""
    return [(i * 7919 + salt * 104729 + 13) % (vocab - 100) + 100 for i in range(n)]


def ttft(llm: LLM, ids: list[int], params: SamplingParams = ONE):
    out = llm.generate({"prompt_token_ids": ids}, params)[0]
    return out.metrics.ttft, out


def clear_tiers(conn: EngineConnector, upto: int) -> None:
    """Empties tiers [0, upto) once queued stores have landed."""
    conn.flush()
    for tier in conn.storage.tiers[:upto]:
        tier.clear()


def bench_long_doc(llm: LLM, conn: EngineConnector, names: list[str], doc_len: int,
                   n_docs: int, n_questions: int, q_len: int) -> dict:
    vocab = llm.model_config.vocab_size
    colds: list[float] = []
    warms: dict[str, list[float]] = {n: [] for n in names}
    cached: dict[str, list[int]] = {n: [] for n in names}
    for d in range(n_docs):
        doc = token_ids(doc_len, vocab, salt=100 + d)
        clear_tiers(conn, len(names))
        t, _ = ttft(llm, doc + token_ids(q_len, vocab, salt=10_000 + d))  # stores the document
        colds.append(t)
        # Tiers take turns per question, so whatever the machine does after the cold run
        # (kernel writeback of the stored chunks, ...) falls on every tier alike.
        for q in range(n_questions):  # a new question per row: only the document is reused
            for i, name in enumerate(names):
                clear_tiers(conn, i)
                t, out = ttft(llm, doc + token_ids(q_len, vocab, salt=20_000 + 1000 * d + 100 * i + q))
                warms[name].append(t)
                cached[name].append(out.num_cached_tokens)
    cold = statistics.median(colds)
    tiers = {}
    for name in names:
        warm = statistics.median(warms[name])
        tiers[name] = {"cold_ttft_s": cold, "warm_ttft_s": warm, "warm_over_cold": warm / cold,
                       "cached_tokens": statistics.mean(cached[name]), "warm_samples_s": warms[name]}
    return {"doc_tokens": doc_len, "docs": n_docs, "questions_per_doc": n_questions,
            "question_tokens": q_len, "tiers": tiers}


def multi_round(llm: LLM, users: int, rounds: int, sys_len: int, ctx_len: int, q_len: int,
                answer: int) -> dict:
    vocab = llm.model_config.vocab_size
    system = token_ids(sys_len, vocab, salt=7)
    # Each user brings its own context (a document, a profile) after the shared system prompt.
    hist = [system + token_ids(ctx_len, vocab, salt=60_000 + u) for u in range(users)]
    params = SamplingParams(temperature=0.0, max_tokens=answer, ignore_eos=True)
    times, cached = [], []  # per round
    for r in range(rounds):
        times.append([])
        cached.append([])
        for u in range(users):
            hist[u] += token_ids(q_len, vocab, salt=50_000 + 100 * u + r)
            t, out = ttft(llm, hist[u], params)
            hist[u] += out.outputs[0].token_ids
            times[r].append(t)
            cached[r].append(out.num_cached_tokens)
    follow = [t for ts in times[1:] for t in ts]
    return {"mean_ttft_s": statistics.mean(t for ts in times for t in ts),
            # Round 1 has no history to reuse in either arm; follow-ups are what reuse changes.
            "followup_mean_ttft_s": statistics.mean(follow) if follow else float("nan"),
            "mean_cached_tokens": statistics.mean(c for cs in cached for c in cs),
            "followup_mean_cached_tokens": statistics.mean(c for cs in cached[1:] for c in cs) if follow else 0,
            "max_prompt_tokens": max(len(h) for h in hist) - answer}


def bench_multi_round(args, sizes: dict, device: str) -> dict:
    users, rounds, sys_len, ctx_len, q_len, answer = (
        sizes[k] for k in ("users", "rounds", "system", "user_context", "question", "answer"))
    longest = sys_len + ctx_len + rounds * (q_len + answer)
    # Room for about 1.5 users' histories: the engine's cache cannot keep everyone's.
    blocks = int(1.5 * (-(-longest // 16))) + 2
    results = {}
    for name, conn in (("prefix_cache_only", None),
                       ("with_connector", build_connector(["cpu"], chunk_size=sizes["mr_chunk"],
                                                          save_decode_tokens=True))):
        llm = LLM(args.model, device=device, num_gpu_blocks=blocks, kv_connector=conn)
        ttft(llm, token_ids(8, llm.model_config.vocab_size, salt=3))  # warm-up
        results[name] = multi_round(llm, users, rounds, sys_len, ctx_len, q_len, answer)
        llm.shutdown()
        del llm
    return {
        "users": users,
        "rounds": rounds,
        "system_tokens": sys_len,
        "user_context_tokens": ctx_len,
        "question_tokens": q_len,
        "answer_tokens": answer,
        "num_gpu_blocks": blocks,
        "chunk_size": sizes["mr_chunk"],
        **results,
        "speedup": results["prefix_cache_only"]["followup_mean_ttft_s"]
        / results["with_connector"]["followup_mean_ttft_s"],
        "speedup_all_rounds": results["prefix_cache_only"]["mean_ttft_s"] / results["with_connector"]["mean_ttft_s"],
    }


def bench_store_overhead(plain: LLM, with_conn: LLM, n: int, reps: int) -> dict:
    vocab = plain.model_config.vocab_size
    a, b = [], []
    for r in range(reps):  # interleaved, unique prompts: the connector stores and never hits
        a.append(ttft(plain, token_ids(n, vocab, salt=90_000 + 2 * r))[0])
        t, out = ttft(with_conn, token_ids(n, vocab, salt=90_001 + 2 * r))
        assert out.num_cached_tokens == 0
        b.append(t)
    without, with_ = statistics.median(a), statistics.median(b)
    return {"prompt_tokens": n, "reps": reps, "ttft_without_s": without, "ttft_with_store_s": with_,
            "with_over_without": with_ / without}


def stall_arm(llm: LLM, prompt: list[int], decoders: list[list[int]], same_prefix: list[int] | None) -> dict:
    """Starts `decoders` decoding, then adds `prompt`; returns the engine steps from its
    arrival to its first token (seconds) and the decode steps just before it. The prefix is
    in the engine's cache (put there by running `same_prefix`), or (None) only in the tiers."""
    eng = llm.engine
    if same_prefix is None:
        assert llm.reset_prefix_cache()  # only Redis holds the prefix now
    else:
        ttft(llm, same_prefix)
    long = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
    ids = [eng.add_request({"prompt_token_ids": d}, long) for d in decoders]
    for _ in range(1000):  # until every decoder has its first token
        if len({o.request_id for o in eng.step()}) == len(ids):
            break
    before = []
    for _ in range(5):
        t0 = time.perf_counter()
        eng.step()
        before.append(time.perf_counter() - t0)
    rid = eng.add_request({"prompt_token_ids": prompt}, ONE)
    steps, cached = [], None
    while cached is None:
        t0 = time.perf_counter()
        outs = eng.step()
        steps.append(time.perf_counter() - t0)
        cached = next((o.num_cached_tokens for o in outs if o.request_id == rid), None)
    for i in ids:
        eng.abort_request(i)
    while eng.has_unfinished_requests():
        eng.step()
    return {"max_step_s": max(steps), "steps": steps, "decode_step_s": statistics.median(before),
            "arrival_to_token_s": sum(steps), "cached_tokens": cached}


def bench_stall(args, redis_url: str, doc_len: int, q_len: int, chunk: int, reps: int,
                layerwise: bool = False) -> dict:
    conn = build_connector([redis_url], chunk_size=chunk, use_layerwise=layerwise)
    llm = LLM(args.model, device=args.device, kv_connector=conn)
    vocab = llm.model_config.vocab_size
    decoders = [token_ids(64, vocab, salt=70_000 + i) for i in range(4)]
    arms: dict[str, list[dict]] = {"redis": [], "prefix_cache": []}
    for r in range(reps):  # arms take turns; each rep a new document
        doc = token_ids(doc_len, vocab, salt=400 + r)
        other = doc + token_ids(q_len, vocab, salt=81_000 + r)  # another question, same document
        ttft(llm, other)  # stores the document
        assert conn.flush()
        for i, name in enumerate(("redis", "prefix_cache")):  # a new question each: computed
            prompt = doc + token_ids(q_len, vocab, salt=80_000 + 10 * r + i)
            arms[name].append(stall_arm(llm, prompt, decoders, None if name == "redis" else other))
    llm.shutdown()
    out = {name: {"max_step_s": statistics.median(a["max_step_s"] for a in runs),
                  "decode_step_s": statistics.median(a["decode_step_s"] for a in runs),
                  "arrival_to_token_s": statistics.median(a["arrival_to_token_s"] for a in runs),
                  "cached_tokens": statistics.mean(a["cached_tokens"] for a in runs),
                  "runs": runs} for name, runs in arms.items()}
    return {"doc_tokens": doc_len, "question_tokens": q_len, "decoders": len(decoders), "reps": reps,
            **out, "stall_ratio": out["redis"]["max_step_s"] / out["prefix_cache"]["max_step_s"]}


def bench_layer_fetch(redis_url: str, shape: tuple[int, ...], n_chunks: int, reps: int) -> dict:
    """Fetches `n_chunks` chunks of `shape` from Redis as whole values, FETCH_GROUP per call
    (the whole-chunk loader), and as one value per layer, one call per layer (the layerwise
    loader); returns median seconds for all of it and, layerwise, for the first layer."""
    layers = shape[0]
    keys = [chunk_key("bench-layer-fetch", "float32", shape[2], i.to_bytes(16, "big")) for i in range(n_chunks)]
    with StorageManager.from_config(make_config([redis_url]).kvstore) as sm:
        for k in keys:
            kv = torch.randn(shape)
            sm.batched_put([(k, kv)] + [(layer_key(k, i), kv[i:i + 1].clone()) for i in range(layers)])
        whole, per_layer, first = [], [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            for g in range(0, n_chunks, FETCH_GROUP):
                assert all(v is not None for v, _ in sm.fetch(keys[g:g + FETCH_GROUP], read_only=True))
            whole.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for i in range(layers):
                assert all(v is not None for v, _ in sm.fetch([layer_key(k, i) for k in keys], read_only=True))
                if i == 0:
                    first.append(time.perf_counter() - t0)
            per_layer.append(time.perf_counter() - t0)
        for k in keys:
            for key in [k] + [layer_key(k, i) for i in range(layers)]:
                sm.delete(key)
    w, p, f = statistics.median(whole), statistics.median(per_layer), statistics.median(first)
    return {"chunks": n_chunks, "chunk_shape": list(shape), "chunk_mb": torch.Size(shape).numel() * 4 / 1e6,
            "reps": reps, "whole_s": w, "per_layer_s": p, "first_layer_s": f,
            "per_layer_over_whole": p / w, "first_layer_over_whole": f / w}


SECTIONS = {"long_doc": "long_doc_qa", "layerwise": "long_doc_qa_layerwise", "stall": "stall",
            "overhead": "store_overhead", "multi_round": "multi_round_qa", "layer_fetch": "layer_fetch"}
STALL_LAYERWISE = "stall_layerwise"


def merge_previous(res: dict, path: Path) -> dict:
    """Returns `res` plus the sections an earlier (non-quick) run wrote to `path` that this
    run did not measure; each section records when it ran (its ratios are within one run)."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    ran = {SECTIONS[name]: stamp for name in res["sections"] if SECTIONS[name] in res}
    if res["quick"] or not path.exists():
        return {**res, "section_times": ran}
    old = json.loads(path.read_text())
    if old.get("quick"):
        return {**res, "section_times": ran}
    times = old.get("section_times", {})
    for key in SECTIONS.values():
        if key not in res and key in old:
            res[key] = old[key]
            ran[key] = times.get(key, "an earlier run")
    res["targets_met"] = {**old.get("targets_met", {}), **res["targets_met"]}
    return {**res, "section_times": ran}


def render_md(res: dict, md: str, note: str = "") -> str:
    """Returns ttft.md: the table plus when each section ran (ratios are within one run)."""
    times = "; ".join(f"{k}: {v}" for k, v in res.get("section_times", {}).items())
    return f"# TTFT with the KV connector on {res['device']}{note}\n\n{md}\n\nSections measured at: {times}\n"


def table(res: dict) -> str:
    lines = ["| benchmark | setting | figure | value | target |", "|---|---|---|---|---|"]
    ld = res.get("long_doc_qa")
    targets = {"cpu": "<= 0.020", "redis": "<= 0.040"}
    for name, t in (ld["tiers"].items() if ld else ()):
        lines.append(f"| long-doc QA ({ld['doc_tokens']} tok) | warm from {name} | warm/cold TTFT "
                     f"({t['warm_ttft_s'] * 1e3:.1f} / {t['cold_ttft_s'] * 1e3:.1f} ms) | "
                     f"{t['warm_over_cold']:.4f} | {targets.get(name, '-')} |")
    if ld and "redis_over_cpu" in ld:
        lines.append(f"| long-doc QA ({ld['doc_tokens']} tok) | redis vs cpu | (redis warm/cold) / "
                     f"(cpu warm/cold) | {ld['redis_over_cpu']:.2f}x | <= 1.3x |")
    lw = res.get("long_doc_qa_layerwise")
    for name, t in (lw["tiers"].items() if lw else ()):
        whole = ld["tiers"].get(name) if ld else None
        vs = f"; whole-chunk loads {whole['warm_ttft_s'] * 1e3:.1f} ms" if whole else ""
        lines.append(f"| long-doc QA ({lw['doc_tokens']} tok), layerwise | warm from {name} | warm/cold TTFT "
                     f"({t['warm_ttft_s'] * 1e3:.1f} / {t['cold_ttft_s'] * 1e3:.1f} ms{vs}) | "
                     f"{t['warm_over_cold']:.4f} | {targets.get(name, '-')} |")
    if lw and "redis_over_cpu" in lw:
        lines.append(f"| long-doc QA ({lw['doc_tokens']} tok), layerwise | redis vs cpu | (redis warm/cold) / "
                     f"(cpu warm/cold) | {lw['redis_over_cpu']:.2f}x | <= 1.3x |")
    lf = res.get("layer_fetch")
    if lf:
        lines.append(f"| layer fetch ({lf['chunks']} chunks of {lf['chunk_mb']:.1f} MB from Redis) | one value per "
                     f"layer vs whole chunks | all layers / whole ({lf['per_layer_s'] * 1e3:.1f} / "
                     f"{lf['whole_s'] * 1e3:.1f} ms; first layer {lf['first_layer_s'] * 1e3:.1f} ms) | "
                     f"{lf['per_layer_over_whole']:.2f} | - |")
    st = res.get("stall")
    stalls = [("redis (background load)", st)] if st else []
    if lw and "stall" in lw:
        stalls.append(("redis (layerwise, in the step)", lw["stall"]))
    for label, st in stalls:
        lines.append(
            f"| stall ({st['decoders']} decoding + {st['doc_tokens']}-tok prefix arriving) | "
            f"{label} vs engine prefix cache | longest step arrival..first token "
            f"({st['redis']['max_step_s'] * 1e3:.1f} / {st['prefix_cache']['max_step_s'] * 1e3:.1f} ms; "
            f"decode step {st['prefix_cache']['decode_step_s'] * 1e3:.1f} ms; arrival to token "
            f"{st['redis']['arrival_to_token_s'] * 1e3:.0f} / "
            f"{st['prefix_cache']['arrival_to_token_s'] * 1e3:.0f} ms) | "
            f"{st['stall_ratio']:.2f} | <= 1.5 |"
        )
    mr = res.get("multi_round_qa")
    if mr:
        lines.append(
            f"| multi-round QA ({mr['users']} users x {mr['rounds']} rounds) | {mr['num_gpu_blocks']} blocks | "
            f"prefix-cache-only / connector mean TTFT, follow-up rounds "
            f"({mr['prefix_cache_only']['followup_mean_ttft_s'] * 1e3:.1f} / "
            f"{mr['with_connector']['followup_mean_ttft_s'] * 1e3:.1f} ms; all rounds "
            f"{mr['speedup_all_rounds']:.2f}x) | {mr['speedup']:.2f}x | >= 3x |"
        )
    so = res.get("store_overhead")
    if so:
        lines.append(f"| store overhead ({so['prompt_tokens']} tok, cold) | cpu tier | with store / without TTFT "
                     f"({so['ttft_with_store_s'] * 1e3:.1f} / {so['ttft_without_s'] * 1e3:.1f} ms) | "
                     f"{so['with_over_without']:.3f} | <= 1.05 |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (validates the script)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--redis-url", default=None, help="use this Redis instead of a private redis-server")
    ap.add_argument("--no-redis", action="store_true")
    ap.add_argument("--only", default=",".join(SECTIONS),
                    help="comma-separated sections to run (results of the others are not written)")
    args = ap.parse_args()
    only = set(args.only.split(","))
    unknown = only - set(SECTIONS)
    if unknown:
        ap.error(f"--only: unknown section(s) {sorted(unknown)}")
    q = args.quick
    sizes = dict(doc=512 if q else 4096, docs=1 if q else 3, questions=2 if q else 4, qtok=32,
                 chunk=256, users=3 if q else 6, rounds=2 if q else 4, system=128 if q else 512,
                 user_context=128 if q else 1024, question=32 if q else 64, answer=8 if q else 64,
                 mr_chunk=64, stall_reps=1 if q else 3,
                 overhead_tokens=512 if q else 4096, overhead_reps=2 if q else 5)

    server = None
    redis_url = args.redis_url
    if not redis_url and not args.no_redis:
        try:
            from harness.redis import start_redis

            server = start_redis()
            redis_url = server.url
        except Exception as exc:  # no redis-server binary: the redis row is skipped
            print(f"no Redis ({exc}); skipping the redis tier", file=sys.stderr)
    tmp = tempfile.TemporaryDirectory(prefix="kvtier-bench-ttft-")
    res: dict = {"quick": q, "torch": torch.__version__, "platform": platform.platform(),
                 "sections": sorted(only)}
    targets: dict[str, bool] = {}
    t0 = time.perf_counter()
    try:
        has_cuda = torch.cuda.is_available() and args.device != "cpu"
        names = (["device"] if has_cuda else []) + ["cpu", "disk"] + (["redis"] if redis_url else [])
        urls = {"device": "device", "cpu": "cpu", "disk": f"disk://{tmp.name}/kv", "redis": redis_url}
        if only & {"long_doc", "overhead"}:
            conn = build_connector([urls[n] for n in names], chunk_size=sizes["chunk"])
            llm = LLM(args.model, device=args.device, enable_prefix_caching=False, kv_connector=conn)
            res["device"], res["dtype"] = str(llm.engine.runner.device), str(llm.engine.runner.dtype)
            res["tiers"] = names
            ttft(llm, token_ids(8, llm.model_config.vocab_size, salt=1))  # warm-up
            if "long_doc" in only:
                print(f"long-document QA on {res['device']} ...", file=sys.stderr)
                ld = bench_long_doc(llm, conn, names, sizes["doc"], sizes["docs"], sizes["questions"], sizes["qtok"])
                lds = ld["tiers"]
                targets["cpu_warm/cold<=1/50"] = lds["cpu"]["warm_over_cold"] <= 1 / 50
                if "redis" in lds:
                    ld["redis_over_cpu"] = lds["redis"]["warm_over_cold"] / lds["cpu"]["warm_over_cold"]
                    targets["redis_warm/cold<=1/25"] = lds["redis"]["warm_over_cold"] <= 1 / 25
                    targets["redis/cpu<=1.3"] = ld["redis_over_cpu"] <= 1.3
                res["long_doc_qa"] = ld
            if "overhead" in only:
                print("store overhead ...", file=sys.stderr)
                plain = LLM(args.model, device=args.device, enable_prefix_caching=False)
                res["store_overhead"] = bench_store_overhead(
                    plain, llm, sizes["overhead_tokens"], sizes["overhead_reps"]
                )
                targets["store_overhead<=5%"] = res["store_overhead"]["with_over_without"] <= 1.05
                plain.shutdown()
                del plain
            res["tier_metrics"] = [m.to_dict() for m in conn.tier_metrics()]
            llm.shutdown()
            del llm
        if "layerwise" in only:
            print(f"long-document QA, layerwise, on {args.device} ...", file=sys.stderr)
            conn = build_connector([urls[n] for n in names], chunk_size=sizes["chunk"], use_layerwise=True)
            llm = LLM(args.model, device=args.device, enable_prefix_caching=False, kv_connector=conn)
            res["device"] = str(llm.engine.runner.device)
            ttft(llm, token_ids(8, llm.model_config.vocab_size, salt=1))  # warm-up
            lw = bench_long_doc(llm, conn, names, sizes["doc"], sizes["docs"], sizes["questions"], sizes["qtok"])
            llm.shutdown()
            del llm
            lws = lw["tiers"]
            targets["layerwise_cpu_warm/cold<=1/50"] = lws["cpu"]["warm_over_cold"] <= 1 / 50
            if "redis" in lws:
                lw["redis_over_cpu"] = lws["redis"]["warm_over_cold"] / lws["cpu"]["warm_over_cold"]
                targets["layerwise_redis/cpu<=1.3"] = lw["redis_over_cpu"] <= 1.3
                print("stall, layerwise ...", file=sys.stderr)
                lw["stall"] = bench_stall(args, redis_url, sizes["doc"], sizes["qtok"], sizes["chunk"],
                                          sizes["stall_reps"], layerwise=True)
                targets["layerwise_stall<=1.5"] = lw["stall"]["stall_ratio"] <= 1.5
            res["long_doc_qa_layerwise"] = lw
        if "layer_fetch" in only and redis_url:
            print("layer fetch ...", file=sys.stderr)
            mc = ModelConfig.from_pretrained(resolve_model_path(args.model))
            shape = (mc.num_layers, 2, sizes["chunk"], mc.num_kv_heads, mc.head_size)
            res["layer_fetch"] = bench_layer_fetch(redis_url, shape, sizes["doc"] // sizes["chunk"],
                                                   sizes["stall_reps"] + 2)
        if "stall" in only and redis_url:
            print("stall ...", file=sys.stderr)
            res["stall"] = bench_stall(
                args, redis_url, sizes["doc"], sizes["qtok"], sizes["chunk"], sizes["stall_reps"]
            )
            targets["stall<=1.5"] = res["stall"]["stall_ratio"] <= 1.5
        if "multi_round" in only:
            print("multi-round QA ...", file=sys.stderr)
            res["multi_round_qa"] = bench_multi_round(args, sizes, args.device)
            targets["multi_round_speedup>=3"] = res["multi_round_qa"]["speedup"] >= 3
        res.setdefault("device", args.device)
        res["wall_s"] = time.perf_counter() - t0
        res["targets_met"] = targets
    finally:
        tmp.cleanup()
        if server is not None:
            server.stop()
    RESULTS.mkdir(parents=True, exist_ok=True)
    res = merge_previous(res, RESULTS / "ttft.json")
    md = table(res)
    note = " (quick mode: sizes too small for the figures to mean much)" if q else ""
    (RESULTS / "ttft.json").write_text(json.dumps(res, indent=2) + "\n")
    (RESULTS / "ttft.md").write_text(render_md(res, md, note))
    print(md)
    print(json.dumps(res["targets_met"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
