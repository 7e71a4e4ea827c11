"""The soak's parts (benchmarks/soak.py): the workload mix, one streamed request through the
openai client, the faults, and what is read from a server (/metrics, RSS); the cache server
is harness/cache_server.py's."""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from harness import process
from harness.cache_server import CacheServerProcess
from harness.text import PARAGRAPHS

REPO = Path(__file__).resolve().parents[1]

MODEL = "SmolLM2-135M-Instruct"
QUESTIONS = ["What is the first paragraph about?", "Summarise the text in one sentence.",
             "Which paragraphs mention water?", "Name one person from the text.", "What happens at dawn?",
             "Give a title for this text.", "What is the mood of the text?"]
TURNS = ["Tell me about your day.", "What did you learn from it?", "Why does that matter?",
         "Give an example.", "How would you explain it to a child?", "What would you do differently?"]
MAX_TOKENS = 32


# ---- the workload -----------------------------------------------------------------------
def _paragraphs(seed: int, n: int) -> str:
    return "\n\n".join(f"{PARAGRAPHS[(seed * 7 + i) % len(PARAGRAPHS)]}" for i in range(n))


# ~600 tokens each; together about twice what the engine's prefix cache holds, so the tiers serve them
DOCUMENTS = [f"Document {d}.\n\n" + _paragraphs(d, 14) for d in range(24)]


