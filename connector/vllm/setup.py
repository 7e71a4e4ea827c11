"""What vLLM's configuration means to kvtier's connector: its settings, the model as chunks
are keyed for it, its KV cache groups, and the hit-source label of each tier
(docs/vllm.md). Never imports vllm: vLLM's objects are read by attribute.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from connector.connector_config import ConnectorConfig
from connector.extension import enabled_extension
from connector.presence import Presence
from connector.vllm.layouts import cpu_page_decoder
from connector.vllm.lookup_channel import LookupClient, lookup_socket_path
from engine.model_config import ModelConfig, weights_identity
from kvkeys.keyspace import Keyspace, dtype_name

_LAYER_INDEX = re.compile(r"\.(\d+)\.")

# vLLM's CacheHitSource member for each tier scheme: host memory, disk; a shared or remote store is
# what vLLM's enum calls unspecified (its P2P means another vLLM instance's blocks).
HIT_SOURCES = {"cpu": "HOST", "device": "DEVICE", "disk": "DISK"}
UNSPECIFIED = "EXTERNAL_UNSPECIFIED"


@dataclasses.dataclass(frozen=True)
class VllmModel:
    """A model as vLLM runs it, as the connector keys it: its identity (its config.json and
    weights, tagged with the engine and backend: numerics differ between engines), its
    attention layers and the shape of its K/V per layer."""

    fingerprint: str
    num_layers: int
    num_kv_heads: int
    head_size: int


def vllm_model(model_config: Any, backend: str) -> VllmModel:
    """Returns the connector's view of vLLM's `model_config` (a local checkpoint dir): any
    architecture vLLM runs, whether or not kvtier's engine runs it; ValueError for multi-head
    latent attention (docs/vllm.md, "Limits")."""
    if model_config.use_mla:
        raise ValueError("KVTierConnector: multi-head latent attention (MLA) is not supported: vLLM's CPU build "
                         "runs MLA without prefix caching (its prefill cannot attend to K/V it did not compute "
                         "in that step, so loaded K/V gives wrong tokens), and the GPU path is unverified here; "
                         "serve this model without --kv-transfer-config")
    path = Path(model_config.model)
    raw = json.loads((path / "config.json").read_text())
    blob = json.dumps(raw, sort_keys=True, separators=(",", ":")) + "\0" + weights_identity(path)
    fingerprint = f"{hashlib.sha256(blob.encode()).hexdigest()[:32]}+vllm-{backend}"
    return VllmModel(fingerprint, int(model_config.get_total_num_hidden_layers()),
                     int(model_config.get_total_num_kv_heads()), int(model_config.get_head_size()))


# vLLM's fp8 `kv_cache_dtype` names the connector moves as they are (bytes in vLLM's CPU "vec"
# pages, where they sit as the model dtype's elements would), by the format's name in keys:
# "fp8" is vLLM's name for e4m3, and its CPU kernels write the same bytes for both.
FP8_KV_DTYPES = {"fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}


@dataclasses.dataclass
class VllmSetup:
    """kvtier's view of one vLLM configuration."""

    config: ConnectorConfig
    model: VllmModel
    model_dtype: torch.dtype
    block_size: int
    layer_groups: dict[str, int]  # attention layer name -> KV cache group
    loads: bool
    saves: bool
    events: bool
    tp_size: int = 1
    cache_dtype: str = "auto"  # vLLM's kv_cache_dtype: "auto" (the model's dtype) or an FP8_KV_DTYPES name
    isa: str | None = None  # the kernels vLLM's CPU attention writes pages with; None on other backends

    @property
    def num_groups(self) -> int:
        return max(self.layer_groups.values(), default=0) + 1

    @property
    def page_decoder(self) -> str | None:
        """Returns the decoder the worker reads vLLM's CPU pages with (`cpu_page_decoder`),
        None where they move as (block, KV head) tiles; "vec" off the CPU backend (unused)."""
        if self.isa is None:
            return "vec"
        element_size = 1 if self.cache_dtype in FP8_KV_DTYPES else self.model_dtype.itemsize
        return cpu_page_decoder(self.isa, element_size, self.config.cpu_page_form)

    @property
    def kv_dtype(self) -> torch.dtype | str:
        """Returns the K/V dtype chunks are keyed by: the model's, or the fp8 format's name;
        for pages moved as tiles, with their format: `<dtype>.<isa>-tiles-b<block_size>`."""
        dtype = self.model_dtype if self.cache_dtype == "auto" else FP8_KV_DTYPES[self.cache_dtype]
        if self.page_decoder is None:
            return f"{dtype_name(dtype)}.{self.isa}-tiles-b{self.block_size}"
        return dtype

    def keyspace(self) -> Keyspace:
        """Returns the keyspace the connector keys chunks in: split by KV head (unless
        layerwise, which needs tp_size 1), so any tensor-parallel size loads what another
        stored; it covers all heads (a rank's own: `rank_keyspace`). Over tiles, spans are
        whole blocks."""
        tiles = self.page_decoder is None
        return self.config.keyspace(self.model, self.kv_dtype, split_heads=not self.config.use_layerwise,
                                    token_multiple=self.block_size if tiles else 1)

    def rank_keyspace(self, rank: int) -> Keyspace:
        """Returns the keyspace tensor-parallel rank `rank` keys its chunks in: its own heads
        (it stores and loads those alone), or every value whole when layerwise."""
        keyspace = self.keyspace()
        return keyspace if keyspace.heads is None else keyspace.for_heads(*self.rank_heads(rank))

    def rank_heads(self, rank: int) -> tuple[int, int]:
        """Returns the KV heads [lo, hi) tensor-parallel rank `rank` holds."""
        return rank_heads(self.model.num_kv_heads, self.tp_size, rank)

    def ordered_caches(self, kv_caches: dict[str, torch.Tensor],
                       backend: str) -> tuple[list[str], list[torch.Tensor], list[int] | None]:
        """Returns vLLM's named per-layer caches in layer order: their names, the caches and
        each one's KV cache group (None with one group); ValueError unless they are layers
        0..L-1, or for CPU caches whose block size is not the cache config's (the kernels, the
        keys and the block tables were all taken from it)."""
        names = sorted(kv_caches, key=layer_index)
        indices = [layer_index(n) for n in names]
        if indices != list(range(len(names))):
            raise ValueError(f"KV caches must be layers 0..{len(names) - 1}, got {indices}")
        caches = [kv_caches[n] for n in names]
        if caches and caches[0].dim() == 4 and backend == "cpu" and caches[0].shape[2] != self.block_size:
            raise ValueError(f"KVTierConnector: vLLM's CPU caches hold blocks of {caches[0].shape[2]} tokens, its "
                             f"cache config says {self.block_size}")
        groups = self.layer_groups
        return names, caches, [groups.get(n, 0) for n in names] if groups else None

    def worker_presence(self, instance_id: str, **timeouts: float) -> Presence:
        """Returns the presence of the worker side's tiers, every rank's asked over its lookup
        channel (`timeouts`: LookupClient's)."""
        ranks = [LookupClient(lookup_socket_path(instance_id, r), **timeouts) for r in range(self.tp_size)]
        return Presence(ranks, [self.rank_heads(r) for r in range(self.tp_size)])


