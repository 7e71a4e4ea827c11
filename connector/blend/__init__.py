"""CacheBlend (docs/architecture.md, "CacheBlend"): reuse the K/V of prompt segments wherever
they appear, with a selective recompute that restores cross-segment attention.

It is an extension of the connector's two halves (connector/extension.py), registered from
pyproject.toml (`kvtier.extensions`: `connector.blend.plugin:EXTENSION`), not a connector of its
own and not imported by the core: with `blend.enabled`, the scheduler side's extension is
`blend_planner.BlendPlanner`, which takes segmented prompts, and the worker side's is
`blender.Blender`, which runs their blends. `plugin` has what a user asks of a blending
connector: `blend_stats`, `stored_segment`, `set_blend`.
"""
