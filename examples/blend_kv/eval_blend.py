"""CacheBlend quality and TTFT on a generated multi-document QA set (see qa_dataset.py).

    .venv/bin/python examples/blend_kv/eval_blend.py            # 6 docs x ~512 tokens per question
    .venv/bin/python examples/blend_kv/eval_blend.py --quick    # a small run to check the script

Modes, each over the same questions and the same token ids:
- full_prefill: no reuse at all (engine prefix cache off);
- prefix_caching: the engine's prefix cache only (warm: the shared chat-template head hits);
- full_kv_reuse: CacheBlend at ratio 0 (re-rotated document K/V, nothing recomputed);
- cacheblend_5/15/30: CacheBlend recomputing 5/15/30% of the document tokens;
- standalone_*: the same over document K/V computed standalone (LMCache's precompute) instead
  of in context (`BlendConfig.segment_kv`).
Document K/V is warmed first, by other questions over the same documents (in RAG, documents
recur across questions in other company and order): TTFTs are warm, and no measured question
reuses K/V computed inside its own prompt.

Per mode: mean TTFT and its ratio to full prefill (ratios within one run: the machine is
shared), exact match (the planted value is in the answer), token F1 against the full-prefill
answer, and top-1 agreement of the first generated token with full prefill. Writes
benchmarks/results/<out>.json and .md and prints the table.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

from connector.blend.blend_api import blend_stats, set_blend

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

from qa_dataset import chat_segments, make_documents, make_questions  # noqa: E402

from connector.engine_connector import build_connector  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402

# mode -> (BlendConfig.segment_kv, ratio)
BLEND_MODES = {
    "full_kv_reuse": ("in_context", 0.0), "cacheblend_5": ("in_context", 0.05),
    "cacheblend_15": ("in_context", 0.15), "cacheblend_30": ("in_context", 0.30),
    "standalone_kv_reuse": ("standalone", 0.0), "standalone_cacheblend_15": ("standalone", 0.15),
}


def words(text: str) -> list[str]:
    return re.sub(r"[^a-z0-9 ]", " ", text.lower()).split()


def token_f1(pred: str, ref: str) -> float:
    """SQuAD-style token F1 of two answers (1.0 when both are empty)."""
    p, r = words(pred), words(ref)
    if not p or not r:
        return float(p == r)
    common = sum((Counter(p) & Counter(r)).values())
    if not common:
        return 0.0
    prec, rec = common / len(p), common / len(r)
    return 2 * prec * rec / (prec + rec)


def ttft(out) -> float:
    return out.metrics.first_token_time - out.metrics.arrival_time


def run_mode(llm: LLM, prompts: list, params: SamplingParams) -> list:
    """One request at a time, so each TTFT is a lone request's."""
    return [llm.generate([p], params)[0] for p in prompts]


def summarise(name: str, outs: list, ref: list, answers: list[str], extra: dict | None = None) -> dict:
    return {
        "mode": name,
        "mean_ttft_s": statistics.fmean(ttft(o) for o in outs),
        "exact_match": statistics.fmean(a.lower() in o.outputs[0].text.lower() for o, a in zip(outs, answers)),
        "f1_vs_full_prefill": statistics.fmean(token_f1(o.outputs[0].text, r.outputs[0].text)
                                               for o, r in zip(outs, ref)),
        "top1_agreement": statistics.fmean(o.outputs[0].token_ids[:1] == r.outputs[0].token_ids[:1]
                                           for o, r in zip(outs, ref)),
        "answers": [o.outputs[0].text for o in outs],
        **(extra or {}),
    }


