"""Key families: everything a stored key names but the chunk hash (model fingerprint with its
engine tag, KV dtype, layout version, chunk size, tenant), as a shared tier's index of them
records it (connector/key_families.py).

A `Family` carries its chain root too (a salt's root sealed under the tenant tag key,
kvkeys/tenants.py `seal_root`): with it the keys a prompt has in that family are computed
again, by the family's own keyspace, and a tier is asked whether it holds them, by existence
alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvkeys.keyspace import LAYOUT_VERSION, Keyspace, chunk_key
from kvkeys.tenants import seal_root


@dataclass(frozen=True)
class Family:
    """One key family, as an index record holds it. `values`: how a chunk is stored ("chunk",
    "layers": one value per layer, "heads": one per KV head)."""

    model: str
    kv_dtype: str
    layout: int
    chunk_size: int
    tenant: str | None
    root: str  # hex; a tenant's sealed
    values: str = "chunk"
    num_layers: int = 1

    @classmethod
    def of(cls, ks: Keyspace) -> Family:
        """Returns the family of `ks`'s keys."""
        root = ks.root if ks.tenant is None else seal_root(ks.root, ks.tenant)
        values = "heads" if ks.heads is not None else "layers" if ks.layerwise else "chunk"
        return cls(ks.model, ks.kv_dtype, LAYOUT_VERSION, ks.chunk_size, ks.tenant, root.hex(), values, ks.num_layers)

    @property
    def id(self) -> str:
        """Every key of this family starts with this (its chunk key without the hash)."""
        return chunk_key(self.model, self.kv_dtype, self.chunk_size, b"", self.layout, self.tenant)

    @property
    def engine_tag(self) -> str:
        """The fingerprint's engine tag (`+vllm-cpu`), "" for kvtier's own engine."""
        return self.model.partition("+")[2]

    def fields(self) -> dict[str, object]:
        """What tells families apart, as explain names it."""
        return {"model": self.model.partition("+")[0], "engine_tag": self.engine_tag, "kv_dtype": self.kv_dtype,
                "layout": self.layout, "chunk_size": self.chunk_size, "tenant": self.tenant}

    def keyspace(self) -> Keyspace:
        """Returns the keyspace this family's keys are made in; for a family stored per KV head,
        covering head 0 alone (every tensor-parallel size stores it), so its probes are head 0's."""
        root = bytes.fromhex(self.root)
        if self.tenant is not None:
            root = seal_root(root, self.tenant)  # its own inverse
        heads = (0, 1) if self.values == "heads" else None
        ks = Keyspace(self.model, self.kv_dtype, self.chunk_size, self.num_layers, layerwise=self.values == "layers",
                      heads=heads)
        return ks.rooted(root, self.tenant, self.layout)

    def probes(self, tokens: Sequence[int]) -> list[tuple[int, str]]:
        """Returns per chunk of `tokens` in this family (the last, short one too) its end and
        its probe key (`Keyspace.probe_keys`: there only when the chunk is)."""
        ks = self.keyspace()
        spans = ks.spans(tokens)
        return list(zip([sp.end for sp in spans], ks.probe_keys(spans)))
