"""What each name in a disk tier directory says; the one owner of those names.

- a chunk file: `<key, percent-quoted>.kvc`, one per stored key (named by the file-per-entry
  layer, kvstore/entry_files/entry_names.py, which names the cache server's spill files too);
- a temp file: `.tmp-<pid>-<bytes>-<id>[.<tenant tag>]`, a write in progress, its name
  carrying the writer's pid and the bytes it reserved (and, for a salted key, its tenant), so
  that a recount by any process keeps live writers' reservations and spots dead writers' files;
- the state file (`.kvtier-dir`) is named by its owner, dir_account.py.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from kvstore.entry_files import entry_scan
from kvstore.entry_files.entry_names import quoted_key, quoted_name, quoted_prefix

SUFFIX = ".kvc"
"""A chunk file's name ends so; its key is the rest, percent-unquoted."""
TEMP_PREFIX = ".tmp-"
"""A temp file's name starts so."""


def key_path(root: Path, key: str) -> Path:
    """Returns the file that stores `key` under `root`; ValueError if the name is too long."""
    return root / quoted_name(key, SUFFIX)


def file_key(name: str) -> str:
    """Returns the key stored in the chunk file called `name` (one ending in SUFFIX)."""
    return quoted_key(name, SUFFIX)


def keys_with_prefix(root: Path, prefix: str) -> list[str]:
    """Returns the keys of the chunk files under `root` whose key starts with `prefix`
    (regular files only, listed by the file-per-entry layer: kvstore/entry_files/entry_scan.py)."""
    head = quoted_prefix(prefix)
    return [file_key(name) for name in entry_scan.names(root, lambda n: n.startswith(head) and n.endswith(SUFFIX))]


def tenant_temp_names(root: Path, tag: str) -> list[str]:
    """Returns the names of the temp files under `root` written for tenant `tag` (regular
    files only, listed by the file-per-entry layer)."""
    return entry_scan.names(root, lambda n: n.startswith(TEMP_PREFIX) and n.endswith(f".{tag}"))


def temp_path(root: Path, nbytes: int, tag: str | None) -> Path:
    """Returns a fresh temp file path under `root` for this process's write of `nbytes` bytes,
    naming tenant `tag` if any (its quota then counts the reservation)."""
    return root / f"{TEMP_PREFIX}{os.getpid()}-{nbytes}-{uuid.uuid4().hex}{'.' + tag if tag else ''}"


def live_reservation(name: str) -> int | None:
    """Returns the bytes reserved by temp file `name` (one starting with TEMP_PREFIX) if its
    writer is alive; None for a dead writer's file or a name that encodes no reservation."""
    parts = name[len(TEMP_PREFIX):].split("-")
    if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit():
        return None
    return int(parts[1]) if _pid_alive(int(parts[0])) else None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True
