"""CacheBlend settings (the `blend:` section of the connector config), each key declared once in
its field: type, default, meaning and `KVTIER_BLEND_*` variable. Light (the standard library and
kvsettings): the command line reads these while it builds its parsers."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from kvsettings import Setting, did_you_mean, env_bool, env_float, env_int, env_raw, env_str, field_settings, opt

if TYPE_CHECKING:
    from engine.kv_cache import KeyedModel
    from engine.model_config import ModelConfig

DEFAULT_SEPARATOR = " # # "  # LMCache's blend_special_str


def _env_narrowing(var: str, text: str) -> list[tuple[int, float]]:
    steps = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        layer, sep, ratio = item.partition(":")
        if not sep:
            raise ValueError(f"{var}: expected layer:ratio pairs like 8:0.1,16:0.05, got {text!r}")
        steps.append((env_int(var, layer), env_float(var, ratio)))
    return steps


@dataclass
class BlendConfig:
    """`ratio`: fraction of the blended tokens recomputed past `check_layer` (0 = plain reuse of
    the cached K/V, 1 = full prefill). `narrowing`: optional `[layer, ratio]` steps, later layers
    and smaller ratios, that shrink the recomputed set further. `separator`: string prompts are
    split into segments on it (None: only list / `segment_lens` prompts are segmented).
    `segment_kv`: how a segment missing from every tier gets its K/V: `in_context` recomputes it
    through every layer inside the prompt that first uses it (so a cold prompt is a full
    prefill) and stores that; `standalone` computes it as a sequence of its own, as LMCache
    precomputes chunks. In-context K/V carry what a segment draws from a preceding context and
    blend far closer to a full prefill (docs/results.md, "CacheBlend quality and speed"); the
    two are stored under different keys."""

    enabled: bool = field(default=False, metadata=opt(
        "CacheBlend: reuse each prompt segment's K/V wherever it appears, recomputing a few tokens",
        env="KVTIER_BLEND_ENABLED", parse=env_bool))
    ratio: float = field(default=0.15, metadata=opt(
        "fraction of blended tokens recomputed past `check_layer` (0 = plain reuse, 1 = full prefill)",
        env="KVTIER_BLEND_RATIO", parse=env_float))
    check_layer: int = field(default=1, metadata=opt(
        "layer at which the tokens to recompute are selected", env="KVTIER_BLEND_CHECK_LAYER", parse=env_int))
    separator: str | None = field(default=DEFAULT_SEPARATOR, metadata=opt(
        "string prompts are split into segments on it", env="KVTIER_BLEND_SEPARATOR", parse=env_raw,
        shown=repr(DEFAULT_SEPARATOR)))
    narrowing: list[tuple[int, float]] = field(default_factory=list, metadata=opt(
        "later `[layer, ratio]` steps that shrink the recomputed set (env: `8:0.1,16:0.05`)",
        env="KVTIER_BLEND_NARROWING", parse=_env_narrowing, shown="[]"))
    segment_kv: str = field(default="in_context", metadata=opt(
        "how an uncached segment's K/V is made: in_context or standalone", env="KVTIER_BLEND_SEGMENT_KV",
        parse=env_str))

    def validate(self, num_layers: int | None = None) -> BlendConfig:
        """Returns self after checking every field; raises ValueError naming the key."""
        from kvkeys.keyspace import SEGMENT_ROOTS  # the segment kinds' home (it imports torch)

        if not isinstance(self.enabled, bool):
            raise ValueError(f"blend.enabled: expected bool, got {self.enabled!r}")
        if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)) or not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"blend.ratio: expected a number in [0, 1], got {self.ratio!r}")
        self.ratio = float(self.ratio)
        if isinstance(self.check_layer, bool) or not isinstance(self.check_layer, int) or self.check_layer < 0:
            raise ValueError(f"blend.check_layer: expected an int >= 0, got {self.check_layer!r}")
        if num_layers is not None and self.check_layer >= num_layers:
            raise ValueError(f"blend.check_layer: {self.check_layer} is not below the model's {num_layers} layers")
        if self.separator is not None and (not isinstance(self.separator, str) or not self.separator):
            raise ValueError(f"blend.separator: expected a non-empty str or null, got {self.separator!r}")
        if self.segment_kv not in SEGMENT_ROOTS:
            raise ValueError(f"blend.segment_kv: expected one of {', '.join(SEGMENT_ROOTS)}, "
                             f"got {self.segment_kv!r}")
        steps: list[tuple[int, float]] = []
        prev_layer, prev_ratio = self.check_layer, self.ratio
        for i, step in enumerate(self.narrowing or []):
            if not isinstance(step, (list, tuple)) or len(step) != 2:
                raise ValueError(f"blend.narrowing[{i}]: expected [layer, ratio], got {step!r}")
            layer, ratio = step
            if isinstance(layer, bool) or not isinstance(layer, int) or layer <= prev_layer:
                raise ValueError(f"blend.narrowing[{i}]: layer {layer!r} must be an int above {prev_layer}")
            if num_layers is not None and layer >= num_layers:
                raise ValueError(f"blend.narrowing[{i}]: layer {layer} is not below the model's {num_layers} layers")
            if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 <= ratio <= prev_ratio:
                raise ValueError(f"blend.narrowing[{i}]: ratio {ratio!r} must be in [0, {prev_ratio}]")
            steps.append((layer, float(ratio)))
            prev_layer, prev_ratio = layer, float(ratio)
        self.narrowing = steps
        return self

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | bool | None) -> BlendConfig:
        """Returns a validated config from a YAML mapping (or a bare bool for `enabled`)."""
        if data is None:
            return cls().validate()
        if isinstance(data, bool):
            return cls(enabled=data).validate()
        if not isinstance(data, Mapping):
            raise ValueError(f"blend: expected a mapping, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        for key in data:
            if key not in known:
                raise ValueError(f"blend: unknown key {key!r}{did_you_mean(key, known)}; "
                                 f"valid keys: {', '.join(sorted(known))}")
        return cls(**dict(data)).validate()


BLEND_SETTINGS: tuple[Setting, ...] = field_settings(BlendConfig, prefix="blend.")
"""CacheBlend's keys (the `blend:` section), one row each, read from `BlendConfig`'s fields."""


def engine_model(model: KeyedModel) -> ModelConfig:
    """Returns `model` as kvtier's engine's `ModelConfig`, what CacheBlend recomputes with;
    ValueError for a model only vLLM runs."""
    from engine.model_config import ModelConfig

    if not isinstance(model, ModelConfig):
        raise ValueError("CacheBlend (blend.enabled) runs in kvtier's engine only")
    return model
