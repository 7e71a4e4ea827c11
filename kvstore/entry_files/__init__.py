"""One file per entry in a directory: the file layer shared by the `disk` tier
(kvstore/backends/disk/) and the cache server's disk spill (kvstore/cache_server/spill.py).

Both keep each entry in a file of its own, written under a temp name and renamed into place,
and read back checked; this package is the one implementation of that, and the only code of
either that creates, writes, renames, opens or lists an entry file (tests/test_file_rules.py holds
both to it, and this package to the standard library). It imports only the standard library,
because the cache server never imports torch (the disk tier's values are torch-backed; their
bytes are not).

- entry_names.py: naming an entry's file from its key (percent-quoted, or a digest for keys
  of arbitrary bytes) and a write's temp name beside it;
- atomic_write.py: writing a file's bytes under a temp name, optionally fsync'd, then renaming
  it into place (a crash leaves a stray temp file, never a half-written entry);
- entry_reads.py: opening an entry file only if it is a regular file (never following a link,
  never blocking on a FIFO) and reading it in pieces a caller checks as they arrive, or
  straight into the caller's memory; a file that ends early reads short, never padded;
- entry_scan.py: listing a directory's entry files, the one listing either owner does
  (regular files only, no link followed: anything else is skipped, with a warning in a full
  scan), and removing stray temp files.

What is not shared stays with its owner, because only it needs it: each owner's file format
and its check (the disk tier's is a serde value behind a header that aligns its payload,
checked by serde's checksum and key tag; the spill's is its own frame of key and opaque value
with a CRC-32), the disk tier's shared directory account and its temp names that carry
reservations, the spill's worker thread, generations and pending writes. The formats did not
change when this layer was split out: files either wrote before are read as before.
"""
