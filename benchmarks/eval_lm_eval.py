"""lm-eval-harness against `kvtier serve`: accuracy and time per cache configuration.

lm-eval's `local-completions` model runs two tasks on local data (harness/lm_eval_tasks):
kvtier_mc (20 questions, 4 choices, scored by loglikelihood: acc, acc_norm) and kvtier_gen
(20 questions after a shared 3-example instruction, greedy generate_until: exact_match). The
configurations (harness/lm_eval_tasks/configurations.py): cold; warm from the engine's
prefix cache; warm from the `cpu` tier (engine cache reset); warm from Redis (a fresh server
with the Redis tier alone, a private redis-server). Then lm-eval's own command line
(`lm_eval run --model local-completions ...`) once against a fresh server, as a user runs it.

Accuracy must not move across configurations; time may (scoring requests compute every
position whatever the cache holds, as in vLLM; generate_until prompts are reused).

    .venv/bin/python -m benchmarks.eval_lm_eval [--batch-size 8]      (make eval)

Writes benchmarks/results/lm_eval.json and lm_eval.md and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from engine.default_model import ensure_default_model
from harness import process
from harness.lm_eval_tasks.configurations import CONFIGS, ConfigRun, run_configurations
from harness.lm_eval_tasks.runner import OFFLINE_ENV, TASKS, cli_command
from harness.redis import start_redis
from harness.serve import ServeProcess

REPO = Path(__file__).resolve().parents[1]

RESULTS = REPO / "benchmarks" / "results"
ENGINE_ARGS = ["--device", "cpu", "--dtype", "float32", "--num-gpu-blocks", "512", "--max-num-seqs", "8"]
LABELS = {"cold": "cold", "engine": "warm: engine prefix cache", "cpu": "warm: cpu tier",
          "redis": "warm: Redis tier"}


def run_cli(model_dir: Path, model_name: str, batch_size: int) -> dict[str, Any]:
    """Runs `lm_eval run --model local-completions` (lm-eval's command line, this venv's) against
    a fresh server with a cpu tier; returns its scores per task and its wall time."""
    server = ServeProcess("--model", str(model_dir), "--served-model-name", model_name, *ENGINE_ARGS,
                          "--kv-tier", "cpu")
    try:
        with tempfile.TemporaryDirectory(prefix="kvtier-lm-eval-") as tmp:
            cmd = cli_command(server.url, model_name, model_dir, batch_size)
            cmd = [str(Path(sys.executable).parent / cmd[0]), *cmd[1:], "--output_path", tmp]
            t0 = time.perf_counter()
            proc = process.run(cmd, env=dict(os.environ, **OFFLINE_ENV), capture_output=True, text=True,
                               timeout=900)
            seconds = time.perf_counter() - t0
            if proc.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
            (path,) = Path(tmp).rglob("results_*.json")
            results = json.loads(path.read_text())["results"]
    finally:
        server.stop()
    scores = {t: {k.split(",")[0]: float(v) for k, v in results[t].items() if "," in k and "_stderr" not in k}
              for t in TASKS}
    return {"command": " ".join(cmd[:-2]), "scores": scores, "seconds": seconds}


def row(label: str, scores: dict[str, dict[str, float]], seconds: float, cold_s: float, reused: str) -> str:
    mc, gen = scores["kvtier_mc"], scores["kvtier_gen"]
    return (f"| {label} | {mc['acc']:.2f} | {mc['acc_norm']:.2f} | {gen['exact_match']:.2f} | {seconds:.1f} s | "
            f"{seconds / cold_s:.2f} | {reused} |")


def table(runs: dict[str, ConfigRun], cli: dict[str, Any]) -> str:
    cold_s = runs["cold"].run.seconds
    lines = ["| configuration | kvtier_mc acc | acc_norm | kvtier_gen exact_match | time | time / cold "
             "| generate_until prompt tokens reused |", "|---|---:|---:|---:|---:|---:|---:|"]
    for c in CONFIGS:
        r = runs[c]
        lines.append(row(LABELS[c], r.run.scores, r.run.seconds, cold_s, f"{r.reused_fraction:.0%}"))
    lines.append(row("`lm_eval run` command line, cold (incl. its ~5 s start)", cli["scores"], cli["seconds"],
                     cold_s, "-"))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-size", type=int, default=8, help="prompts per request lm-eval sends (default: 8)")
    args = ap.parse_args()
    model_dir = ensure_default_model()
    name = model_dir.name
    redis = start_redis()
    try:
        print("lm-eval in four cache configurations ...", file=sys.stderr)
        runs = run_configurations(model_dir, name, redis.url, ENGINE_ARGS, args.batch_size)
    finally:
        redis.stop()
    print("lm_eval run (command line) ...", file=sys.stderr)
    cli = run_cli(model_dir, name, args.batch_size)
    want = runs["cold"].run.scores
    identical = all(runs[c].run.scores == want for c in CONFIGS)
    identical_samples = all(runs[c].run.samples == runs["cold"].run.samples for c in CONFIGS)
    res = {"platform": platform.platform(), "batch_size": args.batch_size, "engine_args": ENGINE_ARGS,
           "configurations": {c: {"scores": runs[c].run.scores, "seconds": runs[c].run.seconds,
                                  "metrics_moved": runs[c].moved, "reused_fraction": runs[c].reused_fraction}
                              for c in CONFIGS},
           "cli": cli, "scores_identical": identical, "responses_identical": identical_samples,
           "cli_scores_equal_cold": cli["scores"] == want}
    md = table(runs, cli)
    summary = (f"Scores identical across configurations: **{identical}**; every document's responses "
               f"identical: **{identical_samples}**; the command line's scores equal the cold run's: "
               f"**{res['cli_scores_equal_cold']}**.")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "lm_eval.json").write_text(json.dumps(res, indent=2) + "\n")
    (RESULTS / "lm_eval.md").write_text(
        f"# lm-eval-harness against kvtier serve (local-completions, batch size {args.batch_size}, "
        f"SmolLM2-135M-Instruct fp32, 2-core CPU)\n\n{md}\n\n{summary}\n\nCommand line:\n\n"
        f"```\n{' '.join(f'{k}={v}' for k, v in OFFLINE_ENV.items())} {cli['command']}\n```\n")
    print(md + "\n\n" + summary)
    return 0 if identical and identical_samples and res["cli_scores_equal_cold"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
