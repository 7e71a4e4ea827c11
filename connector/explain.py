"""Explain a miss: for a prompt that a tier holds less of than its chunks, what that tier's
stored neighbours differ in (`/kv/lookup` with `"explain": true`, `kvtier cache explain`).

Per tier, fastest first, one cause as a code and a sentence:

- `hit`: the tier holds every chunk (all but the last token, which is always computed).
- `model`, `engine_tag`, `kv_dtype`, `layout`, `chunk_size`, `tenant`: the tier holds more of
  this prompt's leading tokens under another key family (connector/key_families.py) than
  under the asked one; the first field they differ in names the cause, `stored` and `asked`
  give every field that differs.
- `evicted`: the first chunk missing was evicted by the tier lately (a tier that remembers
  its evictions: cpu, device).
- `never_stored`: no family holds more, and the tier remembers no eviction of it.
- `not_stored`: no family holds more, and the tier cannot tell a chunk never stored from one
  evicted or expired (disk, Redis, the cache server).
- `unavailable`: the tier did not answer (backing off, or failing).

Cost: one read of each shared tier's family index, and one batched existence query per tier
for the prompt's probe keys in every known family (no scan, no K/V read). With
`other_tenants=False` (a tenant's own caller) only the asked tenant's and unsalted families
are considered, so a tenant never learns what another stored.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from connector.key_families import FamilyIndex
from connector.presence import Presence, held_tokens
from kvkeys.families import Family
from kvkeys.keyspace import Keyspace
from kvstore.storage_manager import StorageManager

FIELDS = ("model", "engine_tag", "kv_dtype", "layout", "chunk_size", "tenant")
"""The fields a family differs in, in the order a cause is named."""
LABELS = {"model": "model", "engine_tag": "engine tag", "kv_dtype": "KV dtype", "layout": "layout version",
          "chunk_size": "chunk size", "tenant": "tenant (cache_salt tag)"}


def explain(storage: StorageManager, keyspace: Keyspace, presence: Presence, token_ids: Sequence[int],
            other_tenants: bool = True) -> dict[str, Any]:
    """Returns, for `token_ids` asked in `keyspace` (a request's, salted or not), per tier its
    leading tokens held and why not more (module docstring)."""
    tokens = list(token_ids)
    limit = len(tokens) - 1
    spans = keyspace.spans(tokens)
    held = held_tokens(spans, presence.tier_prefix_chunks(keyspace, spans), len(tokens)) if limit > 0 else {}
    asked = Family.of(keyspace)
    index = FamilyIndex.of(storage)
    listed = {name: index.listed(name) for name in storage.names}
    families: dict[str, Family] = {}
    for name in storage.names:
        for f in listed[name]:
            if f.id != asked.id and (other_tenants or f.tenant in (None, asked.tenant)):
                families.setdefault(f.id, f)
    probes = {fid: f.probes(tokens) for fid, f in families.items()}
    keys = [k for p in probes.values() for _, k in p]
    found = storage.operations.contains(keys)
    missing_keys = [keyspace.probe_keys([spans[_chunks(spans, held.get(n, 0))]])[0] for n in storage.names] \
        if spans else []
    evicted = storage.operations.evicted(missing_keys)
    tiers: dict[str, Any] = {}
    for i, name in enumerate(storage.names):
        have = held.get(name, 0)
        answer: dict[str, Any] = {"held_tokens": have, "families_known": len(listed[name])}
        tier_found = found.get(name)
        if limit <= 0 or have >= limit:
            answer.update(cause="hit", message="holds every chunk of the prompt (all but its last token)")
        elif tier_found is None:
            answer.update(cause="unavailable", message="did not answer (backing off or failing): nothing is known")
        else:
            best, best_tokens = _best_neighbour(probes, families, tier_found, limit)
            gone = evicted.get(name)
            if best is not None and best_tokens > have:
                answer.update(_differs(best, asked, best_tokens))
            elif gone is not None and gone[i]:
                answer.update(cause="evicted", message=f"evicted the chunk after token {have} lately")
            elif gone is not None:
                answer.update(cause="never_stored",
                              message=f"never stored the chunk after token {have} in any known family "
                                      "(nor evicted it lately)")
            else:
                answer.update(cause="not_stored",
                              message=f"does not hold the chunk after token {have} in any known family: never "
                                      "stored, or evicted or expired (this tier cannot tell which)")
        tiers[name] = answer
    return {"num_tokens": len(tokens), "asked": asked.fields(), "tiers": tiers}


def _chunks(spans: Sequence[Any], tokens: int) -> int:
    """Returns the index of the first span not wholly within the leading `tokens` held."""
    n = 0
    while n < len(spans) - 1 and spans[n].end <= tokens:
        n += 1
    return n


def _best_neighbour(probes: dict[str, list[tuple[int, str]]], families: dict[str, Family],
                    found: list[bool], limit: int) -> tuple[Family | None, int]:
    """Returns the family whose leading chunks of the prompt the tier holds most tokens of, and how many."""
    best: Family | None = None
    best_tokens = 0
    at = 0
    for fid, chunks in probes.items():
        tokens = 0
        for (end, _), ok in zip(chunks, found[at:at + len(chunks)]):
            if not ok:
                break
            tokens = min(end, limit)
        at += len(chunks)
        if tokens > best_tokens:
            best, best_tokens = families[fid], tokens
    return best, best_tokens


def _differs(stored: Family, asked: Family, tokens: int) -> dict[str, Any]:
    """Returns the cause naming the first field `stored` differs from `asked` in."""
    s, a = stored.fields(), asked.fields()
    fields = [f for f in FIELDS if s[f] != a[f]]
    cause = fields[0]
    return {"cause": cause, "stored": {f: s[f] for f in fields}, "asked": {f: a[f] for f in fields},
            "neighbour_tokens": tokens,
            "message": f"holds {tokens} leading tokens of this prompt under another {LABELS[cause]}: "
                       f"stored {s[cause]!r}, asked {a[cause]!r}"}
