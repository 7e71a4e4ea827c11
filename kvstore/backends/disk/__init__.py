"""The `disk` tier (`disk:///path`): one file per chunk under a directory, a byte budget shared
by every process using the directory. One module owns each piece of its state:

- disk_tier.py: `DiskBackend`, the storage contract; this process's index of the files and
  their eviction order, and every change to the directory (under the account's flock);
- dir_account.py: the directory's shared account, the state file `.kvtier-dir` (bytes used,
  budget), read and written under its flock;
- file_names.py: what each name in the directory says (chunk files, writers' temp files);
- file_format.py: a chunk file's bytes (a file header placing the value's payload on a cache line);
- file_io.py: reading and writing one chunk file's bytes, checked as they are read.
"""

from kvstore.backends.disk.dir_account import STATE_BYTES, STATE_FILE
from kvstore.backends.disk.disk_tier import DiskBackend

__all__ = ["STATE_BYTES", "STATE_FILE", "DiskBackend"]
