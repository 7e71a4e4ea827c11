"""The connector's two halves in two processes, as vLLM runs them: the scheduler side in the
engine's process, the worker side in a child fed only the pickled step metadata (and the
hooks' plain arguments). A warm request loads through the child and gives the tokens a cold
prefill gives."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from connector.connector_config import make_config
from connector.connector_metrics import ConnectorMetrics
from connector.metadata import KVTierMeta, LoadSpec, SaveSpec
from connector.planner import KVTierPlanner
from connector.presence import LocalHeldKeys, Presence
from engine.kv_connector import KVConnector
from kvstore.storage_manager import StorageManager
from tests.fixtures.connector import CHUNK, engine, run
from tests.fixtures.remote_worker import RemoteWorker

pytestmark = pytest.mark.slow


def test_metadata_pickles_whole(prompt_ids: list[int]) -> None:
    from kvkeys.keyspace import Keyspace

    spans = Keyspace("m", "float32", CHUNK, 30).spans(prompt_ids)
    meta = KVTierMeta(loads=[LoadSpec("r", 10, spans[2].end, spans[:3], [[1, 2, 3, 4, 5]], layerwise=True)],
                      saves=[SaveSpec("s", [[7, 8]], spans[:1], release=True)])
    assert pickle.loads(pickle.dumps(meta)) == meta


def test_the_worker_side_in_another_process_loads_from_the_metadata_alone(
        default_model_path: Path, prompt_ids: list[int], reference: list[int], tmp_path: Path) -> None:
    config = make_config([f"disk://{tmp_path / 'kv'}"], chunk_size=CHUNK)
    # The scheduler side sees the shared disk tier through its own manager, by existence only.
    storage = StorageManager.from_config(config.kvstore)
    worker = RemoteWorker(config)
    conn = KVConnector(KVTierPlanner(config, Presence([LocalHeldKeys(storage)]), ConnectorMetrics()), worker)
    try:
        with engine(default_model_path, conn, enable_prefix_caching=False) as llm:
            cold = run(llm, prompt_ids)
            assert cold.outputs[0].token_ids == reference and cold.num_cached_tokens == 0
            assert worker.flush(timeout=60)
            warm = run(llm, prompt_ids)
            assert warm.outputs[0].token_ids == reference
            assert warm.num_cached_tokens == len(prompt_ids) - 1  # all but the last token loaded
            stats = llm.get_stats()
            assert stats["connector_hit_tokens"] == len(prompt_ids) - 1
            assert stats["num_free_blocks"] == stats["num_gpu_blocks"]
        assert {"bind_connector_metadata", "start_load_kv", "wait_for_layer_load", "wait_for_save",
                "build_connector_output", "shutdown"} <= set(worker.calls)
        assert worker.meta_bytes > 0
    finally:
        storage.close()
