"""Multi-round QA traces: sessions (a user over rounds) on shared documents, Zipf-popular.

Round r of a user's session sends: document + the user's earlier questions and answers + the
new question, so each round's prompt is a prefix of the next, and users on the same document
share its prefix. Arrivals are open-loop (fixed before the run), so the simulator and a real
client replay the same trace."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np


@dataclass(frozen=True)
class Workload:
    """What the clients send. `rate` is requests/s across the fleet."""

    users: int = 64
    rounds: int = 4
    docs: int = 16  # shared documents; 0 = every user has a private one (no reuse across users)
    zipf_s: float = 1.1  # popularity exponent over documents (0 = uniform)
    doc_tokens: int = 4096
    question_tokens: int = 64
    answer_tokens: int = 128
    think_s: float = 30.0  # mean gap between a user's rounds (exponential)
    rate: float = 1.0
    seed: int = 0

    def validate(self) -> None:
        """Raises ValueError naming the first out-of-range field."""
        if self.docs < 0:
            raise ValueError(f"workload: docs must be >= 0, got {self.docs}")
        for name in ("users", "rounds", "doc_tokens", "question_tokens", "answer_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"workload: {name} must be >= 1, got {getattr(self, name)}")
        if self.rate <= 0 or self.think_s < 0 or self.zipf_s < 0:
            raise ValueError("workload: rate must be > 0, think_s and zipf_s >= 0")


@dataclass(frozen=True)
class Request:
    """One request: who sends it, when, and its prompt: a document, then tokens of this user's
    own (earlier rounds and the new question), shared with nobody."""

    rid: int
    arrival_s: float
    user: int
    round: int
    doc: int
    doc_tokens: int
    user_tokens: int
    answer_tokens: int

    @property
    def prompt_tokens(self) -> int:
        return self.doc_tokens + self.user_tokens

    def block_keys(self, block: int) -> list[tuple[str, int, int]]:
        """Returns one key per full `block`-token block of the prompt; a key names the block's
        whole prefix (document blocks are shared by the document's users, the rest are the user's)."""
        return _block_keys(self, block)


@lru_cache(maxsize=8192)  # the simulator asks again at every routing, admission and store
def _block_keys(req: Request, block: int) -> list[tuple[str, int, int]]:
    return [("d", req.doc, j) if (j + 1) * block <= req.doc_tokens else ("u", req.user, j)
            for j in range(req.prompt_tokens // block)]


def zipf_weights(n: int, s: float) -> np.ndarray:
    """Returns the Zipf(s) probabilities of ranks 1..n."""
    w = 1.0 / np.arange(1, n + 1, dtype=float) ** s
    return w / w.sum()


def make_trace(w: Workload) -> list[Request]:
    """Returns the trace's requests by arrival time; the same workload (seed included) always
    gives the same trace."""
    w.validate()
    rng = np.random.default_rng(w.seed)
    if w.docs:
        docs = rng.choice(w.docs, size=w.users, p=zipf_weights(w.docs, w.zipf_s))
    else:
        docs = -1 - np.arange(w.users)
    session_rate = w.rate / w.rounds
    starts = np.cumsum(rng.exponential(1.0 / session_rate, size=w.users))
    reqs: list[tuple[float, int, int, int, int]] = []
    for u in range(w.users):
        t = float(starts[u])
        for r in range(w.rounds):
            if r:
                t += float(rng.exponential(w.think_s)) if w.think_s else 0.0
            user = r * (w.question_tokens + w.answer_tokens) + w.question_tokens
            reqs.append((t, u, r, int(docs[u]), user))
    reqs.sort()
    return [Request(i, t, u, r, d, w.doc_tokens, user, w.answer_tokens)
            for i, (t, u, r, d, user) in enumerate(reqs)]


def ideal_reuse(trace: list[Request], block: int) -> float:
    """Returns the fraction of prompt tokens an unbounded, shared cache could serve: for each
    request, the longest block-aligned prefix seen in an earlier prompt (capped one token short)."""
    seen_doc: set[int] = set()
    last_user: dict[int, int] = {}
    hit = total = 0
    for q in trace:
        best = 0
        if q.doc in seen_doc:
            best = q.doc_tokens
        if q.user in last_user:
            best = max(best, last_user[q.user])
        hit += min(best // block * block, q.prompt_tokens - 1)
        total += q.prompt_tokens
        seen_doc.add(q.doc)
        last_user[q.user] = q.prompt_tokens
    return hit / total if total else 0.0
