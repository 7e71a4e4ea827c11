"""`n > 1`: one request, n samples (vLLM's parent/child fan-out).

The parent request is never scheduled itself: its samples run as n child sequences (ids
`{i}_{parent id}`, vLLM's), each with its own generator (seed + i when seeded), so they share
the prompt's cached blocks through the prefix cache like any requests with one prefix. Their
outputs are merged into one `RequestOutput` under the parent's id, `outputs[i]` sample i's.
"""

from __future__ import annotations

from dataclasses import replace

from engine.outputs import RequestMetrics, RequestOutput
from engine.sequence import Sequence


class ParentRequest:
    """The children of one `n > 1` request and how their outputs merge."""

    def __init__(self, seq: Sequence) -> None:
        self.request_id = seq.request_id
        self.children = [
            Sequence(f"{i}_{seq.request_id}", list(seq.prompt_token_ids), seq.sampling_params.for_sample(i),
                     prompt=seq.prompt, arrival_time=seq.arrival_time, segment_lens=seq.segment_lens,
                     cache_salt=seq.cache_salt)
            for i in range(seq.sampling_params.n)
        ]

    def merge(self, outputs: list[RequestOutput]) -> RequestOutput:
        """Returns the parent's output from its children's (in child order): sample i as
        `outputs[i]`, finished when all are; prompt logprobs and cached tokens are sample 0's
        (the only one that computes prompt logprobs), preemptions summed."""
        first = outputs[0]
        metrics = [o.metrics for o in outputs if o.metrics is not None]
        merged_metrics = None
        if metrics:
            def earliest(times: list[float | None]) -> float | None:
                known = [t for t in times if t is not None]
                return min(known) if known else None

            finished = all(o.finished for o in outputs)
            merged_metrics = RequestMetrics(
                metrics[0].arrival_time,
                earliest([m.first_scheduled_time for m in metrics]),
                earliest([m.first_token_time for m in metrics]),
                max(m.finish_time or 0.0 for m in metrics) if finished else None)
        return RequestOutput(
            request_id=self.request_id, prompt=first.prompt, prompt_token_ids=first.prompt_token_ids,
            outputs=[replace(o.outputs[0], index=i) for i, o in enumerate(outputs)],
            finished=all(o.finished for o in outputs), num_cached_tokens=first.num_cached_tokens,
            metrics=merged_metrics, num_preemptions=sum(o.num_preemptions for o in outputs),
            prompt_logprobs=first.prompt_logprobs)


class ParentRequests:
    """The engine's live `n > 1` requests, by parent id and by child id."""

    def __init__(self) -> None:
        self._parents: dict[str, ParentRequest] = {}
        self._of_child: dict[str, ParentRequest] = {}

    def fan_out(self, seq: Sequence) -> list[Sequence]:
        """Registers `seq` (n > 1) as a parent; returns its child sequences to schedule."""
        if seq.request_id in self._parents:
            raise ValueError(f"request id {seq.request_id!r} is already in use")
        parent = ParentRequest(seq)
        self._parents[seq.request_id] = parent
        for child in parent.children:
            self._of_child[child.request_id] = parent
        return parent.children

    def parent_of(self, child_id: str) -> ParentRequest | None:
        return self._of_child.get(child_id)

    def pop(self, request_id: str) -> ParentRequest | None:
        """Forgets the parent `request_id` (finished or aborted); returns it, or None if that
        is no live parent."""
        parent = self._parents.pop(request_id, None)
        if parent is not None:
            for child in parent.children:
                self._of_child.pop(child.request_id, None)
        return parent

    def __len__(self) -> int:
        return len(self._parents)
