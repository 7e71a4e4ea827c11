"""The disk tier's file names: one file per stored key, `<key, percent-quoted>.kvc`."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import quote, unquote

SUFFIX = ".kvc"


def key_path(root: Path, key: str) -> Path:
    """Returns the file that stores `key` under `root`; ValueError if the name is too long."""
    name = quote(key, safe="") + SUFFIX
    if len(name) > 255:
        raise ValueError(f"key too long for a file name ({len(name)} > 255 bytes): {key[:40]}...")
    return root / name


def keys_with_prefix(root: Path, prefix: str) -> list[str]:
    """Returns the keys of the files under `root` whose key starts with `prefix`."""
    head = quote(prefix, safe="")
    return [unquote(e.name[: -len(SUFFIX)]) for e in os.scandir(root)
            if e.name.startswith(head) and e.name.endswith(SUFFIX)]
