"""CacheBlend (docs/architecture.md, "CacheBlend"): reuse the K/V of prompt segments wherever
they appear, with a selective recompute that restores cross-segment attention.

`BlendConfig` is imported eagerly (the connector config embeds it); the connector lazily, so
`connector.config` can import this package without a cycle.
"""

from typing import Any

from connector.blend.config import BlendConfig

__all__ = ["BlendConfig", "BlendConnector", "build_blend_connector"]


def __getattr__(name: str) -> Any:
    if name in ("BlendConnector", "build_blend_connector"):
        from connector.blend import blend_connector

        return getattr(blend_connector, name)
    raise AttributeError(f"module 'connector.blend' has no attribute {name!r}")
