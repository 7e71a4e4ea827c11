"""kvtier's paged inference engine: `from engine import LLM, SamplingParams`.

`LLM` and the output types load lazily so that importing a light module (e.g.
`engine.block_pool`) does not pull in the model stack.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.llm import LLM
    from engine.outputs import CompletionOutput, RequestOutput

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    if name in ("RequestOutput", "CompletionOutput"):
        from engine import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
