"""CacheBlend (DESIGN §6): reuse the K/V of prompt segments wherever they appear, with a
selective recompute that restores cross-segment attention."""

from connector.blend.blend_connector import BlendConnector, build_blend_connector
from connector.blend.config import BlendConfig

__all__ = ["BlendConfig", "BlendConnector", "build_blend_connector"]
