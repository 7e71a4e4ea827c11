"""Shared fixtures live in tests/fixtures/ (one module per real part they start).

`make test` runs the suite on two xdist workers, one test file per worker at a time
(`-n 2 --dist loadfile --no-loadscope-reorder`); the two hooks below are what make that pay."""

from __future__ import annotations

import importlib.util
import os

import pytest
from hypothesis import settings

# Hypothesis fails an example slower than 200 ms by default: a wall-clock assertion, which
# tests here never make (a busy machine is not a bug; speed lives in benchmarks/).
settings.register_profile("kvtier", deadline=None)
settings.load_profile("kvtier")

# tests/vllm needs vLLM, which lives in its own virtualenv: `make test` runs them there
# (`make test-vllm`); a bare `pytest` in kvtier's environment leaves them out.
collect_ignore = [] if importlib.util.find_spec("vllm") else ["vllm"]

pytest_plugins = [
    "tests.fixtures.model",
    "tests.fixtures.cpu_kernels",
    "tests.fixtures.redis_server",
    "tests.fixtures.cache_server",
]


def pytest_configure(config: pytest.Config) -> None:
    """On an xdist worker: one torch thread here and in every process a test starts. Two
    workers on two cores each running two OpenMP threads spin-wait on each other's core,
    which made the engine tests 2.5x slower than one process alone."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"
        import torch

        torch.set_num_threads(1)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files with a `slow` test first, the rest after, each file whole and in its own order:
    handed out file by file in this order, the long files start early and the many short ones
    even out the end."""
    slow = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow)
