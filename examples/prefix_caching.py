"""Prefix caching across KV tiers: a long document and several questions, cold vs warm.

    python examples/prefix_caching.py [--redis-url redis://host:6379/0] [--model PATH]
                                      [--device auto|cpu|cuda] [--sections N] [--chunk-size N]

The connector keeps every prompt's K/V as 256-token chunks in tiers ordered fastest first:
an in-process CPU tier and a disk tier under a temp dir (no services needed), plus Redis
with `--redis-url`. Each question is asked cold (every tier empty: full prefill) and then
warm from each tier in turn (the faster tiers emptied first, so the chunks really come from
that tier). Finally new questions over the same document reuse its chunks. The engine's own
prefix cache is off, so every reused token comes through the connector. Prints TTFT per row
and the speed-up over cold; warm answers must equal the cold ones token for token.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from connector.engine_connector import EngineConnector, build_connector  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402


def document(sections: int) -> str:
    return "\n".join(
        f"Chapter {i + 1}. The harbour archive kept letters from sailors, merchants and "
        f"lighthouse keepers; letter {i + 1} describes the weather, the tide tables and the "
        f"{['brig', 'schooner', 'ketch', 'sloop'][i % 4]} that arrived on day {i + 1}."
        for i in range(sections)
    )


QUESTIONS = [
    "In one sentence, what did the archive keep?",
    "Which kinds of ships are mentioned?",
    "What do the letters describe?",
]
NEW_QUESTIONS = [
    "Who wrote the letters?",
    "Summarise chapter 3 in a few words.",
]


def ask(llm: LLM, doc: str, question: str, params: SamplingParams):
    prompt = llm.apply_chat_template([{"role": "user", "content": f"{doc}\n\nQuestion: {question}"}])
    return llm.generate(prompt, params)[0]


def clear_tiers(conn: EngineConnector, upto: int) -> None:
    """Empties tiers [0, upto) after queued stores land, so the next hit comes from a slower tier."""
    conn.flush()
    for tier in conn.storage.tiers[:upto]:
        tier.clear()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="local HF checkpoint dir (default: bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--redis-url", default=None, help="add a Redis tier, e.g. redis://localhost:6379/0")
    ap.add_argument("--sections", type=int, default=48, help="document length (about 45 tokens each)")
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=24)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="kvtier-demo-") as tmp:
        tiers = ["cpu", f"disk://{tmp}/kv"] + ([args.redis_url] if args.redis_url else [])
        names = ["cpu", "disk"] + (["redis"] if args.redis_url else [])
        conn = build_connector(tiers, chunk_size=args.chunk_size)
        llm = LLM(args.model, device=args.device, enable_prefix_caching=False, kv_connector=conn)
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
        doc = document(args.sections)
        llm.generate("Warm-up.", SamplingParams(temperature=0.0, max_tokens=2))  # one-time set-up

        rows: dict[str, list] = {"cold": []}
        rows.update({f"warm · {n}": [] for n in names})
        for q in QUESTIONS:
            clear_tiers(conn, len(tiers))
            cold = ask(llm, doc, q, params)
            rows["cold"].append((cold, True))
            for i, name in enumerate(names):
                clear_tiers(conn, i)
                warm = ask(llm, doc, q, params)
                rows[f"warm · {name}"].append((warm, warm.outputs[0].token_ids == cold.outputs[0].token_ids))
        conn.flush()
        rows["new question · document cached"] = [(ask(llm, doc, q, params), None) for q in NEW_QUESTIONS]

        n_tokens = len(rows["cold"][0][0].prompt_token_ids)
        print(f"document + question: ~{n_tokens} tokens, chunk {args.chunk_size}, "
              f"device {llm.engine.runner.device}, tiers: {', '.join(tiers)}")
        cold_ttft = statistics.mean(o.metrics.ttft for o, _ in rows["cold"])
        header = f"| {'run':<32} | {'cached tokens':>13} | {'TTFT (s)':>9} | {'speed-up':>8} | {'same tokens':>11} |"
        print(header)
        print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
        for name, outs in rows.items():
            ttft = statistics.mean(o.metrics.ttft for o, _ in outs)
            cached = statistics.mean(o.num_cached_tokens for o, _ in outs)
            same = "n/a" if outs[0][1] is None else ("yes" if all(s for _, s in outs) else "NO")
            print(f"| {name:<32} | {cached:>13.0f} | {ttft:>9.3f} | {cold_ttft / ttft:>7.1f}x | {same:>11} |")
        print(f"\nanswer (warm): {rows['warm · cpu'][0][0].outputs[0].text.strip()!r}")
        for t in conn.tier_metrics():
            print(f"tier {t.name}: {t.tokens_hit} tokens hit, {t.bytes_loaded / 2**20:.1f} MiB loaded, "
                  f"{t.bytes_stored / 2**20:.1f} MiB stored, the tier's reads {t.load_seconds:.3f} s")
        llm.shutdown()
        ok = all(s is not False for outs in rows.values() for _, s in outs)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
