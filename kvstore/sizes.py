"""Human-readable byte sizes ("4GiB", "512MB"): the one parser for config files and CLIs.

Standard library only, so the cache server's command line can use it without importing torch.
"""

from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | str | None, key: str = "size") -> int | None:
    """Returns a byte count for `value` ("4GiB", "512MB", "1.5G", 1024, None -> None).

    KB/MB/GB are decimal, KiB/MiB/GiB and bare K/M/G binary. Raises ValueError naming `key`
    for a negative or malformed size.
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"{key}: expected a size like '4GiB' or an integer, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{key}: size must be >= 0, got {value}")
        return value
    if not isinstance(value, str):
        raise ValueError(f"{key}: expected a size like '4GiB' or an integer, got {value!r}")
    m = _SIZE_RE.match(value)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{key}: invalid size {value!r} (use e.g. 4GiB, 512MiB, 100MB or a byte count)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
