"""What the tiers hold of a prompt, by existence only (the server's `/kv/lookup`, for KV-aware
routing as LMCache's controller offers it): no data is read and nothing is loaded."""

from __future__ import annotations

from collections.abc import Sequence

from connector.kvtier_connector import KVTierConnector
from connector.layerwise import stored_keys


def tier_prefix_tokens(connector: KVTierConnector, token_ids: Sequence[int]) -> dict[str, int]:
    """Returns, per tier name (fastest first), how many leading tokens of `token_ids` that tier
    holds as stored chunks (the prompt's partial last chunk included), capped so the last
    token is never counted: it is always computed. One existence query per tier (layerwise: a
    chunk counts when the tier holds all its layers)."""
    if len(token_ids) < 2:
        return {name: 0 for name in connector.storage.names}
    spans = connector._spans(token_ids)
    layers = connector._layers()
    hits = connector.storage.tier_prefix_hits(stored_keys([key for _, _, key in spans], layers))
    limit = len(token_ids) - 1
    chunks = {name: n // (layers or 1) for name, n in hits.items()}
    return {name: min(spans[n - 1][1], limit) if n else 0 for name, n in chunks.items()}
