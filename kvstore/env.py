"""`KVTIER_*` environment variables: kvstore's name for the settings mechanism, whose home is
`kvsettings` (standard library only, below engine and kvstore: the engine declares settings too).
One declaration per key drives both the parsing and the configuration reference
(docs/configuration.md), so the two cannot drift. Kept for the modules that import the
mechanism from here; new code imports `kvsettings`."""

from __future__ import annotations

from kvsettings import Setting, env_bool, env_float, env_int, env_raw, env_str, field_settings, merge, parse_env

__all__ = ["Setting", "env_bool", "env_float", "env_int", "env_raw", "env_str", "field_settings", "merge",
           "parse_env"]
