"""Serving over HTTP: LMCache's multi-round QA shape against `kvtier serve`, ratios in one run.

U users, each with its own long context (~2k tokens, the system message) and a growing chat
history, R rounds each; rounds run one after another, C users at a time, over streaming chat
completions. The engine's KV pool holds the running requests but not every user's history,
so between two rounds of one user the other users evict it from the engine's prefix cache.
Arms, each a fresh `kvtier serve` process on the same flags:
  (a) engine prefix cache alone, (b) + connector with a cpu tier, (c) + a Redis tier
      (a private redis-server).
Per request: TTFT (first streamed chunk) and inter-token latency (gaps between chunks);
per arm: output tokens/s over the arm's wall time.
Targets: (b) mean TTFT >= 3x lower than (a) (follow-up rounds: round 1 has nothing to reuse in
any arm; all rounds reported too); (b) p99 ITL <= 1.2x (a)'s; (b) throughput >= (a)'s.
Server overhead: TTFT of a 1-token prompt over HTTP minus `LLM.generate` in-process
(median of N; target < 10 ms).

    .venv/bin/python -m benchmarks.bench_serving [--quick] [--users 8] [--rounds 3]
        [--concurrency 4] [--context-tokens 2000] [--no-redis]

Writes benchmarks/results/serving.json and serving.md and prints the table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from engine.default_model import ensure_default_model
from harness.serve import ServeProcess
from harness.text import PARAGRAPHS

REPO = Path(__file__).resolve().parents[1]

RESULTS = REPO / "benchmarks" / "results"
QUESTIONS = ["What is the first section about?", "Summarise the last section in one sentence.",
             "Which sections mention water?", "Name one person from the text.", "What happens at dawn?",
             "Give a title for these notes."]


def context_text(user: int, tokenizer: Any, target_tokens: int) -> str:
    """Returns user `user`'s notes: numbered paragraphs until about `target_tokens` tokens."""
    parts = [f"These are the private notes of user {user}."]
    i = 0
    while len(tokenizer.encode("\n\n".join(parts))) < target_tokens:
        parts.append(f"Note {i + 1} of user {user}. {PARAGRAPHS[(i + user) % len(PARAGRAPHS)]}")
        i += 1
    return "\n\n".join(parts)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