def table(results: list[dict], full_ttft: float) -> str:
    lines = ["| mode | mean TTFT (s) | TTFT vs full prefill | exact match | F1 vs full prefill | top-1 agreement |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['mode']} | {r['mean_ttft_s']:.3f} | {full_ttft / r['mean_ttft_s']:.2f}x lower | "
                     f"{r['exact_match']:.2f} | {r['f1_vs_full_prefill']:.3f} | {r['top1_agreement']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="4 questions, 3 docs of ~128 tokens")
    ap.add_argument("--num-questions", type=int, default=10)
    ap.add_argument("--docs-per-question", type=int, default=6)
    ap.add_argument("--doc-tokens", type=int, default=512)
    ap.add_argument("--pool", type=int, default=12, help="documents in the pool the questions draw from")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--check-layer", type=int, default=1)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (1 avoids thread thrashing on an oversubscribed machine)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="results name (default blend, blend_quick with --quick)")
    args = ap.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.quick:
        args.num_questions, args.docs_per_question, args.doc_tokens, args.pool = 4, 3, 128, 6
    out_name = args.out or ("blend_quick" if args.quick else "blend")

    llm_kw = dict(device=args.device, max_num_batched_tokens=8192)
    full = LLM(enable_prefix_caching=False, **llm_kw)
    tok = full.get_tokenizer()
    docs = make_documents(args.pool, args.doc_tokens, lambda s: len(tok.encode(s)), seed=args.seed)
    questions = make_questions(docs, args.num_questions, args.docs_per_question, seed=args.seed)
    seg_prompts = [chat_segments(tok, docs, q) for q in questions]
    # One question per pool document (each answers one), drawn with another seed: every
    # document is warmed, in other company and order than where it is measured.
    warm_prompts = [chat_segments(tok, docs, q)
                    for q in make_questions(docs, args.pool, args.docs_per_question, seed=args.seed + 1)]
    answers = [q.answer for q in questions]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    t_start = time.perf_counter()

    conn = build_connector({"tiers": ["cpu"], "blend": {"enabled": True, "check_layer": args.check_layer}})
    blend = LLM(kv_connector=conn, **llm_kw)
    # The token ids of the segments tokenized one by one, which every mode then uses.
    id_prompts = [{"prompt_token_ids": blend.engine.make_sequence(p, params).prompt_token_ids} for p in seg_prompts]
    prompt_lens = [len(p["prompt_token_ids"]) for p in id_prompts]

    print("full prefill ...", flush=True)
    ref = run_mode(full, id_prompts, params)
    results = [summarise("full_prefill", ref, ref, answers)]

    print("prefix caching ...", flush=True)
    pc = LLM(enable_prefix_caching=True, **llm_kw)
    head, *_, tail = chat_segments(tok, docs, questions[0])
    pc.generate([[head, "Document: none.\n\n", tail]], params)  # warms the shared head only
    outs = run_mode(pc, id_prompts, params)
    results.append(summarise("prefix_caching", outs, ref, answers,
                             {"mean_cached_tokens": statistics.fmean(o.num_cached_tokens for o in outs)}))
    pc.shutdown()

    warmed = set()
    for name, (segment_kv, ratio) in BLEND_MODES.items():
        set_blend(conn, ratio=ratio, segment_kv=segment_kv)
        if segment_kv not in warmed:  # each kind of segment K/V has its own keys
            print(f"warming {args.pool} documents' K/V ({segment_kv}) ...", flush=True)
            run_mode(blend, warm_prompts, params)
            warmed.add(segment_kv)
        print(f"{name} ...", flush=True)
        before = blend_stats(conn)
        outs = run_mode(blend, seg_prompts, params)
        after = blend_stats(conn)
        blended = after["blended_tokens"] - before["blended_tokens"]
        results.append(summarise(name, outs, ref, answers, {
            "segment_kv": segment_kv, "ratio": ratio,
            "recomputed_fraction": (after["recomputed_tokens"] - before["recomputed_tokens"]) / max(blended, 1),
            "segment_misses": after["segment_misses"] - before["segment_misses"],
        }))

    full_ttft = results[0]["mean_ttft_s"]
    for r in results:
        r["ttft_speedup_vs_full"] = full_ttft / r["mean_ttft_s"]
    md = table(results, full_ttft)
    import torch

    setup = (f"{args.num_questions} questions, {args.docs_per_question} documents of ~{args.doc_tokens} "
             f"tokens each (prompts {min(prompt_lens)}-{max(prompt_lens)} tokens), check layer "
             f"{args.check_layer}, greedy {args.max_tokens} tokens, model {full.model_config.path.name}, "
             f"device {full.engine.runner.device}, {torch.get_num_threads()} CPU threads")
    record = {
        "name": out_name, "quick": args.quick, "setup": setup, "args": vars(args),
        "prompt_tokens": prompt_lens, "expected_answers": answers, "results": results,
        "wall_seconds": time.perf_counter() - t_start,
    }
    res_dir = REPO / "benchmarks" / "results"
    res_dir.mkdir(parents=True, exist_ok=True)
    (res_dir / f"{out_name}.json").write_text(json.dumps(record, indent=2))
    (res_dir / f"{out_name}.md").write_text(f"# CacheBlend eval ({out_name})\n\n{setup}\n\n{md}\n")
    print(f"\n{setup}\n\n{md}\n\nwrote {res_dir / (out_name + '.json')} and .md")
    blend.shutdown()
    full.shutdown()


if __name__ == "__main__":
    main()
