"""Batched GETs on a real 3-master Redis Cluster: each node's replies are read by kvtier's
reader and checked as they arrive (as on a single node), and a key whose slot moved since the
client learnt the slot map is still found (redis-py follows the redirection)."""

from __future__ import annotations

import redis
import redis.cluster
import torch

from harness.redis import RedisClusterNodes
from kvstore import serde
from kvstore.backends.redis_store import RedisBackend
from kvstore.registry import create_backend
from kvstore.store_config import TierSpec
from tests.fixtures.tiers import chunk, ckey


def _direct(cluster: RedisClusterNodes) -> redis.cluster.RedisCluster:
    return redis.cluster.RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port)


def test_cluster_replies_are_checked_as_they_arrive(redis_cluster: RedisClusterNodes) -> None:
    tier = create_backend(TierSpec(redis_cluster.url))
    assert isinstance(tier, RedisBackend)
    keys = [ckey(100 + i) for i in range(12)]
    kvs = [chunk(100 + i, tokens=256) for i in range(12)]  # 786 KB each: more than one check piece
    tier.batched_put(list(zip(keys, kvs)))
    direct = _direct(redis_cluster)
    try:
        bad = bytearray(direct.get(keys[5]))
        bad[-1] ^= 0x01  # the last byte of the payload
        direct.set(keys[5], bytes(bad))
        direct.set(keys[7], b"abc")
        direct.delete(keys[9])
        direct.rpush(keys[9], "not a string")  # its GET is a WRONGTYPE error reply
        replies = tier._get_many(keys)
        assert all(isinstance(r, serde.CheckedValue) for i, r in enumerate(replies) if i != 9)
        got = tier.batched_get(keys)
        for i, kv in enumerate(got):
            assert (kv is None) if i in (5, 7, 9) else torch.equal(kv, kvs[i]), i
        s = tier.stats()
        assert (s.hits, s.corrupt) == (9, 3)
        assert direct.exists(keys[5], keys[7], keys[9]) == 0  # refused values are removed
    finally:
        tier.clear()
        tier.close()
        direct.close()


def test_a_cluster_get_follows_a_slot_that_moved(redis_cluster: RedisClusterNodes) -> None:
    tier = create_backend(TierSpec(redis_cluster.url))  # learns the slot map now
    assert isinstance(tier, RedisBackend) and isinstance(tier.reader, redis.cluster.RedisCluster)
    key, kv = ckey(200), chunk(200)
    slot = redis.cluster.key_slot(key.encode())
    clients = {node.port: node.client() for node in redis_cluster.nodes}
    ids = {port: c.execute_command("CLUSTER MYID") for port, c in clients.items()}
    owner = tier.reader.get_node_from_key(key).port
    target = next(port for port in clients if port != owner)

    def move_slot(to: int) -> None:
        for port in [to, *(p for p in clients if p != to)]:
            clients[port].execute_command("CLUSTER SETSLOT", slot, "NODE", ids[to])

    direct = _direct(redis_cluster)
    direct.delete(key)
    move_slot(target)
    try:
        writer = create_backend(TierSpec(redis_cluster.url))  # learns the new map
        writer.put(key, kv)
        writer.close()
        held = {port: c.execute_command("CLUSTER COUNTKEYSINSLOT", slot) for port, c in clients.items()}
        assert held[target] == 1 and held[owner] == 0
        # the tier's map still says `owner`: that node answers MOVED, and the key is found
        assert torch.equal(tier.get(key), kv)
        assert tier.reader.get_node_from_key(key).port == target  # and the map is refreshed
        assert torch.equal(tier.batched_get([ckey(201), key])[1], kv)
        s = tier.stats()
        assert s.corrupt == 0 and s.hits == 2
    finally:
        clients[target].delete(key)
        move_slot(owner)
        tier.close()
        direct.close()
