"""`kvtier cache explain` and `/kv/lookup` with `"explain": true` (issue #50) end to end: an
engine in this process and a `kvtier serve` process with another tiny checkpoint share one
disk tier. The server names the model for the prompt the other engine stored; for a prompt it
stored itself under a `cache_salt` (the openai client's request), explain without the salt
names the tenant to the operator, and nothing of it to another tenant's key; with the salt, a
hit. The chunks and family records come from the connector's own save path in both processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import openai

from connector.engine_connector import build_connector
from engine import LLM, SamplingParams
from harness import process
from harness.model import make_tiny_checkpoint
from harness.process import repo_env
from harness.serve import ServeProcess

PROMPT_IDS = list(range(100, 180))  # 80 tokens: two full 32-token chunks and a short one
ARGS = ["--device", "cpu", "--dtype", "float32", "--num-gpu-blocks", "64", "--max-num-seqs", "2",
        "--chunk-size", "32", "--served-model-name", "tiny"]


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return process.run([sys.executable, "-m", "kvtier", "cache", "explain", *args], capture_output=True,
                       text=True, timeout=120, env=repo_env(None))


def test_explain_model_and_tenant_over_http(tmp_path: Path) -> None:
    tier = f"disk://{tmp_path / 'kv'}"
    tenants = tmp_path / "tenants.json"
    tenants.write_text(json.dumps({"sk-bob": "bob"}))
    server = ServeProcess("--model", str(make_tiny_checkpoint(tmp_path, "llama", seed=1)), *ARGS,
                          "--kv-tier", tier, "--api-key", "sk-op", "--tenants", str(tenants), wait=False)
    try:
        other = make_tiny_checkpoint(tmp_path, "llama", seed=0)
        conn = build_connector([tier], chunk_size=32)
        with LLM(str(other), device="cpu", dtype="float32", num_gpu_blocks=64, kv_connector=conn) as llm:
            llm.generate([{"prompt_token_ids": PROMPT_IDS}], SamplingParams(max_tokens=1))
            assert conn.flush(timeout=60)
        server.wait_ready()
        ran = cli("--url", server.url, "--api-key", "sk-op", "--token-ids", ",".join(map(str, PROMPT_IDS)), "--json")
        assert ran.returncode == 0, ran.stderr
        [tier_answer] = json.loads(ran.stdout)["explain"]["tiers"].values()
        assert tier_answer["cause"] == "model" and tier_answer["neighbour_tokens"] == 79, tier_answer

        client = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-op", max_retries=0, timeout=120)
        text = "the quick brown fox jumps over the lazy dog " * 10
        client.completions.create(model="tiny", prompt=text, max_tokens=1, extra_body={"cache_salt": "alice"})
        body = {"prompt": text, "explain": True}
        headers = {"Authorization": "Bearer sk-op"}
        for _ in range(50):  # the store lands on the store thread, just after the answer
            salted = httpx.post(server.url + "/kv/lookup", json={**body, "cache_salt": "alice"}, headers=headers,
                                timeout=60).json()
            if salted["max_hit_tokens"]:
                break
        [hit] = salted["explain"]["tiers"].values()
        assert hit["cause"] == "hit", salted
        plain = httpx.post(server.url + "/kv/lookup", json=body, headers=headers, timeout=60).json()
        [miss] = plain["explain"]["tiers"].values()
        assert miss["cause"] == "tenant" and miss["asked"]["tenant"] is None, miss
        ran = cli("--url", server.url, "--api-key", "sk-op", text)
        assert ran.returncode == 0 and "tenant" in ran.stdout, ran.stdout + ran.stderr
        bob = httpx.post(server.url + "/kv/lookup", json=body, headers={"Authorization": "Bearer sk-bob"},
                         timeout=60).json()  # a tenant's key is told nothing of alice's entries
        assert [t["cause"] for t in bob["explain"]["tiers"].values()] == ["not_stored"], bob
    finally:
        assert server.stop() == 0, server.log()[-3000:]
