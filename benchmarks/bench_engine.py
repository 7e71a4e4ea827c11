"""The paged engine vs transformers on the same model, device and dtype, in one run.

Figures are ratios within this run (shared machines are noisy):

- prefill time at 1k and 4k tokens: engine TTFT (prefix cache off, one chunk) / transformers
  forward on the same tokens                                  (target <= 1.0x)
- decode tokens/s at batch 1, 8, 32: engine / transformers batched `generate` (greedy, same
  prompt length, eos ignored)                                 (target >= 2x at batch 16+)
- TTFT of a repeated 2k-token prompt with prefix caching: warm / cold   (target <= 1/10)

    .venv/bin/python -m benchmarks.bench_engine [--quick] [--model DIR] [--device auto]

Writes benchmarks/results/engine.json and engine.md and prints the table. `--quick` uses
small sizes just to check the script works (its figures mean little) and writes
engine_quick.{json,md} instead, never overwriting the real figures.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from engine import LLM, SamplingParams
from engine.model_loader import resolve_model_path

REPO = Path(__file__).resolve().parents[1]

RESULTS = REPO / "benchmarks" / "results"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def token_ids(n: int, vocab: int, salt: int = 0) -> list[int]:
    """Deterministic, varied token ids (no tokenizer round trip needed)."""
    return [(i * 7919 + salt * 104729 + 13) % (vocab - 100) + 100 for i in range(n)]


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bench_prefill(llm: LLM, hf, lengths: list[int], repeats: int, device: torch.device) -> list[dict]:
    rows = []
    vocab = llm.model_config.vocab_size
    one = SamplingParams(temperature=0.0, max_tokens=1)
    for n in lengths:
        ids = token_ids(n, vocab, salt=n)

        def engine_prefill(ids: list[int] = ids) -> None:
            llm.reset_prefix_cache()
            llm.generate({"prompt_token_ids": ids}, one)

        x = torch.tensor([ids], device=device)

        def hf_forward(x: torch.Tensor = x) -> None:
            with torch.inference_mode():
                hf(x, use_cache=False)
            sync(device)

        engine_prefill(), hf_forward()  # warm-up at this shape
        e, h = median_time(engine_prefill, repeats), median_time(hf_forward, repeats)
        rows.append({"tokens": n, "engine_s": e, "transformers_s": h, "ratio": e / h})
        print(f"prefill {n}: engine {e:.3f}s, transformers {h:.3f}s", file=sys.stderr, flush=True)
    return rows


def bench_decode(llm: LLM, hf, batches: list[int], prompt_len: int, new_tokens: int,
                 device: torch.device) -> list[dict]:
    rows = []
    vocab = llm.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for b in batches:
        prompts = [token_ids(prompt_len, vocab, salt=1000 + i) for i in range(b)]
        llm.reset_prefix_cache()
        llm.generate([{"prompt_token_ids": p} for p in prompts[:1]], SamplingParams(temperature=0.0, max_tokens=2))
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        e = time.perf_counter() - t
        assert all(len(o.outputs[0].token_ids) == new_tokens for o in outs)
        x = torch.tensor(prompts, device=device)
        with torch.inference_mode():
            hf.generate(x[:1], attention_mask=torch.ones_like(x[:1]), max_new_tokens=2, min_new_tokens=2,
                        do_sample=False, pad_token_id=0)
            sync(device)
            t = time.perf_counter()
            out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
            sync(device)
            h = time.perf_counter() - t
        assert out.shape[1] == prompt_len + new_tokens
        e_tps, h_tps = b * new_tokens / e, b * new_tokens / h
        rows.append({"batch": b, "engine_tok_s": e_tps, "transformers_tok_s": h_tps, "ratio": e_tps / h_tps})
        print(
            f"decode batch {b}: engine {e_tps:.1f} tok/s, transformers {h_tps:.1f} tok/s", file=sys.stderr, flush=True
        )
    return rows


def bench_ttft(llm: LLM, n: int, repeats: int) -> dict:
    ids = token_ids(n, llm.model_config.vocab_size, salt=77)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    colds, warms, cached = [], [], 0
    for _ in range(repeats):
        llm.reset_prefix_cache()
        colds.append(llm.generate({"prompt_token_ids": ids}, params)[0].metrics.ttft)
        warm = llm.generate({"prompt_token_ids": ids}, params)[0]
        warms.append(warm.metrics.ttft)
        cached = warm.num_cached_tokens
    cold, warm_s = statistics.median(colds), statistics.median(warms)
    return {"tokens": n, "cold_ttft_s": cold, "warm_ttft_s": warm_s, "cached_tokens": cached, "ratio": warm_s / cold}


def to_markdown(res: dict) -> str:
    lines = [f"# Engine benchmark ({res['mode']}, {res['device']}, {res['dtype']})", "",
             "| measurement | engine | transformers | ratio (engine/transformers) | target |",
             "|---|---|---|---|---|"]
    for r in res["prefill"]:
        lines.append(
            f"| prefill {r['tokens']} tokens | {r['engine_s'] * 1e3:.1f} ms | {r['transformers_s'] * 1e3:.1f} ms "
            f"| {r['ratio']:.2f}x | <= 1.0x |"
        )
    for r in res["decode"]:
        lines.append(
            f"| decode batch {r['batch']} | {r['engine_tok_s']:.1f} tok/s | {r['transformers_tok_s']:.1f} tok/s "
            f"| {r['ratio']:.2f}x | {'>= 2x' if r['batch'] >= 16 else '-'} |"
        )
    t = res["ttft"]
    lines += ["", "| prefix caching | cold TTFT | warm TTFT | cached tokens | warm/cold | target |",
              "|---|---|---|---|---|---|",
              f"| {t['tokens']}-token prompt | {t['cold_ttft_s'] * 1e3:.1f} ms | {t['warm_ttft_s'] * 1e3:.1f} ms "
              f"| {t['cached_tokens']} | {t['ratio']:.3f} | <= 0.1 |"]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes: only checks that the script works")
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the bundled model)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", default=str(RESULTS), help="results directory")
    args = ap.parse_args()
    if args.quick:
        lengths, batches, prompt_len, new_tokens, ttft_len, repeats = [256, 512], [1, 4], 16, 8, 512, 1
    else:
        lengths, batches, prompt_len, new_tokens, ttft_len, repeats = [1024, 4096], [1, 8, 32], 64, 64, 2048, 3

    from transformers import AutoModelForCausalLM

    llm = LLM(args.model, device=args.device, dtype=args.dtype, max_num_batched_tokens=max(lengths),
              max_num_seqs=max(batches))
    device, dtype = llm.engine.runner.device, llm.engine.runner.dtype
    path = resolve_model_path(args.model)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()
    print(f"model {path} on {device} ({dtype}); mode {'quick' if args.quick else 'full'}", file=sys.stderr)

    res = {
        "mode": "quick" if args.quick else "full",
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "host": platform.node(),
        "prefill": bench_prefill(llm, hf, lengths, repeats, device),
        "decode": bench_decode(llm, hf, batches, prompt_len, new_tokens, device),
        "ttft": bench_ttft(llm, ttft_len, repeats),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "engine_quick" if args.quick else "engine"
    (out / f"{name}.json").write_text(json.dumps(res, indent=2) + "\n")
    md = to_markdown(res)
    (out / f"{name}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
