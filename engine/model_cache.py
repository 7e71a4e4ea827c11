"""Where kvtier keeps the checkpoints it converts (the default model, GGUF files), and
building one exactly once (under `file_lock`, which the CPU kernels' build holds too).

Concurrent first runs are safe: one builds under a file lock into a temp dir on the same
filesystem and renames it into place atomically; the others wait and reuse it. A dir is
complete once it exists: it only ever appears by that rename.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from kvsettings import ProcessEnv


def kvtier_home(home: Path | None = None) -> Path:
    """Returns `home`, else `$KVTIER_HOME`, else `~/.cache/kvtier` (not created; `kvsettings.ProcessEnv.home`)."""
    if home is not None:
        return Path(home).expanduser()
    return Path(ProcessEnv.read().home).expanduser()


def build_once(final: Path, build: Callable[[Path], None]) -> Path:
    """Returns `final`, first calling `build(staging)` to fill a fresh dir that is then renamed
    to `final`, unless `final` exists. A failed build leaves nothing behind."""
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(final.parent / f".{final.name}.lock"):
        if final.is_dir():  # another process finished while we waited
            return final
        staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
        try:
            build(staging / "out")
            os.replace(staging / "out", final)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return final


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Holds an exclusive lock on the file at `path` (created if absent) for the block; the OS
    releases it if this process dies, so a killed holder never leaves the next one waiting."""
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
