"""CacheBlend on the bundled model: a system prompt, three documents and a question.

    .venv/bin/python examples/blend_kv/blend.py [--ratio 0.15] [--doc-tokens 256]

The first request finds no document stored, so it computes them all inside its prompt (a full
prefill) and stores each document's K/V (embedded CPU tier); then, for several orders of the
documents, the same question is answered by blending the cached documents (re-rotated to their
new positions, `ratio` of the tokens recomputed) and by a full prefill of the very same token
ids, printing both TTFTs and answers.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

from connector.blend.blend_api import blend_stats

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

from qa_dataset import FACT_KINDS, Question, chat_segments, make_documents  # noqa: E402

from connector.engine_connector import build_connector  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402


def ttft(out) -> float:
    return out.metrics.first_token_time - out.metrics.arrival_time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ratio", type=float, default=0.15, help="fraction of document tokens recomputed")
    ap.add_argument("--check-layer", type=int, default=1)
    ap.add_argument("--doc-tokens", type=int, default=256, help="approximate tokens per document")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (1 avoids thread thrashing on an oversubscribed machine)")
    args = ap.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    conn = build_connector({"tiers": ["cpu"],
                            "blend": {"enabled": True, "ratio": args.ratio, "check_layer": args.check_layer}})
    blend = LLM(kv_connector=conn, device=args.device)
    full = LLM(device=args.device, enable_prefix_caching=False)  # the baseline: no reuse at all
    tok = blend.get_tokenizer()
    docs = make_documents(3, args.doc_tokens, lambda s: len(tok.encode(s)), seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)

    def question(order: tuple[int, ...]) -> Question:
        return Question(FACT_KINDS[docs[1].kind][1].format(site=docs[1].site), docs[1].value, order, 1)

    warm = blend.generate([chat_segments(tok, docs, question((0, 1, 2)))], params)[0]
    print(f"warm-up (segments computed in the prompt and stored): {len(warm.prompt_token_ids)} prompt tokens, "
          f"TTFT {ttft(warm):.3f}s, segment stats {blend_stats(conn)}")
    print(f"question: {question((0, 1, 2)).question}  expected answer: {docs[1].value}\n")
    print(f"{'order':<10} {'blend TTFT':>11} {'full TTFT':>10} {'speed-up':>9}  answers (blend | full)")
    for order in itertools.islice(itertools.permutations(range(3)), 1, 5):
        segments = chat_segments(tok, docs, question(order))
        b = blend.generate([segments], params)[0]
        # The same token ids the blended request used, as one plain prompt.
        f = full.generate([{"prompt_token_ids": b.prompt_token_ids}], params)[0]
        print(f"{str(order):<10} {ttft(b):>10.3f}s {ttft(f):>9.3f}s {ttft(f) / ttft(b):>8.2f}x  "
              f"{b.outputs[0].text.strip()!r} | {f.outputs[0].text.strip()!r}")
    print(f"\nsegment stats: {blend_stats(conn)}")
    blend.shutdown()
    full.shutdown()


if __name__ == "__main__":
    main()
