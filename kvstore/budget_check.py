"""Tier budgets against the chunk size they must hold, known once the model is registered.

A budget smaller than one chunk stores nothing, silently; the usual cause is a bare number
meant as LMCache's GB (`cpu?budget=5` is 5 bytes). That is an error naming the tier; a budget
that holds only a few chunks is a warning.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvstore.store_config import TierSpec

logger = logging.getLogger("kvtier.kvstore")

FEW_CHUNKS = 8
"""A budget holding fewer chunks than this gets a warning."""


def encoded_chunk_bytes(raw_bytes: int, element_size: int, codec: str) -> int:
    """Returns about how many bytes one chunk of `raw_bytes` takes under `codec`, rounded down:
    quantising codecs keep one (int8) or half a byte (int4) per element; raw and lz4 (which
    KV barely compresses) are counted at half the raw size so the estimate never exceeds it."""
    elements = raw_bytes // max(element_size, 1)
    if codec == "int8":
        return elements
    if codec == "int4":
        return elements // 2
    return raw_bytes if codec == "raw" else raw_bytes // 2


def _units_hint(budget: int) -> str:
    if budget < 2**20:
        return f"; a bare number is bytes: did you mean {budget}GB or {budget}GiB?"
    return ""


def check_tier_budgets(tiers: Sequence[TierSpec], chunk_raw_bytes: int, element_size: int) -> list[str]:
    """Raises ValueError naming the first tier whose budget (or tenant_quota) cannot hold one chunk; returns (and
    logs as warnings) one message per tier that holds fewer than FEW_CHUNKS chunks."""
    warnings = []
    for i, tier in enumerate(tiers):
        chunk = encoded_chunk_bytes(chunk_raw_bytes, element_size, tier.codec)
        if tier.tenant_quota is not None and tier.tenant_quota < chunk:
            raise ValueError(f"tiers[{i}] {tier.url}: tenant_quota={tier.tenant_quota} bytes is smaller than one "
                             f"chunk ({chunk} bytes with codec {tier.codec}), so no tenant could store anything"
                             f"{_units_hint(tier.tenant_quota)}")
        if tier.budget is None:
            continue
        if tier.budget < chunk:
            raise ValueError(f"tiers[{i}] {tier.url}: budget={tier.budget} bytes is smaller than one chunk "
                             f"({chunk} bytes with codec {tier.codec}), so this tier would store nothing"
                             f"{_units_hint(tier.budget)}")
        held = tier.budget // chunk
        if held < FEW_CHUNKS:
            msg = (f"tiers[{i}] {tier.url}: budget={tier.budget} bytes holds only {held} chunk(s) of "
                   f"{chunk} bytes{_units_hint(tier.budget)}")
            logger.warning(msg)
            warnings.append(msg)
    return warnings