def rank_heads(num_kv_heads: int, tp_size: int, rank: int) -> tuple[int, int]:
    """Returns the KV heads [lo, hi) that tensor-parallel rank `rank` of `tp_size` holds, as
    vLLM splits them: consecutive equal ranges, or with more ranks than heads, each head on
    `tp_size // num_kv_heads` consecutive ranks; ValueError where vLLM splits neither way."""
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} outside [0, {tp_size})")
    if tp_size >= num_kv_heads:
        if tp_size % num_kv_heads:
            raise ValueError(f"{num_kv_heads} KV heads do not replicate evenly over {tp_size} ranks")
        head = rank // (tp_size // num_kv_heads)
        return head, head + 1
    if num_kv_heads % tp_size:
        raise ValueError(f"{num_kv_heads} KV heads do not split evenly over {tp_size} ranks")
    n = num_kv_heads // tp_size
    return rank * n, (rank + 1) * n


def vllm_setup(vllm_config: Any, kv_cache_config: Any, backend: str,
               isa_of: Callable[[torch.dtype, int, int, str], str]) -> VllmSetup:
    """Returns kvtier's view of `vllm_config` (connector settings: its extra config over
    $KVTIER_CONFIG / KVTIER_*), on the CPU backend with the kernels `isa_of(dtype, block_size,
    head_size, kv_cache_dtype)` says vLLM picks; ValueError names a setup this connector does
    not support."""
    kvt = vllm_config.kv_transfer_config
    config = ConnectorConfig.load(overrides=kvt.kv_connector_extra_config or {})
    config.apply_tenant_tag_key()  # scheduler and worker processes alike
    par = vllm_config.parallel_config
    if par.pipeline_parallel_size != 1:
        raise ValueError("KVTierConnector supports pipeline_parallel_size=1 only (docs/vllm.md, \"Parallel\")")
    if par.tensor_parallel_size > 1 and config.use_layerwise:
        raise ValueError("KVTierConnector: use_layerwise needs tensor_parallel_size=1 (a layerwise value holds "
                         "every KV head of its layer; tensor-parallel ranks store their own heads)")
    cache_dtype = kv_cache_dtype(vllm_config.cache_config, backend)
    on = enabled_extension(config.extensions)
    if on is not None and not on[0].in_vllm:
        raise ValueError(f"{on[0].title} ({on[0].section}.enabled) is not supported inside vLLM yet; "
                         "use kvtier's engine for it")
    groups = kv_cache_groups(kv_cache_config)
    for g in getattr(kv_cache_config, "kv_cache_groups", None) or ():
        spec = type(g.kv_cache_spec)
        if not any(c.__name__ == "AttentionSpec" for c in spec.__mro__):
            raise ValueError(f"KVTierConnector: a KV cache group of {spec.__name__} layers (recurrent state, "
                             "not per-token K/V) is not supported; serve this model without --kv-transfer-config")
    if len(set(groups.values())) > 1 and config.use_layerwise:
        raise ValueError("KVTierConnector: use_layerwise needs one KV cache group (vLLM maps a layerwise "
                         "load's failed blocks back to requests for one group only)")
    model = vllm_model(vllm_config.model_config, backend)
    refuse_image_input(vllm_config.model_config.model, getattr(vllm_config.model_config, "multimodal_config", None))
    ev = vllm_config.kv_events_config
    dtype, block_size = vllm_config.model_config.dtype, vllm_config.cache_config.block_size
    isa = isa_of(dtype, block_size, model.head_size, cache_dtype) if backend == "cpu" else None
    # Over tiles, a chunk_size that is no multiple of block_size is refused by the keyspace each role builds.
    return VllmSetup(config, model, dtype, block_size, groups, loads=kvt.is_kv_consumer, saves=kvt.is_kv_producer,
                     events=ev is not None and bool(ev.enable_kv_cache_events), tp_size=par.tensor_parallel_size,
                     cache_dtype=cache_dtype, isa=isa)


