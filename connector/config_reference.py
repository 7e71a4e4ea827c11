"""The tables of docs/configuration.md, rendered from the code's tables (`all_settings()`,
`PROCESS_SETTINGS`, `LMCACHE_KEYS`), so the reference cannot drift: a test compares them with the file, and
`python -m connector.config_reference docs/configuration.md` rewrites them in place.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from connector.connector_config import all_settings
from connector.lmcache_compat import IGNORE, LMCACHE_KEYS, MAP
from kvsettings import PROCESS_SETTINGS


def settings_table() -> str:
    """Returns the markdown table of every config key: key, variable, default, meaning."""
    rows = ["| key | environment variable | default | meaning |", "|---|---|---|---|"]
    for s in all_settings():
        env = f"`{s.env}`" + "".join(f" (or `{a}`)" for a in s.aliases)
        rows.append(f"| `{s.key}` | {env} | `{s.default}` | {s.meaning} |")
    return "\n".join(rows)


def process_table() -> str:
    """Returns the markdown table of the `KVTIER_*` variables that set no config key (`kvsettings.ProcessEnv`)."""
    rows = ["| environment variable | default | meaning |", "|---|---|---|"]
    for s in PROCESS_SETTINGS:
        rows.append(f"| `{s.env}` | `{s.default}` | {s.meaning} |")
    return "\n".join(rows)


def lmcache_table() -> str:
    """Returns the markdown table of every LMCache key kvtier knows and what it becomes."""
    what = {MAP: "mapped", IGNORE: "ignored (warning)", "unsupported": "error unless off"}
    rows = ["| LMCache key | treatment | kvtier | note |", "|---|---|---|---|"]
    for k in LMCACHE_KEYS:
        rows.append(f"| `{k.name}` | {what[k.treatment]} | {k.kvtier} | {k.note} |")
    return "\n".join(rows)


BLOCKS = {"settings": settings_table, "process": process_table, "lmcache": lmcache_table}


def _block(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- generated:{name} -->\n).*?(<!-- end generated:{name} -->)", re.S)


def render(text: str) -> str:
    """Returns `text` with every generated block replaced by the current table."""
    for name, table in BLOCKS.items():
        text = _block(name).sub(lambda m, t=table: m.group(1) + t() + "\n" + m.group(2), text)  # type: ignore[misc]
    return text


def main(argv: list[str]) -> int:
    path = Path(argv[0] if argv else "docs/configuration.md")
    path.write_text(render(path.read_text(encoding="utf-8")), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
