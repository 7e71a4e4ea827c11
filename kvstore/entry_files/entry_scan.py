"""Listing a directory of entry files: which of its names are entries, and which are temp
files a write left behind (a crash, a dead writer), which are removed. The one place the disk
tier and the cache server's spill list a directory of entries (tests/test_file_rules.py).

Only regular files are listed or removed. A name of either kind that holds anything else (a
directory, a FIFO, a device, a link: placed by hand or by another program) is skipped, never
opened (a FIFO would block), followed or removed: it is not ours to judge. `scan` (a full
listing, at open or a recount) warns of each; `names` (a listing repeated as entries come and
go) passes over them silently, and costs no stat beyond what the directory read gives.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FoundFile:
    """A regular file `scan` kept: its name, path, size and mtime (the LRU order across restarts)."""

    name: str
    path: Path
    size: int
    mtime: float


def _never(name: str) -> bool:
    return False


def scan(directory: Path, keep: Callable[[str], bool], stray: Callable[[str], bool] = _never,
         owner: str = "entry files") -> list[FoundFile]:
    """Returns the regular files of `directory` whose name `keep` accepts, oldest mtime first
    (ties by name), and removes those whose name `stray` accepts (asked first); a name either
    accepts that is not a regular file is skipped with a warning naming `owner`. Names neither
    accepts are left alone. A file that vanishes meanwhile, or cannot be removed, is passed over."""
    found: list[FoundFile] = []
    with os.scandir(directory) as it:
        for entry in it:
            is_stray = stray(entry.name)
            if not is_stray and not keep(entry.name):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):
                log.warning("%s: skipping %s: not a regular file", owner, entry.path)
            elif is_stray:
                remove(Path(entry.path))
            else:
                found.append(FoundFile(entry.name, Path(entry.path), st.st_size, st.st_mtime))
    found.sort(key=lambda f: (f.mtime, f.name))  # ties by name: the same order on every scan
    return found


def names(directory: Path, keep: Callable[[str], bool]) -> list[str]:
    """Returns the names `keep` accepts of the regular files of `directory` (a link is not
    followed: it is not a regular file here), in directory order; anything else is passed
    over. The file type is the directory read's own where the file system gives it (no stat
    per file), else one lstat; a file that vanishes meanwhile is passed over."""
    found: list[str] = []
    with os.scandir(directory) as it:
        for entry in it:
            if keep(entry.name) and _is_regular(entry):
                found.append(entry.name)
    return found


def _is_regular(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_file(follow_symlinks=False)
    except OSError:
        return False


def remove(path: Path) -> OSError | None:
    """Removes file `path` if present; returns the error if that failed."""
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        return exc
    return None
