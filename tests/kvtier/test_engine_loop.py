"""The server's engine loop in-process, over a tiny random checkpoint: a failing engine step
fails the requests in flight (500), flips /health to 503 and refuses new work (503); requests are
streamed per step; the in-flight bound refuses past max_num_seqs + max_queue."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest

from engine import LLM, SamplingParams
from harness.model import make_tiny_checkpoint
from kvtier.server.engine_loop import EngineLoop, QueueFullError
from kvtier.server.server_app import build_app
from kvtier.server.server_metrics import ServerMetrics
from kvtier.server.serving import ServingContext


@pytest.fixture
def llm(tmp_path: Path) -> Iterator[LLM]:
    with LLM(str(make_tiny_checkpoint(tmp_path, "llama")), device="cpu", num_gpu_blocks=64, max_num_seqs=2) as llm:
        yield llm


@asynccontextmanager
async def serve(llm: LLM, max_queue: int = 4) -> AsyncIterator[tuple[EngineLoop, httpx.AsyncClient]]:
    """Yields a started engine loop over `llm` and a client of the app in front of it; stops
    the loop on the way out, an assert failing included."""
    metrics = ServerMetrics("tiny", llm.engine.kv_connector)
    loop = EngineLoop(llm.engine, max_queue, on_step=metrics.on_step, on_forget=metrics.forget)
    loop.start()
    app = build_app(ServingContext(loop, "tiny"), metrics)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://tiny") as client:
            yield loop, client
    finally:
        loop.stop()


def test_engine_failure_fails_requests_and_health(llm: LLM) -> None:
    async def main() -> None:
        async with serve(llm) as (loop, client):
            ok = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3, "temperature": 0})
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
            assert (await client.get("/health")).status_code == 200

            def broken(*_: object) -> None:
                raise RuntimeError("injected fault in the forward")

            llm.engine.runner.execute_model = broken  # type: ignore[method-assign]
            r = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
            assert r.status_code == 500 and "injected fault" in r.json()["error"]["message"]
            assert (await client.get("/health")).status_code == 503
            again = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
            assert again.status_code == 503 and again.json()["error"]["code"] == "engine_dead"

    asyncio.run(main())


def test_streams_per_step_and_bounds_requests_in_flight(llm: LLM) -> None:
    async def main() -> None:
        async with serve(llm, max_queue=1) as (loop, _client):  # 2 running + 1 waiting
            params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
            streams = [loop.submit([llm.engine.make_sequence("count", params, f"r{i}")]) for i in range(3)]
            assert loop.num_in_flight == 3
            with pytest.raises(QueueFullError):
                loop.submit([llm.engine.make_sequence("x", params, "r3")])
            seen = [await anext(streams[0]) for _ in range(3)]  # per step, not only at the end
            assert [len(o.outputs[0].token_ids) for o in seen] == [1, 2, 3] and not seen[-1].finished
            for s in streams:
                s.close()  # aborts what has not finished
            assert loop.num_in_flight == 0
            for _ in range(100):
                if not await loop.call(llm.engine.has_unfinished_requests):
                    break
                await asyncio.sleep(0.05)
            stats = await loop.stats()
            assert stats["num_free_blocks"] == stats["num_gpu_blocks"] and stats["num_running"] == 0

    asyncio.run(main())
