"""vLLM's own benchmark client (`vllm bench serve`) against `kvtier serve`: its `random` and
`prefix_repetition` datasets complete with no failed request, every request returns the
output length asked for, and the shared prefixes hit kvtier's prefix cache (/metrics). The two
runs go side by side."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness import process
from harness.serve import REPO, ServeProcess

NAME = "SmolLM2-135M-Instruct"
NUM_PROMPTS = 8
OUTPUT_LEN = 8
DATASETS = {
    "random": ["--dataset-name", "random", "--random-input-len", "96", "--random-output-len", str(OUTPUT_LEN),
               "--ignore-eos"],
    "prefix_repetition": ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "128",
                          "--prefix-repetition-suffix-len", "32", "--prefix-repetition-num-prefixes", "2",
                          "--prefix-repetition-output-len", str(OUTPUT_LEN), "--ignore-eos"],
}


@pytest.fixture(scope="module")
def server(default_model_path: Path) -> Iterator[ServeProcess]:
    proc = ServeProcess("--model", str(default_model_path), "--served-model-name", NAME, "--dtype", "float32",
                        "--max-model-len", "1024", "--kv-tier", "cpu?budget=1GiB")
    yield proc
    assert proc.stop() == 0, proc.log()[-3000:]


def _prefix_cache_hits(url: str) -> float:
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name == "kvtier:prefix_cache_hits_total":
                return float(sample.value)
    raise AssertionError("kvtier:prefix_cache_hits_total missing from /metrics")


@dataclass
class BenchRuns:
    """Each dataset's `vllm bench serve` (exit code, output, saved result), run side by side
    (each spends most of its time importing vLLM, on one core), and the server's prefix-cache
    hits over both: the `random` dataset's prompts share no prefix, so the hits are the
    `prefix_repetition` run's."""

    runs: dict[str, tuple[int, str, dict[str, Any]]]
    hits: float


@pytest.fixture(scope="module")
def bench_runs(server: ServeProcess, default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> BenchRuns:
    hits_before = _prefix_cache_hits(server.url)
    procs: dict[str, tuple[subprocess.Popen[str], Path]] = {}
    for dataset, args in DATASETS.items():
        out = tmp_path_factory.mktemp(dataset)
        cmd = [str(Path(sys.executable).parent / "kvtier-vllm"), "bench", "serve", "--backend", "openai",
               "--base-url", server.url, "--endpoint", "/v1/completions", "--model", NAME,
               "--tokenizer", str(default_model_path), *args, "--num-prompts", str(NUM_PROMPTS),
               "--request-rate", "inf", "--max-concurrency", "4", "--seed", "0", "--temperature", "0",
               "--disable-tqdm", "--save-result", "--result-dir", str(out), "--result-filename", "out.json"]
        procs[dataset] = (process.popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True), out)
    runs: dict[str, tuple[int, str, dict[str, Any]]] = {}
    for dataset, (proc, out) in procs.items():
        try:
            output, _ = proc.communicate(timeout=600)
        finally:
            proc.kill()
        saved = out / "out.json"
        runs[dataset] = (proc.returncode, output, json.loads(saved.read_text()) if saved.exists() else {})
    return BenchRuns(runs, _prefix_cache_hits(server.url) - hits_before)


@pytest.mark.parametrize("dataset", sorted(DATASETS))
def test_vllm_bench_serve_completes_against_kvtier_serve(bench_runs: BenchRuns, dataset: str) -> None:
    code, output, result = bench_runs.runs[dataset]
    assert code == 0, output[-3000:]
    assert (result["completed"], result["failed"]) == (NUM_PROMPTS, 0), [e for e in result["errors"] if e][:3]
    assert result["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    if dataset == "prefix_repetition":  # 8 prompts over 2 prefixes of 128 tokens: later ones hit
        assert bench_runs.hits >= 128
