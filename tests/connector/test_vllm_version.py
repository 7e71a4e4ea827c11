"""The vLLM version check: one clear error outside the supported range (no vLLM needed)."""

from __future__ import annotations

import pytest

from connector.vllm_version import SUPPORTED_VLLM, check_vllm_version


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu", "0.32.7", "0.32.1+cu128"])
def test_supported_versions_pass(version: str) -> None:
    check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.31.9", "0.33.0", "1.0.0", "0.32.0rc1", "dev", ""])
def test_other_versions_name_the_supported_range(version: str) -> None:
    with pytest.raises(RuntimeError, match="supports vLLM") as e:
        check_vllm_version(version)
    assert SUPPORTED_VLLM in str(e.value) and repr(version) in str(e.value) and "pip install" in str(e.value)
