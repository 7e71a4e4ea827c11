"""CacheBlend (docs/architecture.md, "CacheBlend"): reuse the K/V of prompt segments wherever
they appear, with a selective recompute that restores cross-segment attention.

It is a variation of the connector's two halves, not a connector of its own: with
`blend.enabled`, the scheduler side hands segmented prompts to `planner.BlendPlanner` and the
worker side runs their blends with `blender.Blender`.
"""

from connector.blend.config import BlendConfig

__all__ = ["BlendConfig"]
