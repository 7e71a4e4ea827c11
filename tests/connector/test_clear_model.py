"""Clearing one model's chunks (`/kv/clear` with `stored_model`, connector/cache_control.py
`clear_model`, issue #50): over a real shared tier, a writer with its own storage manager (as
another process) stores prompts of several models and tenants; another manager clears one
model by name or by its exact engine-tagged field, every tenant's, and leaves the other models'
chunks and index records alone; a model nothing is stored of is refused by name. Clearing idle
chunks leaves the tier's own bookkeeping (the families' index) alone. No model runs: keys come
from the keyspace."""

from __future__ import annotations

from pathlib import Path

import pytest

from connector.cache_control import NoSuchModel, clear_model
from connector.key_families import INDEX_KEY, decode_index
from kvkeys.keyspace import Keyspace
from kvstore.storage_manager import StorageManager
from tests.connector.test_explain import manager, prompt, store
from tests.fixtures.connector import tier_url

FAMILIES = {
    "m1": Keyspace("m1", "float16", 32, 2),
    "m1 of alice": Keyspace("m1", "float16", 32, 2, cache_salt="alice"),
    "m1 in vllm": Keyspace("m1+vllm-cpu", "float16", 32, 2),
    "m2": Keyspace("m2", "float16", 32, 2),
}


def stored_by_a_writer(url: str) -> StorageManager:
    """Stores a prompt of each of FAMILIES into the tier at `url` through a writer's own
    manager, then returns another manager over it: its own (empty) family index, as another
    process."""
    writer = manager(url)
    try:
        for i, ks in enumerate(FAMILIES.values()):
            store(writer, ks, prompt(i, 64))
    finally:
        writer.close()
    return manager(url)


@pytest.mark.parametrize("tier", ["disk", "redis"])
def test_clear_one_model_every_tenant_others_intact(tier: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    other = stored_by_a_writer(tier_url(tier, tmp_path, request))
    name = other.names[0]

    def held(label: str) -> int:
        ks = FAMILIES[label]
        i = list(FAMILIES).index(label)
        return other.operations.held_prefix(None, ks.stored_keys(ks.spans(prompt(i, 64))))

    try:
        assert [held(label) for label in FAMILIES] == [2, 2, 2, 2]
        removed, errors = clear_model(other, "m1+vllm-cpu")  # the exact field: only that engine's
        assert removed == {name: 2} and not errors
        assert [held(label) for label in FAMILIES] == [2, 2, 0, 2]
        removed, errors = clear_model(other, "m1")  # the name: every tenant's, any engine tag
        assert removed == {name: 4} and not errors
        assert [held(label) for label in FAMILIES] == [0, 0, 0, 2]
        listed = decode_index(other.tier_get(name, INDEX_KEY))
        assert [f.model for f in listed] == ["m2"]
        with pytest.raises(NoSuchModel, match="no tier holds chunks of model 'm3'.*stored: m2"):
            clear_model(other, "m3")  # says so, naming what is stored, rather than "cleared"
    finally:
        other.close()


def test_clearing_idle_chunks_keeps_the_families_index(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    other = stored_by_a_writer(tier_url("disk", tmp_path, request))
    name = other.names[0]
    try:
        before = decode_index(other.tier_get(name, INDEX_KEY))
        removed, errors = other.operations.delete_idle(1e-9)  # every chunk is idle that long
        assert removed == {name: 2 * len(FAMILIES)} and not errors
        assert decode_index(other.tier_get(name, INDEX_KEY)) == before != []  # explain still names families
    finally:
        other.close()