@dataclass
class Client:
    """One of the concurrent users: its own chat that grows (reset after a few turns), the
    shared documents (the first `documents` of DOCUMENTS), and unique prompts, chosen by a
    seeded mix."""

    index: int
    rng: random.Random
    documents: int = len(DOCUMENTS)
    chat: list[dict[str, str]] = field(default_factory=list)
    chats_started: int = 0
    unique: int = 0

    def next_request(self) -> tuple[str, dict[str, Any]]:
        """Returns (kind, request body without model/stream) for the next request."""
        r = self.rng.random()
        if r < 0.4:
            if not self.chat or len(self.chat) >= 11:  # system + 5 rounds
                self.chats_started += 1
                topic = f"client {self.index}, conversation {self.chats_started}"
                self.chat = [{"role": "system", "content": f"You are a helpful assistant ({topic}).\n\n"
                              + _paragraphs(self.index + self.chats_started, 4)}]
            self.chat.append({"role": "user", "content": TURNS[(len(self.chat) // 2) % len(TURNS)]})
            return "chat", {"messages": list(self.chat)}
        if r < 0.8:
            doc = self.rng.randrange(self.documents)
            q = self.rng.randrange(len(QUESTIONS))
            system = "Answer from this text.\n\n" + DOCUMENTS[doc]
            return "document", {"messages": [{"role": "system", "content": system},
                                             {"role": "user", "content": QUESTIONS[q]}]}
        self.unique += 1
        salt = f"{self.index}-{self.unique}-{self.rng.randrange(1 << 30)}"
        return "unique", {"prompt": f"Request {salt}.\n\n" + _paragraphs(self.rng.randrange(1000), 5) + "\n\nSummary:"}

    def answered(self, kind: str, text: str) -> None:
        if kind == "chat":
            self.chat.append({"role": "assistant", "content": text})


async def stream_request(client: openai.AsyncOpenAI, body: dict[str, Any],
                         max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    """Runs one greedy streamed request of `max_tokens`; returns its TTFT, inter-token gaps, text, cached
    tokens and prompt tokens (raises what the openai client raises)."""
    t0 = time.perf_counter()
    ttft: float | None = None
    last = t0
    gaps: list[float] = []
    text: list[str] = []
    usage: Any = None
    common = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "stream": True,
              "stream_options": {"include_usage": True}}
    if "messages" in body:
        stream = await client.chat.completions.create(messages=body["messages"], **common)
    else:
        stream = await client.completions.create(prompt=body["prompt"], **common)
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        piece = choice.delta.content if hasattr(choice, "delta") else choice.text
        if not piece:
            continue
        now = time.perf_counter()
        if ttft is None:
            ttft = now - t0
        else:
            gaps.append(now - last)
        last = now
        text.append(piece)
    details = getattr(usage, "prompt_tokens_details", None) if usage is not None else None
    return {"ttft": ttft if ttft is not None else time.perf_counter() - t0, "gaps": gaps, "text": "".join(text),
            "cached_tokens": int(getattr(details, "cached_tokens", 0) or 0),
            "prompt_tokens": int(getattr(usage, "prompt_tokens", 0) or 0), "e2e": time.perf_counter() - t0}


def reference_answer(url: str, body: dict[str, Any], max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    """Returns the greedy answer of a server for `body` with the top-2 logprobs of each token
    (`tokens`: [(token text, top-1 logprob, top-2 logprob)])."""
    common = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0}
    if "messages" in body:
        r = httpx.post(url + "/v1/chat/completions", json={**common, "messages": body["messages"],
                                                           "logprobs": True, "top_logprobs": 2}, timeout=600)
        r.raise_for_status()
        choice = r.json()["choices"][0]
        rows = [(t["token"], *_top2([x["logprob"] for x in t["top_logprobs"]]))
                for t in (choice.get("logprobs") or {}).get("content") or []]
        return {"text": choice["message"]["content"] or "", "tokens": rows}
    r = httpx.post(url + "/v1/completions", json={**common, "prompt": body["prompt"], "logprobs": 2}, timeout=600)
    r.raise_for_status()
    choice = r.json()["choices"][0]
    lp = choice.get("logprobs") or {}
    rows = [(tok, *_top2(list((top or {}).values()))) for tok, top in zip(lp.get("tokens") or [],
                                                                          lp.get("top_logprobs") or [])]
    return {"text": choice["text"], "tokens": rows}


def _top2(lps: list[float]) -> tuple[float, float]:
    s = sorted(lps, reverse=True) + [float("-inf")] * 2
    return s[0], s[1]


def divergence(answer: str, ref: dict[str, Any], tie_nats: float) -> str:
    """Returns "same", "near_tie" (the first different token is one the reference ranks within
    `tie_nats` of its best: float noise between batch shapes can flip it) or "wrong"."""
    if answer == ref["text"]:
        return "same"
    first = next((i for i, (a, b) in enumerate(zip(answer, ref["text"])) if a != b), min(len(answer), len(ref["text"])))
    pos = 0
    for tok, top1, top2 in ref["tokens"]:
        if pos + len(tok) > first:
            return "near_tie" if top1 - top2 <= tie_nats else "wrong"
        pos += len(tok)
    return "wrong"


# ---- what is read from a server --------------------------------------------------------
def rss_bytes(pid: int) -> int:
    """Returns VmRSS of process `pid` in bytes (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) << 10
    except OSError:
        pass
    return 0


def scrape(url: str, timeout: float = 10.0) -> dict[str, float]:
    """Returns /metrics samples by name, `name[tier]` or `name[tier,calls]` for labelled ones."""
    text = httpx.get(url + "/metrics", timeout=timeout).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = [s.labels[k] for k in ("tier", "calls") if k in s.labels]
            key = s.name + (f"[{','.join(labels)}]" if labels else "")
            out[key] = out.get(key, 0.0) + s.value
    return out


# ---- the faults -------------------------------------------------------------------------
def corrupt_in_place(redis_client: Any, disk_root: Path, rng: random.Random) -> str:
    """Flips one byte in the middle of a stored value, in place: one Redis key (SETRANGE) and
    one disk-tier file; returns what was hit."""
    hit = []
    keys = [k for k in redis_client.scan_iter(match="kvtier:*", count=1000)]
    if keys:
        key = rng.choice(keys)
        n = redis_client.strlen(key)
        off = n // 2
        old = redis_client.getrange(key, off, off)
        redis_client.setrange(key, off, bytes([old[0] ^ 0x5A]) if old else b"\x5a")
        hit.append(f"redis {key.decode(errors='replace')[:60]}@{off}")
    files = sorted(disk_root.glob("*.kvc"))
    if files:
        path = rng.choice(files)
        try:
            fd = os.open(path, os.O_RDWR)
            try:
                size = os.fstat(fd).st_size
                b = os.pread(fd, 1, size // 2)
                os.pwrite(fd, bytes([b[0] ^ 0x5A]) if b else b"\x5a", size // 2)
            finally:
                os.close(fd)
            hit.append(f"disk {path.name[:60]}@{size // 2}")
        except OSError as exc:
            hit.append(f"disk file gone ({exc})")
    return "; ".join(hit) or "nothing stored yet"


_FILL = """
import torch
from kvstore.backends.disk import DiskBackend
tier = DiskBackend({root!r}, byte_budget={budget})
kv = torch.randn(30, 2, 128, 3, 64)
need = {budget} // (kv.numel() * 4) + 2
for i in range(need):
    tier.put(f"kvtier:soak-fill:{{i}}", kv)
print(tier.stats().bytes_used, flush=True)
"""


def fill_disk(root: Path, budget: int) -> str:
    """Fills the disk tier's directory to its budget from another process (chunks of the same
    size as the server's); returns the bytes the directory then held."""
    out = process.run([sys.executable, "-c", _FILL.format(root=str(root), budget=budget)], cwd=REPO,
                      capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        return f"filler failed: {out.stderr[-500:]}"
    return f"directory filled by another process: {int(out.stdout.strip()) / 2**20:.0f} MiB"


def freeze(server: CacheServerProcess, seconds: float) -> str:
    assert server.proc is not None
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    return f"cache server SIGSTOPped for {seconds:g} s"


def dump(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=1, default=float))