async def chat_stream(client: httpx.AsyncClient, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    """Returns TTFT, chunk gaps, the answer text and usage of one streamed chat completion."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft: float | None = None
    last = t0
    gaps: list[float] = []
    text: list[str] = []
    usage: dict[str, Any] = {}
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter()
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if not chunk["choices"]:
                continue
            if "role" in chunk["choices"][0]["delta"]:
                continue  # the role chunk is sent at once, before any token exists
            delta = chunk["choices"][0]["delta"].get("content")
            if ttft is None:
                ttft = now - t0
            else:
                gaps.append(now - last)
            last = now
            text.append(delta or "")
    return {"ttft": ttft, "gaps": gaps, "text": "".join(text), "usage": usage}


async def run_arm(url: str, contexts: list[str], rounds: int, concurrency: int, answer_tokens: int) -> dict[str, Any]:
    histories = [[{"role": "system", "content": c}] for c in contexts]
    ttfts: dict[int, list[float]] = {r: [] for r in range(rounds)}
    gaps: list[float] = []
    cached: list[int] = []
    out_tokens = 0
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        t0 = time.perf_counter()
        for r in range(rounds):  # one round of every user, then the next: each history goes cold
            async def one(u: int, r: int = r) -> None:
                nonlocal out_tokens
                async with sem:
                    h = histories[u]
                    h.append({"role": "user", "content": QUESTIONS[(u + r) % len(QUESTIONS)]})
                    res = await chat_stream(client, h, answer_tokens)
                    h.append({"role": "assistant", "content": res["text"]})
                    ttfts[r].append(res["ttft"])
                    gaps.extend(res["gaps"])
                    cached.append(res["usage"]["prompt_tokens_details"]["cached_tokens"])
                    out_tokens += res["usage"]["completion_tokens"]

            await asyncio.gather(*(one(u) for u in range(len(contexts))))
        wall = time.perf_counter() - t0
    follow = [t for r in range(1, rounds) for t in ttfts[r]]
    every = [t for r in range(rounds) for t in ttfts[r]]
    return {
        "mean_ttft_s": statistics.mean(follow), "mean_ttft_all_rounds_s": statistics.mean(every),
        "ttft_p50_s": pct(follow, 50), "ttft_p90_s": pct(follow, 90), "ttft_p99_s": pct(follow, 99),
        "round1_mean_ttft_s": statistics.mean(ttfts[0]),
        "itl_p50_s": pct(gaps, 50), "itl_p90_s": pct(gaps, 90), "itl_p99_s": pct(gaps, 99),
        "output_tokens": out_tokens, "wall_s": wall, "throughput_tok_s": out_tokens / wall,
        "mean_cached_tokens_followup": statistics.mean(cached[len(contexts):]) if rounds > 1 else 0,
    }


def overhead_ttfts(url: str, model: str, engine_kwargs: dict[str, Any], n: int) -> tuple[list[float], list[float]]:
    """Returns (HTTP, direct) wall times to the first token of a 1-token prompt with 1 output
    token: streamed from the server (client-side), and `LLM.generate` in this process on the
    same flags; interleaved, so both see the same machine."""
    from engine import LLM, SamplingParams

    llm = LLM(model, **engine_kwargs)
    one = SamplingParams(temperature=0.0, max_tokens=1)
    http, direct = [], []
    body = {"prompt": [1], "max_tokens": 1, "temperature": 0, "stream": True}
    try:
        with httpx.Client(base_url=url, timeout=60) as client:
            for i in range(n + 2):  # the first two warm both paths
                t0 = time.perf_counter()
                with client.stream("POST", "/v1/completions", json=body) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            break
                t1 = time.perf_counter()
                llm.generate({"prompt_token_ids": [1]}, one)
                t2 = time.perf_counter()
                if i >= 2:
                    http.append(t1 - t0)
                    direct.append(t2 - t1)
    finally:
        llm.shutdown()
    return http, direct


def table(res: dict[str, Any]) -> str:
    arms = res["arms"]
    lines = ["| arm | mean TTFT follow-up (all rounds) | TTFT p50 / p90 / p99 | ITL p50 / p90 / p99 | "
             "out tok/s | cached tok (follow-up, mean) |", "|---|---|---|---|---|---|"]
    for name, a in arms.items():
        lines.append(f"| {name} | {a['mean_ttft_s'] * 1e3:.0f} ms ({a['mean_ttft_all_rounds_s'] * 1e3:.0f} ms) | "
                     f"{a['ttft_p50_s'] * 1e3:.0f} / {a['ttft_p90_s'] * 1e3:.0f} / {a['ttft_p99_s'] * 1e3:.0f} ms | "
                     f"{a['itl_p50_s'] * 1e3:.0f} / {a['itl_p90_s'] * 1e3:.0f} / {a['itl_p99_s'] * 1e3:.0f} ms | "
                     f"{a['throughput_tok_s']:.1f} | {a['mean_cached_tokens_followup']:.0f} |")
    return "\n".join(lines + ratio_rows(res["ratios"]))


def ratio_rows(ratios: dict[str, tuple[float, str]]) -> list[str]:
    """Returns the markdown rows of a `name -> (value, target)` ratio table, blank line first."""
    return ["", "| ratio | measured | target |", "|---|---:|---:|",
            *(f"| {key} | {value:.3f} | {target} |" for key, (value, target) in ratios.items())]


def qa_arguments(description: str, context_tokens: int, answer_tokens: int) -> argparse.ArgumentParser:
    """Returns a parser with the multi-round QA flags (--quick --model --users --rounds
    --concurrency --context-tokens --answer-tokens) that bench_serving and bench_router share."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--quick", action="store_true", help="small sizes (validates the script)")
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the bundled model)")
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--context-tokens", type=int, default=context_tokens)
    ap.add_argument("--answer-tokens", type=int, default=answer_tokens)
    return ap


