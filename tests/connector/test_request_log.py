"""The per-request INFO line (logger "kvtier.request") on a real run with a cpu tier: where a
request's cached prefix came from (engine prefix cache, tiers), load time, tokens stored."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from connector.engine_connector import build_connector
from engine import LLM, SamplingParams
from harness.text import long_text

pytestmark = pytest.mark.slow

CHUNK = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
LINE = re.compile(r"^request (\S+) finished: (.*)$")


def logged(caplog: pytest.LogCaptureFixture) -> dict[str, dict[str, str]]:
    """Returns each logged request's fields (key=value) by request id; clears the capture."""
    out = {}
    for r in caplog.records:
        if r.name == "kvtier.request":
            m = LINE.match(r.getMessage())
            assert m is not None and r.levelno == logging.INFO, r.getMessage()
            out[m.group(1)] = dict(kv.split("=", 1) for kv in m.group(2).split())
    caplog.clear()
    return out


def test_one_line_per_request_names_engine_hit_loads_and_stores(default_model_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvtier.request")
    conn = build_connector("cpu", chunk_size=CHUNK)
    llm = LLM(str(default_model_path), device="cpu", dtype="float32", block_size=16, num_gpu_blocks=64,
              kv_connector=conn)
    ids = llm.get_tokenizer().encode(long_text(3))
    n = len(ids)
    stored = (n - 1) // CHUNK * CHUNK  # at least the whole chunks before the last token
    try:
        cold = llm.generate([{"prompt_token_ids": ids}], GREEDY)[0]
        (line,) = logged(caplog).values()
        assert {k: line[k] for k in ("prompt_tokens", "engine_hit_tokens", "loaded_tokens", "output_tokens",
                                     "finish")} == {"prompt_tokens": str(n), "engine_hit_tokens": "0",
                                                    "loaded_tokens": "0", "output_tokens": "4", "finish": "length"}
        assert line["load_ms"] == "0.0" and "load_error_tokens" not in line
        assert conn.flush(timeout=60)
        # Stores still queued at the finish show in the metrics later, never more than that.
        assert 0 <= int(line["stored_tokens"]) <= conn.request_metrics(cold.request_id).stored_tokens
        assert conn.request_metrics(cold.request_id).stored_tokens >= stored

        llm.reset_prefix_cache()  # the whole prefix now comes from the cpu tier
        warm = llm.generate([{"prompt_token_ids": ids}], GREEDY)[0]
        line = logged(caplog)[warm.request_id]
        m = conn.request_metrics(warm.request_id)
        assert line["engine_hit_tokens"] == "0" and int(line["loaded_tokens"]) == m.connector_hit_tokens >= stored
        assert float(line["load_ms"]) > 0 and warm.num_cached_tokens == m.connector_hit_tokens

        again = llm.generate([{"prompt_token_ids": ids}], GREEDY)[0]  # the engine's prefix cache first
        line = logged(caplog)[again.request_id]
        hit = int(line["engine_hit_tokens"])
        assert hit == (n - 1) // 16 * 16 and hit + int(line["loaded_tokens"]) == again.num_cached_tokens
    finally:
        llm.shutdown()


def test_without_a_connector_the_line_has_the_engine_hit(default_model_path: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvtier.request")
    llm = LLM(str(default_model_path), device="cpu", dtype="float32", block_size=16, num_gpu_blocks=64)
    prompt = long_text(2)
    llm.generate([prompt], GREEDY)
    llm.generate([prompt], GREEDY)  # after the first: its blocks are in the prefix cache
    first, second = logged(caplog).values()
    assert first["engine_hit_tokens"] == "0" and int(second["engine_hit_tokens"]) > 0
    assert set(second) == {"prompt_tokens", "engine_hit_tokens", "output_tokens", "finish"}
    caplog.set_level(logging.WARNING, logger="kvtier.request")
    llm.generate([prompt], GREEDY)
    assert logged(caplog) == {}  # above INFO: no line