def kv_cache_dtype(cache_config: Any, backend: str) -> str:
    """Returns vLLM's `kv_cache_dtype` where the connector supports it: "auto", or an fp8 format
    on the CPU backend with fixed scales (a checkpoint's scales are in the weights the model's
    identity hashes); ValueError names any other."""
    name = cache_config.cache_dtype or "auto"
    if name == "auto":
        return name
    if name not in FP8_KV_DTYPES or backend != "cpu":
        where = "" if name not in FP8_KV_DTYPES else " on vLLM's GPU backends (verified on its CPU backend only)"
        raise ValueError(f"KVTierConnector: kv_cache_dtype {name!r} is not supported{where}; use 'auto'"
                         + (f" or one of {sorted(FP8_KV_DTYPES)}" if backend == "cpu" else ""))
    if getattr(cache_config, "calculate_kv_scales", False):
        raise ValueError("KVTierConnector: calculate_kv_scales computes each instance's own fp8 K/V scales, so "
                         "stored fp8 K/V would be read with other scales than it was written with; leave it off")
    return name


def refuse_image_input(checkpoint: str | Path, multimodal_config: Any) -> None:
    """Raises ValueError when vLLM would take images for `checkpoint`, a multimodal model the
    connector keys by token ids: an image's placeholder tokens are the same whatever the
    image, so one image's K/V would be loaded for another. vLLM's `--language-model-only` (or
    an image limit of 0) makes it text-only. A checkpoint kvtier's engine reads as text only
    (no image token) is never refused."""
    if multimodal_config is None or multimodal_config.get_limit_per_prompt("image") == 0:
        return
    raw = json.loads((Path(checkpoint) / "config.json").read_text())
    try:
        known = ModelConfig.from_hf_dict(raw)
    except ValueError:
        known = None  # an architecture only vLLM runs: it may take images
    if known is not None and known.image_token_id is None:
        return
    arch = known.checkpoint_architecture if known is not None else (raw.get("architectures") or ["this model"])[0]
    raise ValueError(f"KVTierConnector: {arch} takes images here, and stored K/V is keyed by token ids alone (an "
                     "image's placeholder tokens do not say which image); serve it text-only: --language-model-only "
                     "or --limit-mm-per-prompt '{\"image\": 0}'")


def kv_cache_groups(kv_cache_config: Any) -> dict[str, int]:
    """Returns the KV cache group of each attention layer vLLM names ({} without a config)."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    return {name: g for g, group in enumerate(groups) for name in group.layer_names}


def layer_index(name: str) -> int:
    """Returns the layer number in a vLLM attention layer name; ValueError if it has none or several."""
    found = _LAYER_INDEX.findall(f".{name}.")
    if len(found) != 1:
        raise ValueError(f"cannot tell the layer number of KV cache {name!r}")
    return int(found[0])


def hit_sources(by_tier: dict[str, int], num_external_tokens: int) -> dict[str, int]:
    """Returns `num_external_tokens` split by vLLM's CacheHitSource member name, from the
    tokens per tier name ("0:cpu?budget=4GiB", "1:disk:///var/kv", ...) a load plan found; what no tier accounts for is
    unspecified, so the counts add up as vLLM requires. Only non-zero counts."""
    out: dict[str, int] = {}
    for tier, n in by_tier.items():
        scheme = re.split(r"[:?]", tier.split(":", 1)[-1], maxsplit=1)[0]  # "0:disk:///var/kv" -> "disk"
        name = HIT_SOURCES.get(scheme, UNSPECIFIED)
        out[name] = out.get(name, 0) + n
    out[UNSPECIFIED] = out.get(UNSPECIFIED, 0) + num_external_tokens - sum(out.values())
    return {name: n for name, n in out.items() if n > 0}
