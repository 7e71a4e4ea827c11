"""Deterministic natural-language prompt material for end-to-end engine tests."""

from __future__ import annotations

PARAGRAPHS = [
    "The lighthouse keeper climbed the spiral stairs every evening, counting the steps as his "
    "father had taught him, and lit the great lamp before the fishing boats came home.",
    "In the valley below, the river turned the old mill wheel, and the miller's children ran "
    "along the bank racing paper boats that spun in the eddies near the stone bridge.",
    "Scientists measure the age of ancient trees by counting rings, each ring marking one year "
    "of growth, wide in wet summers and narrow in years of drought or cold.",
    "The market opened at dawn: bakers stacked warm loaves, farmers arranged baskets of apples "
    "and pears, and a fiddler played slow tunes near the fountain for coins.",
    "A paged key-value cache splits each sequence into fixed-size blocks so that memory can be "
    "shared between requests and reclaimed without copying the whole history.",
    "When the storm passed, the village gathered on the shore to mend the nets, telling stories "
    "of the great waves their grandparents had seen many winters ago.",
]


def long_text(num_sections: int) -> str:
    """Returns `num_sections` numbered paragraphs (about 40 tokens each)."""
    return "\n\n".join(f"Section {i + 1}. {PARAGRAPHS[i % len(PARAGRAPHS)]}" for i in range(num_sections))
