"""Progress bars for the slow parts a user waits on: preparing the default model, loading
weights, long prefills. One bar at a time, on stderr.

Shown only when stderr is a terminal and logger "kvtier.progress" is enabled for INFO: the
CLI's --log-level info or debug, or a program that never configured logging (a user at a
terminal). --log-level warning or error, or stderr redirected to a file or pipe, is quiet.
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.scheduler import ScheduledRequest
    from engine.sequence import Sequence

progress_logger = logging.getLogger("kvtier.progress")


def progress_enabled() -> bool:
    """Returns whether progress bars are shown now (see the module docstring)."""
    if not sys.stderr.isatty():
        return False
    if not logging.getLogger().handlers and progress_logger.getEffectiveLevel() == logging.WARNING:
        return True  # logging never configured: Python's default level says nothing about bars
    return progress_logger.isEnabledFor(logging.INFO)


def progress_bar(total: int, desc: str, unit: str, enabled: bool | None = None) -> Any:
    """Returns a tqdm bar on stderr (disabled unless `enabled`, default `progress_enabled()`);
    it clears itself when closed, so bars that follow take its place."""
    from tqdm import tqdm

    on = progress_enabled() if enabled is None else enabled
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B", unit_divisor=1024 if unit == "B" else 1000,
                file=sys.stderr, disable=not on, leave=False, dynamic_ncols=True)


@contextmanager
def library_bars_off() -> Iterator[None]:
    """Sends what libraries write to sys.stderr within the block to nowhere: their own
    progress bars (transformers' GGUF dequantising, weight loading and shard writing; not all
    of them honour transformers' switch) would interleave with ours, which holds the real
    stderr since it was created before. Log handlers keep their streams: records still show."""
    with contextlib.redirect_stderr(io.StringIO()):
        yield


class PrefillProgress:
    """One bar for a long prefill (a prompt that needs more than one step's token budget):
    the first such request in flight gets it; another waits until that bar closes."""

    def __init__(self, step_budget: int) -> None:
        self.step_budget = step_budget
        self._seq: Sequence | None = None
        self._bar: Any = None
        self._base = 0  # tokens cached when its prefill began

    def update(self, scheduled: list[ScheduledRequest]) -> None:
        """Advances the bar after a step (`scheduled` ran in it; their counts are updated);
        closes it when its request's prefill is done, and opens one for the next long one."""
        seq = self._seq
        if seq is not None:
            # (a preempted request restarts from 0: its bar waits at 0 until it is prefilled again)
            self._bar.n = max(0, min(seq.num_computed_tokens, seq.num_prompt_tokens) - self._base)
            self._bar.refresh()
            if seq.is_finished or seq.num_computed_tokens >= seq.num_prompt_tokens:
                self.close()
        if self._seq is not None:
            return
        for req in scheduled:
            s = req.seq
            base = req.num_computed_tokens  # before this step: the cached prefix, or what ran earlier
            if (not s.is_finished and s.num_computed_tokens < s.num_prompt_tokens
                    and s.num_prompt_tokens - base > self.step_budget):
                self._seq, self._base = s, base
                self._bar = progress_bar(s.num_prompt_tokens - base, f"prefill request {s.request_id}", "tok",
                                         enabled=True)
                self._bar.update(s.num_computed_tokens - base)
                return

    def close(self) -> None:
        """Closes the bar shown, if any."""
        if self._bar is not None:
            self._bar.close()
        self._seq, self._bar = None, None
