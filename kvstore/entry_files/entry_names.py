"""The name of an entry's file, from its key, and the temp name a write of it uses.

Two ways to name, for two kinds of key: a text key that fits a file name is percent-quoted,
so the name alone says the key (the disk tier lists and deletes by key prefix from names);
a key of arbitrary bytes (the cache server's) is named by its SHA-256 digest, its key kept
inside the file, which the reader compares.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from urllib.parse import quote, unquote

NAME_MAX = 255
"""The longest file name (bytes) the file systems we run on accept."""
TEMP_SUFFIX = ".tmp"
"""What `temp_beside` appends to an entry file's name."""


def quoted_name(key: str, suffix: str) -> str:
    """Returns the file name of text `key`: the key percent-quoted, then `suffix`; ValueError
    when that is longer than a file name may be."""
    name = quote(key, safe="") + suffix
    if len(name) > NAME_MAX:
        raise ValueError(f"key too long for a file name ({len(name)} > {NAME_MAX} bytes): {key[:40]}...")
    return name


def quoted_prefix(prefix: str) -> str:
    """Returns how the names `quoted_name` gives the keys starting with `prefix` start."""
    return quote(prefix, safe="")


def quoted_key(name: str, suffix: str) -> str:
    """Returns the key that `quoted_name` named `name` (a name ending in `suffix`)."""
    return unquote(name[: -len(suffix)])


def digest_name(key: bytes, suffix: str) -> str:
    """Returns the file name of a key of arbitrary bytes: its SHA-256, hex, then `suffix`."""
    return hashlib.sha256(key).hexdigest() + suffix


def temp_beside(path: Path) -> Path:
    """Returns the temp name of a write of `path`: its name plus TEMP_SUFFIX, in its directory
    (for a directory with one writer; writers that share one name theirs apart)."""
    return path.with_name(path.name + TEMP_SUFFIX)
