"""CacheBlend fidelity at the model level: how close blended K/V bring the model to full prefill.

Greedy answers flip on near-ties (`... is a owl.` vs `... is a owl. The mascot is`), so a
few questions say little about a blend's quality through F1 alone. This script scores every
mode on the same questions as `examples/blend_kv/eval_blend.py`, teacher-forced along each
question's full-prefill answer:

- KL: mean next-token KL divergence, full prefill || blend, over the answer's positions;
- top-1: how often the blend's argmax is the full-prefill answer's next token;
- F1 / same answer: the blend's own greedy answer against the full-prefill one (eval's F1);
- compute: the layer-averaged fraction of context tokens the recompute ran (its cost; 1.0 is
  a full prefill of the context).

Document K/V comes from where the connector keeps it: `in_context` from its store after the
warm-up questions (other neighbours, other positions: what eval_blend measures), `standalone`
computed on its own (LMCache's precompute). The `*true_deviation*` modes select the tokens
whose K/V deviate most from full prefill itself (summed over every layer), which no real blend
can know, instead of by the check layer's deviation, then recompute as usual: whether a better
selection by deviation would help.

    .venv/bin/python -m benchmarks.bench_blend_fidelity [--num-questions 10] [--quick] [--family qwen3]

Writes benchmarks/results/blend_fidelity.json and .md and prints the table. `--family NAME`
runs a random-weight checkpoint of that family instead (harness/families.py's shapes,
with the bundled tokenizer's vocabulary; written to blend_fidelity_<NAME>.*): its figures
show that blending works on the family's layers (KL 0 at ratio 1, the selection's effect),
not a trained model's quality.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from connector.blend.blend_api import stored_segment
from connector.blend.executor import blend_recompute, compute_segment_kv, layer_inv_freqs, rerotate_kv
from connector.engine_connector import build_connector
from engine import LLM, SamplingParams
from engine.attention_metadata import AttentionMetadata
from engine.default_model import ensure_default_model
from engine.kv_cache import layout_for
from engine.model_loader import load_tokenizer
from examples.blend_kv.eval_blend import token_f1
from examples.blend_kv.qa_dataset import chat_segments, make_documents, make_questions
from harness.families import FAMILIES
from harness.model import FAMILY_TINY, make_tiny_checkpoint

REPO = Path(__file__).resolve().parents[1]

RESULTS = REPO / "benchmarks" / "results"
BLOCK = 16


@dataclass(frozen=True)
class Mode:
    segment_kv: str  # where document K/V comes from: in_context | standalone
    ratio: float
    narrowing: tuple[tuple[int, float], ...] = ()
    by_true_deviation: bool = False  # select by the K/V deviation from full prefill itself


MODES = {
    "reuse": Mode("in_context", 0.0),
    "blend_5": Mode("in_context", 0.05),
    "blend_15": Mode("in_context", 0.15),
    "blend_30": Mode("in_context", 0.30),
    "blend_25_to_10_at_8": Mode("in_context", 0.25, ((8, 0.10),)),
    "true_deviation_15": Mode("in_context", 0.15, by_true_deviation=True),
    "standalone_reuse": Mode("standalone", 0.0),
    "standalone_15": Mode("standalone", 0.15),
    "standalone_true_deviation_15": Mode("standalone", 0.15, by_true_deviation=True),
}


class Runner:
    """The engine's own model over a private paged cache holding one sequence."""

    def __init__(self, model: torch.nn.Module, num_tokens: int) -> None:
        self.model = model
        cfg = model.config
        dev, dtype = model.model.embed_tokens.weight.device, model.model.embed_tokens.weight.dtype
        self.num_blocks = -(-num_tokens // BLOCK)
        self.blocks = list(range(self.num_blocks))
        self.caches = [torch.zeros(2, self.num_blocks, BLOCK, cfg.num_kv_heads, cfg.head_size, dtype=dtype, device=dev)
                       for _ in range(cfg.num_layers)]
        self.layout = layout_for(self.caches)
        self.device = dev

    def slots(self, start: int, end: int) -> torch.Tensor:
        return self.layout.slots(self.blocks, start, end, device=self.device)

    @torch.inference_mode()
    def forward(self, ids: list[int], start: int) -> torch.Tensor:
        """Returns float32 logits `[len(ids), vocab]` of `ids` at positions `start..` over the
        cache's [0, start) (and writes their K/V)."""
        end = start + len(ids)
        meta = AttentionMetadata(
            slot_mapping=self.slots(start, end),
            block_tables=torch.as_tensor([self.blocks[: -(-end // BLOCK)]], device=self.device),
            query_start_loc=[0, len(ids)], seq_lens=[end], block_size=BLOCK)
        ids_t = torch.as_tensor(ids, dtype=torch.long, device=self.device)
        pos = torch.arange(start, end, device=self.device)
        return self.model.compute_logits(self.model(ids_t, pos, self.caches, meta))

    def greedy(self, suffix: list[int], start: int, max_tokens: int, eos: int) -> tuple[list[int], torch.Tensor]:
        """Returns the greedy answer after `suffix` (at `start`) and the logits each token was
        picked from `[len(answer), vocab]`."""
        logits = [self.forward(suffix, start)[-1]]
        out = [int(logits[-1].argmax())]
        while len(out) < max_tokens and out[-1] != eos:
            logits.append(self.forward(out[-1:], start + len(suffix) + len(out) - 1)[-1])
            out.append(int(logits[-1].argmax()))
        return out, torch.stack(logits)

    def kv(self, start: int, end: int) -> torch.Tensor:
        return self.layout.gather_chunk(self.slots(start, end))


def layer_cost(mode: Mode, check_layer: int, num_layers: int) -> float:
    """Returns the layer-averaged fraction of context tokens the recompute runs (0 at ratio 0:
    `blend_recompute` then does nothing at all)."""
    if mode.ratio == 0.0:
        return 0.0
    steps = [(check_layer, mode.ratio), *mode.narrowing]
    frac = [1.0] * (check_layer + 1)
    for (layer, ratio), (nxt, _) in zip(steps, [*steps[1:], (num_layers - 1, 0.0)]):
        frac += [ratio] * (nxt - layer)
    return sum(frac[:num_layers]) / num_layers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 questions, 3 docs of ~128 tokens")
    ap.add_argument("--num-questions", type=int, default=10)
    ap.add_argument("--docs-per-question", type=int, default=6)
    ap.add_argument("--doc-tokens", type=int, default=512)
    ap.add_argument("--pool", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--check-layer", type=int, default=1)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--family", choices=sorted(FAMILIES), default=None,
                    help="a random-weight checkpoint of this family instead of the bundled model")
    args = ap.parse_args()
    if args.quick:
        args.num_questions, args.docs_per_question, args.doc_tokens, args.pool = 3, 3, 128, 6
    out_name = args.out or ("blend_fidelity" + (f"_{args.family}" if args.family else "")
                            + ("_quick" if args.quick else ""))
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvtier-blend-family-") as tmp:
        model_path = None
        if args.family:
            tok_dir = ensure_default_model()
            sizes = {**FAMILY_TINY, **FAMILIES[args.family], "vocab_size": len(load_tokenizer(tok_dir)),
                     "max_position_embeddings": 16384}
            model_path = make_tiny_checkpoint(Path(tmp), tokenizer_dir=tok_dir, **sizes)
        run_bench(args, out_name, t_start, model_path)


def run_bench(args: argparse.Namespace, out_name: str, t_start: float, model_path: Path | None) -> None:

    # The connector stores in-context document K/V as in eval_blend's warm-up (at ratio 0).
    conn = build_connector({"tiers": ["cpu"],
                            "blend": {"enabled": True, "ratio": 0.0, "check_layer": args.check_layer}})
    llm = LLM(None if model_path is None else str(model_path), kv_connector=conn, device=args.device,
              max_num_batched_tokens=8192)
    tok = llm.get_tokenizer()
    model = llm.engine.runner.model
    num_layers = model.config.num_layers
    inv_freq = layer_inv_freqs(model)
    docs = make_documents(args.pool, args.doc_tokens, lambda s: len(tok.encode(s)), seed=args.seed)
    questions = make_questions(docs, args.num_questions, args.docs_per_question, seed=args.seed)
    warm = make_questions(docs, args.pool, args.docs_per_question, seed=args.seed + 1)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    print(f"warming {len(warm)} questions' document K/V (in context) ...", flush=True)
    for q in warm:  # one at a time, as eval_blend: a later question finds the earlier's documents
        llm.generate([chat_segments(tok, docs, q)], params)

    modes = {name: m for name, m in MODES.items() if all(layer < num_layers for layer, _ in m.narrowing)}
    rows: dict[str, dict[str, list[float]]] = {name: {} for name in modes}
    standalone: dict[tuple[int, ...], torch.Tensor] = {}
    for qi, q in enumerate(questions):
        seq = llm.engine.make_sequence(chat_segments(tok, docs, q), params)
        ids, lens = seq.prompt_token_ids, seq.segment_lens
        bounds = [sum(lens[:i]) for i in range(len(lens) + 1)]
        head, n_ctx = bounds[1], bounds[-2]
        suffix = ids[n_ctx:]
        room = len(ids) + args.max_tokens

        ref = Runner(model, room)
        ref.forward(ids[:n_ctx], 0)
        answer, ref_logits = ref.greedy(suffix, n_ctx, args.max_tokens, tok.eos_token_id)
        ref_text = tok.decode(answer, skip_special_tokens=True)
        full_kv = ref.kv(0, n_ctx)  # (L, 2, n_ctx, H, D)
        ref_logp = ref_logits.log_softmax(-1)
        print(f"q{qi}: {ref_text!r}", flush=True)

        for name, mode in modes.items():
            run = Runner(model, room)
            run.forward(ids[:head], 0)  # the exact head (the engine's prefix-cache hit)
            pieces = []
            for a, b in zip(bounds[1:-2], bounds[2:-1]):
                seg = ids[a:b]
                if mode.segment_kv == "standalone":
                    kv = standalone.get(tuple(seg))
                    if kv is None:
                        kv = standalone[tuple(seg)] = compute_segment_kv(model, seg)
                else:
                    kv = stored_segment(conn, seg, "in_context")
                    if kv is None:
                        raise RuntimeError(f"q{qi}: a document was not stored by the warm-up")
                pieces.append(rerotate_kv(kv.to(run.device), a, inv_freq))
            run.layout.scatter_chunk(run.slots(head, n_ctx), torch.cat(pieces, dim=2))
            forced = None
            if mode.by_true_deviation:
                dev = (run.kv(head, n_ctx) - full_kv[:, :, head:]).float().pow(2).sum((0, 1, 3, 4))
                forced = torch.zeros_like(dev, dtype=torch.bool)
                forced[dev.topk(min(dev.numel(), round(mode.ratio * dev.numel()))).indices] = True
            blend_recompute(
                model,
                run.caches,
                run.blocks,
                BLOCK,
                ids[head:n_ctx],
                head,
                n_ctx,
                0.0 if mode.by_true_deviation else mode.ratio,
                args.check_layer,
                mode.narrowing,
                missing=forced,
            )

            logits = run.forward(suffix + answer[:-1], n_ctx)[len(suffix) - 1:]
            logp = logits.log_softmax(-1)
            kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1)
            mine, _ = run.greedy(suffix, n_ctx, args.max_tokens, tok.eos_token_id)
            r = rows[name]
            r.setdefault("kl", []).append(kl.mean().item())
            r.setdefault("top1", []).append((logits.argmax(-1).cpu() == torch.as_tensor(answer)).float().mean().item())
            r.setdefault("f1", []).append(token_f1(tok.decode(mine, skip_special_tokens=True), ref_text))
            r.setdefault("same_answer", []).append(float(mine == answer))

    results = []
    for name, mode in modes.items():
        r = rows[name]
        results.append({
            "mode": name, "segment_kv": mode.segment_kv, "ratio": mode.ratio,
            "narrowing": [list(s) for s in mode.narrowing], "by_true_deviation": mode.by_true_deviation,
            "compute": layer_cost(mode, args.check_layer, num_layers),
            **{k: statistics.fmean(v) for k, v in r.items()},
            "per_question": r,
        })
    lines = ["| mode | document K/V | compute | KL vs full prefill | top-1 | F1 | same answer |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['mode']} | {r['segment_kv']} | {r['compute']:.3f} | {r['kl']:.4f} | {r['top1']:.3f} | "
                     f"{r['f1']:.3f} | {r['same_answer']:.2f} |")
    md = "\n".join(lines)
    setup = (f"{args.num_questions} questions, {args.docs_per_question} documents of ~{args.doc_tokens} tokens, "
             f"check layer {args.check_layer}, teacher-forced over greedy answers of up to {args.max_tokens} "
             f"tokens, model {llm.model_config.path.name}, device {llm.engine.runner.device}, "
             f"{torch.get_num_threads()} CPU threads")
    record = {"name": out_name, "quick": args.quick, "setup": setup, "args": vars(args), "results": results,
              "wall_seconds": time.perf_counter() - t_start}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{out_name}.json").write_text(json.dumps(record, indent=2))
    (RESULTS / f"{out_name}.md").write_text(f"# CacheBlend fidelity ({out_name})\n\n{setup}\n\n{md}\n")
    print(f"\n{setup}\n\n{md}\n\nwrote {RESULTS / (out_name + '.json')} and .md")
    llm.shutdown()


if __name__ == "__main__":
    main()
