"""Writing an entry file atomically: its bytes go to a temp file, optionally fsync'd, which is
then renamed over the entry's name, so a reader sees the old file or the whole new one, and a
crash leaves at most a stray temp file (entry_scan.py removes those).

The steps are separate because the disk tier reserves room for a write under its directory's
lock, creating the temp file there, and writes the bytes outside it; `write_atomically` is all
of them in one call (the spill's writes).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

Bytes = bytes | bytearray | memoryview
"""What a file is written from (kvstore.codecs' Buffer, which this torch-free layer cannot import)."""
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW


def create_temp(tmp: Path, exclusive: bool = True) -> int:
    """Creates temp file `tmp` for writing (mode 0644, never through a link); returns its
    descriptor. `exclusive`: OSError if the name exists (a writer whose temp names are unique
    never meets one); else a file left at the name (an interrupted write's) is truncated and
    reused. Raises OSError as os.open does."""
    return os.open(tmp, _CREATE | (os.O_EXCL if exclusive else os.O_TRUNC), 0o644)


def write_all(fd: int, parts: Sequence[Bytes]) -> None:
    """Writes `parts` in order to file `fd` at its position (raw writes may be short: each is
    finished); raises OSError as the writes do, leaving `fd` open."""
    for part in parts:
        view = memoryview(part).cast("B")
        while view:
            view = view[os.write(fd, view):]


def write_parts(fd: int, parts: Sequence[Bytes], fsync: bool) -> None:
    """Writes `parts` in order to the new file `fd`, fsync'd if `fsync`, and closes it. Raises
    OSError as the writes do; `fd` is closed either way."""
    try:
        write_all(fd, parts)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def install(tmp: Path, path: Path) -> None:
    """Renames the written temp file `tmp` over `path` (atomic within one file system)."""
    os.replace(tmp, path)


def discard(tmp: Path) -> None:
    """Removes temp file `tmp` after a failed write, best effort (one left behind is a stray
    temp file, which its owner's next scan removes: entry_scan.py)."""
    try:
        tmp.unlink(missing_ok=True)
    except OSError:
        pass


def write_atomically(path: Path, tmp: Path, parts: Sequence[Bytes], fsync: bool = False,
                     exclusive: bool = True) -> None:
    """Writes `parts` to `path` through temp file `tmp` (`create_temp`, `write_parts`,
    `install`); on failure removes `tmp` and raises the OSError, `path` unchanged."""
    fd = create_temp(tmp, exclusive)
    try:
        write_parts(fd, parts, fsync)
        install(tmp, path)
    except OSError:
        discard(tmp)
        raise
