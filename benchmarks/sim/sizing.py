"""How many shards (Redis Cluster primaries or kvtier cache servers) a shared tier needs:
the most of what bandwidth, request rate and memory each demand of one shard."""

from __future__ import annotations

import math
from dataclasses import dataclass

from benchmarks.sim.cache import ChunkTier
from benchmarks.sim.measured import ShardCapacity


@dataclass(frozen=True)
class ShardAssumptions:
    """What the measured per-core capacity is held to. `nic_gbps` caps one shard's bytes/s
    (25 GbE = 3.125 GB/s); shards run at `utilization` of capacity so queues stay short;
    `memory_gib` is the cache memory one shard gets."""

    nic_gbps: float = 3.125
    utilization: float = 0.5
    memory_gib: float = 64.0


@dataclass(frozen=True)
class Sizing:
    """The traffic a shared tier sees and the shards it needs for each demand."""

    read_gbps: float
    write_gbps: float
    ops_per_s: float
    budget_gib: float
    shards_bandwidth: int
    shards_ops: int
    shards_memory: int

    @property
    def shards(self) -> int:
        """Returns the shard count: the largest of the three demands, at least 1."""
        return max(1, self.shards_bandwidth, self.shards_ops, self.shards_memory)


def size_tier(tier: ChunkTier, requests: int, rate: float, cap: ShardCapacity, a: ShardAssumptions) -> Sizing:
    """Returns the shards `tier` needs at `rate` requests/s, from its simulated traffic per
    request over `requests` requests (steady state: the trace's ramp up and down does not
    dilute the rate), with shards of capacity `cap` under assumptions `a`. Ops: one per
    existence query, chunk GET and chunk PUT."""
    per_s = rate / max(requests, 1)
    read, write = tier.bytes_loaded * per_s / 1e9, tier.bytes_stored * per_s / 1e9
    ops = (tier.lookups + tier.gets + tier.puts) * per_s
    per_shard_gbps = min(cap.gbps, a.nic_gbps) * a.utilization
    budget_gib = tier.budget_bytes / 2**30
    return Sizing(read, write, ops, budget_gib,
                  math.ceil((read + write) / per_shard_gbps),
                  math.ceil(ops / (cap.ops_per_s * a.utilization)),
                  math.ceil(budget_gib / a.memory_gib))
