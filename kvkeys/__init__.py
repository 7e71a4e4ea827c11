"""Keys: the one home of how kvtier names cached K/V (docs/architecture.md, "Keys").

- `kvkeys/chain.py`: the chained hash, the one primitive the engine's prefix cache chains over
  blocks and the connector's keyspace over chunks;
- `kvkeys/tenants.py`: a request's `cache_salt`, its salted chain roots, its tenant tag and
  where a stored key names it;
- `kvkeys/keyspace.py`: tokens in, chunk spans carrying their stored keys out (layer and head
  suffixes, probes), and a request's spans extended as it grows;
- `kvkeys/stored_keys.py`: how a stored key reads (its family, whether it names a chunk, the
  group usage counts it under), without torch, for the cache server too.

It imports no other kvtier package, so the engine, the tiers and the connector all take their
keys from here: nothing else derives one.
"""
