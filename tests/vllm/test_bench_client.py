"""vLLM's own benchmark client (`vllm bench serve`) against `kvtier serve`: its `random` and
`prefix_repetition` datasets complete with no failed request, every request returns the
output length asked for, and the shared prefixes hit kvtier's prefix cache (/metrics)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.fixtures.serve import REPO, ServeProcess

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


@pytest.mark.parametrize("dataset", sorted(DATASETS))
def test_vllm_bench_serve_completes_against_kvtier_serve(server: ServeProcess, default_model_path: Path,
                                                         tmp_path: Path, dataset: str) -> None:
    hits_before = _prefix_cache_hits(server.url)
    cmd = [str(Path(sys.executable).parent / "kvtier-vllm"), "bench", "serve", "--backend", "openai",
           "--base-url", server.url, "--endpoint", "/v1/completions", "--model", NAME,
           "--tokenizer", str(default_model_path), *DATASETS[dataset], "--num-prompts", str(NUM_PROMPTS),
           "--request-rate", "inf", "--max-concurrency", "4", "--seed", "0", "--temperature", "0",
           "--disable-tqdm", "--save-result", "--result-dir", str(tmp_path), "--result-filename", "out.json"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    result = json.loads((tmp_path / "out.json").read_text())
    assert (result["completed"], result["failed"]) == (NUM_PROMPTS, 0), [e for e in result["errors"] if e][:3]
    assert result["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    if dataset == "prefix_repetition":  # 8 prompts over 2 prefixes of 128 tokens: later ones hit
        assert _prefix_cache_hits(server.url) - hits_before >= 128