def main() -> int:
    ap = qa_arguments(__doc__.splitlines()[0], context_tokens=2000, answer_tokens=32)
    ap.add_argument("--overhead-reps", type=int, default=20)
    ap.add_argument("--no-redis", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.users, args.rounds, args.concurrency, args.context_tokens = 3, 2, 2, 300
        args.answer_tokens, args.overhead_reps = 8, 5
    model = args.model or str(ensure_default_model())
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    contexts = [context_text(u, tok, args.context_tokens) for u in range(args.users)]
    per_user_blocks = (args.context_tokens + args.rounds * (args.answer_tokens + 64)) // 16 + 8
    # Room for the running users (and a little more), not for every user's history.
    blocks = per_user_blocks * args.concurrency + per_user_blocks // 2
    assert blocks < per_user_blocks * args.users, "the pool would keep every history: raise --users"
    engine = ["--model", model, "--device", "cpu", "--num-gpu-blocks", str(blocks),
              "--max-num-seqs", str(args.concurrency)]
    redis = None
    arms_flags: dict[str, list[str]] = {"(a) prefix cache only": [], "(b) + cpu tier": ["--kv-tier", "cpu"]}
    if not args.no_redis:
        from harness.redis import start_redis

        redis = start_redis()
        arms_flags["(c) + redis tier"] = ["--kv-tier", redis.url]
    arms: dict[str, Any] = {}
    overhead: dict[str, Any] = {}
    try:
        for name, flags in arms_flags.items():
            print(f"{name} ...", file=sys.stderr)
            server = ServeProcess(*engine, *flags)
            try:
                arms[name] = asyncio.run(run_arm(server.url, contexts, args.rounds, args.concurrency,
                                                 args.answer_tokens))
                if not overhead:
                    overhead["http_ttft_s"], overhead["direct_ttft_s"] = overhead_ttfts(
                        server.url, model, dict(device="cpu", num_gpu_blocks=blocks, max_num_seqs=args.concurrency),
                        args.overhead_reps)
            finally:
                server.stop()
    finally:
        if redis is not None:
            redis.stop()
    http_med = statistics.median(overhead["http_ttft_s"])
    direct_med = statistics.median(overhead["direct_ttft_s"])
    a, b = arms["(a) prefix cache only"], arms["(b) + cpu tier"]
    ratios: dict[str, tuple[float, str]] = {
        "mean TTFT follow-up, (a) / (b)": (a["mean_ttft_s"] / b["mean_ttft_s"], ">= 3"),
        "mean TTFT all rounds, (a) / (b)": (a["mean_ttft_all_rounds_s"] / b["mean_ttft_all_rounds_s"], "reported"),
        "p99 ITL, (b) / (a)": (b["itl_p99_s"] / a["itl_p99_s"], "<= 1.2"),
        "throughput, (b) / (a)": (b["throughput_tok_s"] / a["throughput_tok_s"], ">= 1"),
        "server overhead: HTTP - direct TTFT, 1-token prompt (ms)": ((http_med - direct_med) * 1e3, "< 10"),
    }
    c = arms.get("(c) + redis tier")
    if c is not None:
        ratios["mean TTFT follow-up, (a) / (c)"] = (a["mean_ttft_s"] / c["mean_ttft_s"], "reported")
        ratios["p99 ITL, (c) / (a)"] = (c["itl_p99_s"] / a["itl_p99_s"], "<= 1.2 (issue 14)")
    res = {"quick": args.quick, "platform": platform.platform(), "users": args.users, "rounds": args.rounds,
           "concurrency": args.concurrency, "context_tokens": args.context_tokens,
           "answer_tokens": args.answer_tokens, "num_gpu_blocks": blocks, "arms": arms,
           "overhead": {**overhead, "http_median_s": http_med, "direct_median_s": direct_med},
           "ratios": {k: {"value": v, "target": t} for k, (v, t) in ratios.items()}}
    RESULTS.mkdir(parents=True, exist_ok=True)
    suffix = "_quick" if args.quick else ""
    md = table({**res, "ratios": ratios})
    (RESULTS / f"serving{suffix}.json").write_text(json.dumps(res, indent=2) + "\n")
    (RESULTS / f"serving{suffix}.md").write_text(
        f"# Serving: multi-round QA over HTTP ({args.users} users x {args.rounds} rounds, {args.concurrency} "
        f"concurrent, ~{args.context_tokens}-token contexts, {args.answer_tokens}-token answers, "
        f"{blocks} KV blocks; 2-core CPU, fp32)\n\n{md}\n")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
