"""The import rules of docs/architecture.md ("Import rules"), read from every shipped module's
source: which of kvtier's packages each package may import, and that only the vLLM edge
(three modules) imports vllm. Imports under `if TYPE_CHECKING:` count too: a rule broken for the type checker
is a cycle waiting for the next refactor."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
OURS = ("hostmem", "kvstore", "engine", "connector", "kvtier")
ALLOWED = {
    "hostmem": set(),
    "kvstore": {"hostmem"},
    "engine": {"hostmem"},
    "connector": {"hostmem", "kvstore", "engine"},
    "kvtier": {"hostmem", "kvstore", "engine", "connector"},
}
VLLM_ADAPTER = {
    "connector/vllm_api.py",  # every vLLM name the connector uses, after the version check
    "connector/vllm_version.py",  # the version check itself
    "kvtier/vllm_cli.py",  # `kvtier-vllm serve`: vLLM's own command line, after that check
}


def imported(path: Path) -> list[tuple[int, str]]:
    """Returns (line, top-level module) of every import in `path`, absolute or resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: inside its own package
                out.append((node.lineno, path.relative_to(REPO).parts[0]))
            elif node.module:
                out.append((node.lineno, node.module.split(".")[0]))
    return out


@pytest.mark.parametrize("package", OURS)
def test_each_package_imports_only_the_layers_below_it(package: str) -> None:
    broken = []
    for path in sorted((REPO / package).rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        for line, module in imported(path):
            if module in OURS and module != package and module not in ALLOWED[package]:
                broken.append(f"{rel}:{line} imports {module}")
            if module == "vllm" and rel not in VLLM_ADAPTER:
                broken.append(f"{rel}:{line} imports vllm (only {', '.join(sorted(VLLM_ADAPTER))} may)")
    assert not broken, "\n".join(broken)
