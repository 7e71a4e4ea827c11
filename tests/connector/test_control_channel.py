"""Cache-control questions over the lookup channel (`ControlQuestion`, connector/vllm/lookup_ops.py),
answered by connector/cache_control.py's ops as `vllm serve`'s worker answers them, and the
tensor-parallel ranks' answers merged. The routes inside a real `vllm serve`:
tests/vllm/test_router.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from connector import cache_control
from connector.presence import LocalHeldKeys
from connector.vllm.control_ops import CONTROL_OPS, answer_control
from connector.vllm.lookup_channel import LookupClient, LookupServer
from kvkeys.keyspace import Keyspace
from kvstore.storage_manager import StorageManager
from kvstore.store_config import KVStoreConfig, TierSpec

KS = Keyspace("m", torch.float32, 4, num_layers=2, heads=(0, 2))  # two ranks: heads (0, 1) and (1, 2)
RANKS = [KS.for_heads(0, 1), KS.for_heads(1, 2)]
IDS = list(range(1000, 1012))  # three chunks of 4


@pytest.fixture
def storage() -> Iterator[StorageManager]:
    with StorageManager.from_config(KVStoreConfig(tiers=[TierSpec(url="cpu")])) as s:
        yield s


def _store(storage: StorageManager, keyspace: Keyspace, chunks: int) -> None:
    spans = keyspace.for_salt(None).spans(IDS)[:chunks]
    storage.batched_put([(k, torch.zeros(2, 2, 4, 1, 8)) for k in keyspace.stored_keys(spans)])
    assert storage.flush(10)


def _served(storage: StorageManager, path: Path, keyspace: Keyspace) -> tuple[LookupServer, LookupClient]:
    server = LookupServer(LocalHeldKeys(storage), path, controller=lambda q: answer_control(storage, keyspace, q))
    return server, LookupClient(path, timeout=10.0, connect_timeout=1.0)


def test_a_control_question_is_answered_as_the_local_functions_answer(storage: StorageManager,
                                                                      tmp_path: Path) -> None:
    _store(storage, KS, 2)
    server, remote = _served(storage, tmp_path / "s.sock", KS)
    try:
        long_ids = IDS + list(range(5000, 7000))  # a question past one text's bound (MAX_TEXT_BYTES)
        seen = remote.control({"op": "inspect", "token_ids": long_ids, "cache_salt": None})
        assert seen is not None
        local = cache_control.inspect(storage, KS, long_ids, False)
        assert [(c["key"], c["start"], c["end"], set(c["tiers"])) for c in seen["chunks"]] == [
            (c["key"], c["start"], c["end"], set(c["tiers"])) for c in local["chunks"]]
        assert seen["tiers"]["0:cpu"]["entries"] == local["tiers"]["0:cpu"]["entries"] == 4
        assert [bool(c["tiers"]) for c in seen["chunks"][:4]] == [True, True, False, False]
        pinned = remote.control({"op": "pin", "token_ids": IDS, "cache_salt": None, "ttl_s": 60})
        assert pinned is not None and (pinned["chunks"], pinned["tokens"], pinned["pinned_entries"]) == (2, 8, 4)
        assert remote.control({"op": "unpin", "token_ids": IDS, "cache_salt": None}) == {
            "tier": "0:cpu", "released": 4, "pinned_entries": 0, "pinned_bytes": 0,
            "pin_budget": pinned["pin_budget"]}
        assert remote.control({"op": "clear", "all": True}) == {"cleared": "all", "tiers": {"0:cpu": 4}}
        assert storage.stats()["0:cpu"].backend.entries == 0
        assert remote.explain(IDS) is None  # no explainer: the explain question still answered, on the same connection
        assert remote.failures == 0
    finally:
        remote.close()
        server.close()


@pytest.mark.parametrize(("question", "status", "param", "message"), [
    ({"op": "compress"}, 400, "op", "unknown control op 'compress'"),
    ({"op": "inspect", "token_ids": [1, -2]}, 400, "prompt_token_ids", "non-negative integers"),
    ({"op": "inspect", "token_ids": [1], "cache_salt": "a/b"}, 400, "cache_salt", "cache_salt"),
    ({"op": "pin", "token_ids": IDS, "ttl_s": 0}, 400, "ttl_s", "greater than 0"),
    ({"op": "pin", "token_ids": IDS, "tier": "redis"}, 400, "tier", "no such tier"),
    ({"op": "pin", "token_ids": [9, 9, 9, 9, 9]}, 409, "tier", "holds none of this prompt"),
    ({"op": "clear", "all": True, "older_than_s": 1}, 400, "all", "exactly one of"),
    ({"op": "clear", "all": "yes"}, 400, "all", "true or false"),
    ({"op": "clear", "all": True, "tier": "cpu"}, 400, "tier", "not tier"),
])
def test_a_refused_question_is_answered_with_its_status_never_raised(storage: StorageManager, question: dict[str, Any],
                                                                    status: int, param: str, message: str) -> None:
    _store(storage, KS, 1)
    error = answer_control(storage, KS, question)["error"]
    assert (error["status"], error["param"]) == (status, param) and message in error["message"], error
    assert storage.stats()["0:cpu"].backend.pinned_entries == 0


def test_a_worker_without_a_controller_answers_none(storage: StorageManager, tmp_path: Path) -> None:
    server = LookupServer(LocalHeldKeys(storage), tmp_path / "s.sock")
    remote = LookupClient(tmp_path / "s.sock", timeout=10.0, connect_timeout=1.0)
    try:
        assert remote.control({"op": "inspect", "token_ids": IDS}) is None and remote.failures == 0
    finally:
        remote.close()
        server.close()


def test_ranks_answers_merge_into_one_of_the_same_shape(storage: StorageManager) -> None:
    """Rank 0 holds its heads of two chunks, rank 1 of one: the merged inspect has one chunk in
    the tier (every rank's heads), totals summed; pins: the chunks every rank pinned."""
    _store(storage, RANKS[0], 2)
    _store(storage, RANKS[1], 1)
    answers = [answer_control(storage, ks, {"op": "inspect", "token_ids": IDS}) for ks in RANKS]
    merged = CONTROL_OPS["inspect"].merge(answers)
    assert [bool(c["tiers"]) for c in merged["chunks"]] == [True, False, False]
    one = merged["chunks"][0]["tiers"]["0:cpu"]
    assert one["bytes"] == sum(a["chunks"][0]["tiers"]["0:cpu"]["bytes"] for a in answers)
    # one storage asked twice (as two ranks): its totals twice
    assert merged["tiers"]["0:cpu"]["entries"] == 2 * answers[0]["tiers"]["0:cpu"]["entries"]
    assert merged["tiers"]["0:cpu"]["can_pin"] is True and set(merged) == set(answers[0])

    pins = [answer_control(storage, ks, {"op": "pin", "token_ids": IDS}) for ks in RANKS]
    joined = CONTROL_OPS["pin"].merge(pins)
    assert (joined["chunks"], joined["tokens"]) == (1, 4)
    assert joined["new_bytes"] == pins[0]["new_bytes"] + pins[1]["new_bytes"]
    clears = [{"cleared": "idle", "tiers": {"0:cpu": 2}, "errors": {}},
              {"cleared": "idle", "tiers": {"0:cpu": 1}, "errors": {"0:cpu": "disk full"}}]
    assert CONTROL_OPS["clear"].merge(clears) == {"cleared": "idle", "tiers": {"0:cpu": 3},
                                                  "errors": {"0:cpu": "rank 1: disk full"}}
