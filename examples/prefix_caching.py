"""Prefix caching demo: the same long prompt twice; the second prefill comes from the cache.

    python examples/prefix_caching.py [--model PATH] [--device auto|cpu|cuda]

The engine's automatic prefix cache keeps the K/V of every full 16-token block; the repeat
recomputes only the last block's tokens, so its time to first token (TTFT) drops sharply.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from engine import LLM, SamplingParams  # noqa: E402

DOCUMENT = " ".join(
    f"Chapter {i + 1}. The archive kept letters from sailors, merchants and lighthouse keepers; "
    f"each letter described the weather, the harbour, and the ships that arrived on day {i + 1}."
    for i in range(60)
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="local HF checkpoint dir (default: bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()

    llm = LLM(args.model, device=args.device)
    prompt = llm.apply_chat_template(
        [{"role": "user", "content": DOCUMENT + "\n\nIn one sentence, what did the archive keep?"}]
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    llm.generate("Warm-up.", SamplingParams(temperature=0.0, max_tokens=2))  # one-time kernel set-up

    cold = llm.generate(prompt, params)[0]
    warm = llm.generate(prompt, params)[0]
    n = len(cold.prompt_token_ids)
    print(f"prompt: {n} tokens on {llm.engine.runner.device}")
    print(f"{'run':<6}{'cached tokens':>15}{'TTFT (s)':>12}")
    for name, out in (("cold", cold), ("warm", warm)):
        print(f"{name:<6}{out.num_cached_tokens:>15}{out.metrics.ttft:>12.3f}")
    print(f"warm/cold TTFT: {warm.metrics.ttft / cold.metrics.ttft:.3f}")
    print(f"same tokens: {cold.outputs[0].token_ids == warm.outputs[0].token_ids}")
    print(f"answer: {warm.outputs[0].text.strip()!r}")
    stats = llm.get_stats()
    print(f"prefix cache: {stats['prefix_cache_hits']} hit / {stats['prefix_cache_queries']} queried tokens")
    llm.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
