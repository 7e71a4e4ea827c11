"""CacheBlend (docs/architecture.md, "CacheBlend"): reuse the K/V of prompt segments wherever
they appear, with a selective recompute that restores cross-segment attention.

It is an extension of the connector's two halves (connector/extension.py), not a connector of
its own: with `blend.enabled`, the scheduler side's extension is `planner.BlendPlanner`, which
takes segmented prompts, and the worker side's is `blender.Blender`, which runs their blends.
"""

from connector.blend.blend_config import BlendConfig

__all__ = ["BlendConfig"]
