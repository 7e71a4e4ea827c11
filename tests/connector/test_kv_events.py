"""KV events from tier changes: the worker's log is bounded and drained once; the scheduler's
builder names each chunk's tokens and chained hashes, announces a chunk once per tier and
withdraws only what it announced."""

from __future__ import annotations

import torch

from connector.kv_events import ChunkEvent, ChunkEventBuilder, TierChangeLog
from connector.metadata import SaveSpec
from kvkeys.keyspace import Keyspace

TOKENS = list(range(1000, 1000 + 40))  # 2 full chunks of 16 and a partial one of 8


def _ks(layerwise: bool = False) -> Keyspace:
    return Keyspace("m", torch.float16, 16, 3, layerwise=layerwise)


def test_the_change_log_drains_once_and_stays_bounded() -> None:
    log = TierChangeLog(limit=4)
    log.stored("cpu", ["a", "b"])
    log.removed("cpu", ["a"])
    assert log.drain() == ([("cpu", "a"), ("cpu", "b")], [("cpu", "a")])
    assert log.drain() == ([], [])
    log.stored("cpu", ["k1", "k2", "k3", "k4", "k5", "k6"])
    stored, removed = log.drain()
    assert stored == [("cpu", "k3"), ("cpu", "k4"), ("cpu", "k5"), ("cpu", "k6")] and removed == []
    assert log.dropped == 2


def test_stored_chunks_carry_tokens_and_their_parent_chain() -> None:
    ks = _ks()
    spans = ks.spans(TOKENS)
    b = ChunkEventBuilder(ks)
    b.planned(SaveSpec("r", [[0, 1, 2]], spans[:1]), TOKENS[:16])
    b.planned(SaveSpec("r", [[0, 1, 2]], spans[1:]), TOKENS)  # a later step: parent from the tokens
    events = b.events([("cpu", sp.key) for sp in spans] + [("redis", spans[0].key)], [])
    assert events == [
        ChunkEvent("stored", "cpu", spans[0].chain, None, tuple(TOKENS[:16])),
        ChunkEvent("stored", "cpu", spans[1].chain, spans[0].chain, tuple(TOKENS[16:32])),
        ChunkEvent("stored", "cpu", spans[2].chain, spans[1].chain, tuple(TOKENS[32:])),
        ChunkEvent("stored", "redis", spans[0].chain, None, tuple(TOKENS[:16])),
    ]
    assert b.events([("cpu", spans[0].key)], []) == []  # announced once per tier


def test_only_announced_chunks_are_withdrawn_once_per_tier() -> None:
    ks = _ks()
    spans = ks.spans(TOKENS)
    b = ChunkEventBuilder(ks)
    b.planned(SaveSpec("r", [[0, 1, 2]], spans), TOKENS)
    b.events([("cpu", spans[0].key)], [])
    out = b.events([], [("cpu", spans[0].key), ("cpu", spans[0].key), ("disk", spans[0].key),
                        ("cpu", spans[1].key), ("cpu", "kvtier:never:planned")])
    assert out == [ChunkEvent("removed", "cpu", spans[0].chain)]
    # stored again after its removal: announced again
    assert b.events([("cpu", spans[0].key)], [])[0].kind == "stored"


def test_layerwise_values_make_one_chunk_event() -> None:
    ks = _ks(layerwise=True)
    spans = ks.spans(TOKENS[:16])
    b = ChunkEventBuilder(ks)
    b.planned(SaveSpec("r", [[0]], spans), TOKENS[:16])
    keys = ks.stored_keys(spans)
    assert len(keys) == 3
    stored = b.events([("cpu", k) for k in keys], [])
    assert [e.kind for e in stored] == ["stored"]
    removed = b.events([], [("cpu", keys[1]), ("cpu", keys[2])])  # any layer leaving withdraws it
    assert [e.kind for e in removed] == ["removed"]


def test_the_builder_forgets_the_oldest_chunks_past_its_capacity() -> None:
    ks = _ks()
    spans = ks.spans(TOKENS)
    b = ChunkEventBuilder(ks, capacity=2)
    b.planned(SaveSpec("r", [[0, 1, 2]], spans), TOKENS)
    assert [e.chain for e in b.events([("cpu", sp.key) for sp in spans], [])] == [spans[1].chain, spans[2].chain]
