"""KV events from kvtier's tiers inside `vllm serve` (`--kv-events-config`): each chunk the
connector stores is published as vLLM's `BlockStored` with its tokens, its chained hash and
the previous chunk's as parent, the tier as medium; each chunk the tier evicts as
`BlockRemoved`. Received over vLLM's own ZMQ publisher, decoded with vLLM's event types."""

from __future__ import annotations

import json
import time
from pathlib import Path

import msgspec
import openai
import zmq
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

from tests.fixtures.vllm import VllmServer

CHUNK = 256


def _drain(sub: zmq.Socket, until: float, want: int) -> list[BlockStored | BlockRemoved]:
    """Returns the events received until `want` of them arrived or `until` (monotonic) passed."""
    decode = msgspec.msgpack.Decoder(KVEventBatch)
    events: list[BlockStored | BlockRemoved] = []
    while len(events) < want and time.monotonic() < until:
        if sub.poll(200):
            _topic, _seq, payload = sub.recv_multipart()
            events += [e for e in decode.decode(payload).events if isinstance(e, (BlockStored, BlockRemoved))]
    return events


def test_stored_and_evicted_chunks_are_published(tmp_path: Path, default_model_path: Path,
                                                 prompt_2k: list[int]) -> None:
    endpoint = f"ipc://{tmp_path}/events.sock"  # vLLM's publisher binds it: local, no network
    events_config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint}
    # room for 3 of the prompt's 8 chunks (46080 bytes per token in fp32): the rest are evicted
    config = {"tiers": ["cpu?budget=36MiB"], "chunk_size": CHUNK}
    server = VllmServer(default_model_path, config, tmp_path / "server.log", "kv_both",
                        "--kv-events-config", json.dumps(events_config))
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        client.completions.create(model="default", prompt=prompt_2k, max_tokens=1, temperature=0.0)
        events = _drain(sub, time.monotonic() + 60, want=8 + 5)
    finally:
        server.close()
        sub.close(linger=0)
        ctx.term()
    stored = [e for e in events if isinstance(e, BlockStored)]
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert len(stored) >= 8, events
    prompt_chunks = [prompt_2k[i:i + CHUNK] for i in range(0, len(prompt_2k), CHUNK)]
    assert [e.token_ids for e in stored[:8]] == prompt_chunks
    assert all(e.medium == "cpu" and e.block_size == CHUNK and len(e.block_hashes) == 1 for e in stored[:8])
    assert stored[0].parent_block_hash is None
    assert [e.parent_block_hash for e in stored[1:8]] == [e.block_hashes[0] for e in stored[:7]]
    assert len({e.block_hashes[0] for e in stored[:8]}) == 8
    # the budget holds 3 chunks: at least 5 of the 8 were evicted, each one announced before
    assert len(removed) >= 5
    announced = {e.block_hashes[0] for e in stored}
    assert all(e.medium == "cpu" and e.block_hashes[0] in announced for e in removed)
