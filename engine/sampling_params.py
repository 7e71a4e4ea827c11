"""Per-request sampling parameters (vLLM's `SamplingParams`, the subset this engine serves)."""

from __future__ import annotations

from dataclasses import dataclass, field

# Below this temperature sampling is treated as greedy (argmax), as in vLLM.
_GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    `temperature == 0` is greedy. `top_k <= 0` (or -1) and `top_p == 1.0` disable those filters.
    `seed` makes a sampled request reproducible regardless of what else is batched with it.
    Generation stops at an eos token (unless `ignore_eos`), at any of `stop_token_ids`, at any
    of the `stop` strings (matched on the decoded text, which is cut before the stop string
    unless `include_stop_str_in_output`), or after `max_tokens`; a stopping token is included
    in `token_ids` (vLLM behaviour).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.validate()

    def validate(self) -> None:
        """Raises ValueError naming the first invalid field."""
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise ValueError(f"temperature must be a number, got {self.temperature!r}")
        if not self.temperature >= 0.0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)):
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise ValueError(f"top_k must be an int (-1 or 0 disables it), got {self.top_k!r}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"stop_token_ids must be non-negative ints, got {t!r}")
        for stop in self.stop:
            if not isinstance(stop, str) or not stop:
                raise ValueError(f"stop must hold non-empty strings, got {stop!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS
