"""The import rules of docs/architecture.md ("Layout and import rules"), read from every shipped
module's source: which of kvtier's packages each package may import, which third-party modules
(`THIRD_PARTY`, the doc's table), that only connector/vllm/ knows vLLM, and that no module is
over `MAX_LINES` lines. Imports under `if TYPE_CHECKING:` and inside functions count too: a rule
broken for the type checker or on first use is still broken. And its module map names every
shipped module."""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.process import run

REPO = Path(__file__).resolve().parents[1]
OURS = ("hostmem", "kvkeys", "kvsettings", "kvstore", "engine", "connector", "kvtier")
ALLOWED = {
    "hostmem": set(),
    "kvkeys": set(),
    "kvsettings": set(),
    "kvstore": {"hostmem", "kvkeys", "kvsettings"},
    "engine": {"hostmem", "kvkeys", "kvsettings"},
    "connector": {"hostmem", "kvkeys", "kvsettings", "kvstore", "engine"},
    "kvtier": {"hostmem", "kvkeys", "kvsettings", "kvstore", "engine", "connector"},
}
THIRD_PARTY = {
    "hostmem": set(),
    "kvkeys": {"torch", "numpy"},
    "kvsettings": set(),
    "kvstore": {"torch", "numpy", "redis", "cramjam", "xxhash", "blake3", "sortedcontainers", "yaml"},
    "engine": {"torch", "numpy", "safetensors", "tokenizers", "jinja2", "tqdm", "transformers", "gguf"},
    "connector": {"torch", "packaging", "prometheus_client", "vllm"},
    "kvtier": {"fastapi", "starlette", "uvicorn", "pydantic", "httpx", "anyio", "prometheus_client", "tqdm",
               "yaml", "vllm"},
}
"""The third-party modules (top-level import names) each package may import, beside the standard
library and kvtier's own packages (`ALLOWED`); docs/architecture.md's table says the same.
vllm is narrower still: `VLLM_ADAPTER`."""
MAX_LINES = 700
"""No shipped module is longer (docs/architecture.md: one concept per module)."""
VLLM_PACKAGE = "connector/vllm/"
VLLM_ADAPTER = {
    "connector/vllm/vllm_api.py",  # every vLLM name the connector uses, after the version check
    "connector/vllm/version.py",  # the version check itself
    "kvtier/vllm_cli.py",  # `kvtier-vllm serve`: vLLM's own command line, after that check
}


def imported(path: Path) -> list[tuple[int, str]]:
    """Returns (line, dotted module) of every import in `path`, absolute or resolved (a
    relative import as its own package)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: inside its own package
                out.append((node.lineno, path.relative_to(REPO).parts[0]))
            elif node.module:
                out.append((node.lineno, node.module))
    return out


def shipped() -> list[tuple[str, Path]]:
    """Returns (repo-relative path, path) of every shipped module."""
    return [(p.relative_to(REPO).as_posix(), p) for package in OURS for p in sorted((REPO / package).rglob("*.py"))]


def package_imports(package: str) -> Iterator[tuple[str, int, str, str]]:
    """Yields (repo-relative path, line, dotted name, top-level module) of every import in `package`."""
    for path in sorted((REPO / package).rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        for line, dotted in imported(path):
            yield rel, line, dotted, dotted.split(".")[0]


@pytest.mark.parametrize("package", OURS)
def test_each_package_imports_only_the_layers_below_it(package: str) -> None:
    broken = [f"{rel}:{line} imports {module}" for rel, line, _, module in package_imports(package)
              if module in OURS and module != package and module not in ALLOWED[package]]
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize("package", OURS)
def test_each_package_imports_only_its_listed_third_party_modules(package: str) -> None:
    broken = [f"{rel}:{line} imports {dotted}" for rel, line, dotted, module in package_imports(package)
              if module not in OURS and module not in sys.stdlib_module_names and module not in THIRD_PARTY[package]]
    listed = ", ".join(sorted(THIRD_PARTY[package])) or "none"
    assert not broken, (f"{package} may import only these third-party modules ({listed}; docs/architecture.md, "
                        "\"Layout and import rules\"):\n" + "\n".join(broken))


def doc_third_party() -> dict[str, set[str]]:
    """Returns docs/architecture.md's table of third-party imports: package -> module names."""
    rows: dict[str, set[str]] = {}
    for line in (REPO / "docs" / "architecture.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) == 2 and cells[0].strip("`") in OURS:
            names = {n.strip().strip("`") for n in cells[1].split(",")}
            rows[cells[0].strip("`")] = set() if names == {"none"} else names
    return rows


def test_the_doc_lists_the_same_third_party_modules() -> None:
    assert doc_third_party() == THIRD_PARTY


def test_the_third_party_rule_sees_imports_inside_functions(tmp_path: Path) -> None:
    """The check is not vacuous: an import inside a function, under TYPE_CHECKING or as a
    submodule is read like one at the top."""
    path = tmp_path / "m.py"
    path.write_text("import os\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a.b\n"
                    "def f():\n    from c.d import e\n    import numpy as np\n")
    tops = [dotted.split(".")[0] for _, dotted in imported(path)]
    assert [t for t in tops if t not in sys.stdlib_module_names] == ["a", "c", "numpy"]


def test_no_shipped_module_is_over_the_line_limit() -> None:
    long = [f"{rel}: {n} lines" for rel, path in shipped()
            if (n := len(path.read_text().splitlines())) > MAX_LINES]
    assert not long, f"no shipped module over {MAX_LINES} lines (split it at a real seam):\n" + "\n".join(long)


def test_only_the_vllm_package_knows_vllm() -> None:
    """Everything vLLM-specific lives in connector/vllm/ (docs/vllm.md): only its edge
    (`VLLM_ADAPTER`) imports vllm, and no module outside the package imports it, the
    `kvtier-vllm` entry point aside, so kvtier's core never depends on its vLLM adapter."""
    broken = []
    for rel, path in shipped():
        inside = rel.startswith(VLLM_PACKAGE) or rel == "kvtier/vllm_cli.py"
        for line, dotted in imported(path):
            if dotted.split(".")[0] == "vllm" and rel not in VLLM_ADAPTER:
                broken.append(f"{rel}:{line} imports vllm (only {', '.join(sorted(VLLM_ADAPTER))} may)")
            if (dotted == "connector.vllm" or dotted.startswith("connector.vllm.")) and not inside:
                broken.append(f"{rel}:{line} imports {dotted}: nothing outside {VLLM_PACKAGE} may")
    assert not broken, "\n".join(broken)


def test_no_core_module_imports_cacheblend() -> None:
    """CacheBlend is a plug-in (connector/extension.py): pyproject.toml registers it, and no
    shipped module outside connector/blend/ imports it, not even inside a function."""
    broken = [f"{rel}:{line} imports {dotted}" for rel, path in shipped() if not rel.startswith("connector/blend/")
              for line, dotted in imported(path) if dotted.split(".")[:2] == ["connector", "blend"]]
    assert not broken, "only connector/blend/ imports connector.blend:\n" + "\n".join(broken)


def test_the_cache_server_package_never_imports_torch() -> None:
    """`kvtier cache-server` runs on machines without torch: importing every module of its
    package (kvstore/cache_server/) in a fresh interpreter loads no torch. Its client is the
    tier's (kvstore/backends/server_client.py), which checks K/V values."""
    modules = sorted(f"kvstore.cache_server.{p.stem}" for p in (REPO / "kvstore" / "cache_server").glob("*.py"))
    code = f"import sys, importlib; [importlib.import_module(m) for m in {modules!r}]; " \
           "print(sorted(m for m in ('torch',) if m in sys.modules))"
    out = run([sys.executable, "-c", code], timeout=120, capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_no_two_shipped_modules_share_a_name() -> None:
    """A module's file name says what it holds, once: a reader who meets `metrics.py` or `app.py`
    never has to ask which one (package `__init__.py` files aside)."""
    by_name: dict[str, list[str]] = {}
    for rel, _ in shipped():
        name = rel.rsplit("/", 1)[-1]
        if name != "__init__.py":
            by_name.setdefault(name, []).append(rel)
    clashes = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert not clashes, "modules sharing a file name: " + "; ".join(f"{', '.join(p)}" for p in clashes.values())


def test_presence_is_one_class() -> None:
    """"Is this chunk held?" has one name: connector/presence.py's `Presence` is the only class
    whose name says presence, in the shipped packages, tests, benchmarks and examples. What it
    asks (its `HeldKeys` sources) is named for where it asks, never as a second presence."""
    where = [p for package in (*OURS, "tests", "benchmarks", "examples")
             for p in sorted((REPO / package).rglob("*.py"))]
    named = [(p.relative_to(REPO).as_posix(), node.lineno, node.name) for p in where
             for node in ast.walk(ast.parse(p.read_text(), filename=str(p)))
             if isinstance(node, ast.ClassDef) and "presence" in node.name.lower()]
    assert [(rel, name) for rel, _, name in named] == [("connector/presence.py", "Presence")], \
        "one class says presence, connector/presence.py's Presence; found:\n" + \
        "\n".join(f"{rel}:{line} {name}" for rel, line, name in named)


def test_the_module_map_names_every_shipped_module() -> None:
    """docs/architecture.md's module map names each shipped module by its path, and names no
    module that is gone."""
    text = (REPO / "docs" / "architecture.md").read_text()
    modules = {rel for rel, _ in shipped()}
    unnamed = sorted(p for p in modules if f"`{p}`" not in text)
    assert not unnamed, "not in docs/architecture.md's module map: " + ", ".join(unnamed)
    named = {m.split("`")[0] for m in text.split("\n- `")[1:] if m.split("`")[0].endswith(".py")}
    gone = sorted(p for p in named if p.split("/")[0] in OURS and p not in modules)
    assert not gone, "named in docs/architecture.md's module map but not shipped: " + ", ".join(gone)
