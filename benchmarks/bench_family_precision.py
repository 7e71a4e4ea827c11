"""Low-precision agreement of each model family: kvtier's engine and transformers, each in
float16 and bfloat16, against transformers in float32 (the reference), on the tiny random
checkpoints of the family tests (harness/families.py). Reported, not asserted: low
precision need not give the reference's tokens.

Per family, engine and dtype: the largest logit difference from the fp32 reference over a
300-token prompt, how often the top-1 token agrees there, and how many of 32 greedy tokens
equal the fp32 reference's before the first difference.

    .venv/bin/python -m benchmarks.bench_family_precision

Writes benchmarks/results/family_precision.json and family_precision.md (CPU; no timing).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from engine.default_model import ensure_default_model
from engine.model_loader import load_model
from harness.families import FAMILIES, prompt_ids
from harness.model import FAMILY_TINY, make_tiny_checkpoint
from harness.paged import PagedDriver, hf_greedy, hf_logits

REPO = Path(__file__).resolve().parents[1]

RESULTS = REPO / "benchmarks" / "results"
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
GREEDY = 32


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def measure(name: str, tmp: Path) -> list[dict[str, Any]]:
    """Returns one row per (engine, dtype) for family `name`."""
    from transformers import AutoModelForCausalLM

    ckpt = make_tiny_checkpoint(tmp, tokenizer_dir=ensure_default_model(), **{**FAMILY_TINY, **FAMILIES[name]})
    ids, short = prompt_ids(300), prompt_ids(20)
    ref_model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    ref_logits, ref_tokens = hf_logits(ref_model, ids), hf_greedy(ref_model, short, GREEDY)
    rows = []
    for dname, dtype in DTYPES.items():
        hf = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=dtype).eval()
        ours, _ = load_model(ckpt, torch.device("cpu"), dtype)
        runs = {"transformers": (hf_logits(hf, ids), hf_greedy(hf, short, GREEDY)),
                "kvtier": (PagedDriver(ours).step([(0, ids)])[0], PagedDriver(ours).greedy(0, short, GREEDY))}
        for engine, (logits, tokens) in runs.items():
            rows.append({"family": name, "engine": engine, "dtype": dname,
                         "max_logit_diff": float((logits - ref_logits).abs().max()),
                         "top1_agreement": float((logits.argmax(-1) == ref_logits.argmax(-1)).float().mean()),
                         "greedy_prefix": _common_prefix(tokens, ref_tokens)})
    return rows


def main() -> None:
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in sorted(FAMILIES):
            rows += measure(name, Path(tmp) / name)
            print(*(f"{r['family']:<11} {r['engine']:<12} {r['dtype']:<8} max|dlogit| {r['max_logit_diff']:.3f}  "
                    f"top-1 {r['top1_agreement']:.3f}  greedy {r['greedy_prefix']}/{GREEDY}"
                    for r in rows[-4:]), sep="\n")
    RESULTS.mkdir(parents=True, exist_ok=True)
    meta = {"prompt_tokens": 300, "greedy_tokens": GREEDY, "reference": "transformers float32, CPU",
            "torch": torch.__version__}
    (RESULTS / "family_precision.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = ["| family | engine | dtype | max abs logit diff vs fp32 | top-1 agreement (300 positions) | "
             f"greedy tokens equal to fp32's (of {GREEDY}) |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['family']} | {r['engine']} | {r['dtype']} | {r['max_logit_diff']:.3f} | "
              f"{r['top1_agreement']:.3f} | {r['greedy_prefix']} |" for r in rows]
    (RESULTS / "family_precision.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
