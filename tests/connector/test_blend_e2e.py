"""CacheBlend end to end on the default model: ratio 1 is a full prefill, ratio 0 is plain reuse
of the re-rotated segment K/V (checked against transformers with a hand-built cache), segments
hit in any order, missing or corrupt segments are computed, and approximate K/V never leaks
into the engine's prefix cache or the prefix tiers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from connector.blend import BlendConfig, BlendConnector, build_blend_connector
from connector.blend.segments import segment_spans
from engine import LLM, SamplingParams
from kvstore.keys import process_tokens
from tests.engine.text import PARAGRAPHS

pytestmark = pytest.mark.slow

CHUNK = 32  # segments span several chunks, the last one short
GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
SYSTEM = "You are a careful assistant. Read the documents below, then answer the question in a few words.\n"
DOCS = [f"Document: {p}\n" for p in PARAGRAPHS[:3]]
QUERY = "Question: what did the lighthouse keeper count? Answer:"


def make_llm(model: Path, connector=None, **kw) -> LLM:
    kw.setdefault("num_gpu_blocks", 48)
    return LLM(str(model), device="cpu", dtype="float32", block_size=16, kv_connector=connector, **kw)


def blend_llm(model: Path, ratio: float, **kw) -> tuple[LLM, BlendConnector]:
    conn = build_blend_connector("cpu", chunk_size=CHUNK, blend=BlendConfig(ratio=ratio))
    return make_llm(model, conn, **kw), conn


def tokens(out) -> list[int]:
    return list(out.outputs[0].token_ids)


def assert_idle(llm: LLM, conn: BlendConnector) -> None:
    assert conn.flush(timeout=60)
    assert all(c == 0 for c in llm.engine.block_manager.ref_counts())
    assert conn.storage.pins.total() == 0
    assert not conn._blended and not conn._blend_plans and not conn._to_blend


@pytest.fixture(scope="module")
def segments(default_model_path: Path) -> dict:
    """Token ids of the system prompt, the documents and the query (each tokenized alone)."""
    from engine.model_loader import load_tokenizer

    tok = load_tokenizer(default_model_path)
    enc = {"system": tok.encode(SYSTEM), "docs": [tok.encode(d) for d in DOCS], "query": tok.encode(QUERY)}
    assert len(enc["system"]) > 16  # the system prompt fills a block (exact, shareable)
    return enc


def prompt(segments: dict, order=(0, 1, 2)) -> dict:
    parts = [segments["system"], *(segments["docs"][i] for i in order), segments["query"]]
    return {"prompt_token_ids": [t for p in parts for t in p], "segment_lens": [len(p) for p in parts]}


@pytest.fixture(scope="module")
def reference(default_model_path: Path, segments: dict) -> list[int]:
    """Tokens of a plain full prefill of the same ids, no connector."""
    llm = make_llm(default_model_path, enable_prefix_caching=False)
    return tokens(llm.generate([{"prompt_token_ids": prompt(segments)["prompt_token_ids"]}], GREEDY)[0])


def hf_full_reuse(hf_model, segments: dict, steps: int) -> list[int]:
    """Greedy tokens of transformers over a hand-built cache: each context segment run on its
    own at its offset in the prompt (what re-rotated standalone K/V is), concatenated, then
    the query decoded over it. Independent of kvtier's executor and rotary code."""
    from transformers import DynamicCache

    parts = [segments["system"], *segments["docs"]]
    ks: list[list[torch.Tensor]] = []
    vs: list[list[torch.Tensor]] = []
    offset = 0
    with torch.no_grad():
        for ids in parts:
            pos = torch.arange(offset, offset + len(ids))[None]
            layers = hf_model(torch.tensor([ids]), position_ids=pos, use_cache=True).past_key_values.layers
            ks.append([l.keys for l in layers])
            vs.append([l.values for l in layers])
            offset += len(ids)
        cache = DynamicCache()
        for i in range(len(ks[0])):
            cache.update(torch.cat([k[i] for k in ks], dim=2), torch.cat([v[i] for v in vs], dim=2), i)
        ids, out = segments["query"], []
        for _ in range(steps):
            pos = torch.arange(offset, offset + len(ids))[None]
            logits = hf_model(torch.tensor([ids]), position_ids=pos, past_key_values=cache, use_cache=True).logits
            offset += len(ids)
            ids = [int(logits[0, -1].argmax())]
            out.append(ids[0])
    return out


def test_ratio_one_gives_full_prefill_tokens(default_model_path, segments, reference):
    llm, conn = blend_llm(default_model_path, 1.0)
    out = llm.generate([prompt(segments)], GREEDY)[0]
    assert tokens(out) == reference
    st = conn.blend_stats()
    assert st["requests"] == 1 and st["recomputed_tokens"] == st["blended_tokens"] > 0
    assert out.num_cached_tokens == st["blended_tokens"]  # the engine computed only the query
    m = conn.request_metrics(out.request_id)
    assert m is not None and m.connector_hit_tokens == st["blended_tokens"] and m.load_seconds > 0
    assert_idle(llm, conn)


def test_ratio_zero_gives_full_reuse_tokens(default_model_path, segments, hf_default_model, reference):
    llm, conn = blend_llm(default_model_path, 0.0, enable_prefix_caching=False)
    out = tokens(llm.generate([prompt(segments)], GREEDY)[0])
    assert conn.blend_stats()["recomputed_tokens"] == 0
    assert out == hf_full_reuse(hf_default_model, segments, GREEDY.max_tokens)
    assert_idle(llm, conn)


def test_segments_hit_in_any_order_and_missing_ones_are_computed(default_model_path, segments):
    llm, conn = blend_llm(default_model_path, 0.15)
    first = llm.generate([prompt(segments, (0, 1, 2))], GREEDY)[0]  # cold: every segment computed
    st = conn.blend_stats()
    assert (st["segment_hits"], st["segment_misses"]) == (0, 4)
    assert first.num_cached_tokens == sum(prompt(segments)["segment_lens"][:-1])

    for order in [(2, 0, 1), (1, 2, 0)]:
        llm.generate([prompt(segments, order)], GREEDY)
    st = conn.blend_stats()
    assert st["segment_misses"] == 4  # nothing recomputed standalone: all hits
    assert st["segment_hits"] == 8  # 3 documents + the system prompt's tail past the engine's hit
    assert 0 < st["recomputed_tokens"] < st["blended_tokens"]

    # One chunk of a document evicted, one replaced by a foreign-shaped value: both segments are
    # computed again (a miss, never an error or wrong K/V) and their chunks stored again.
    fp, dt = llm.model_config.fingerprint, conn._kv_dtype
    evicted = segment_spans(segments["docs"][0], CHUNK, fp, dt)[1][2]
    corrupt = segment_spans(segments["docs"][1], CHUNK, fp, dt)[0][2]
    conn.storage.delete(evicted)
    good = conn.storage.get(corrupt)
    conn.storage.put(corrupt, good[:, :, :3].clone())
    again = llm.generate([prompt(segments, (0, 1, 2))], GREEDY)[0]
    st = conn.blend_stats()
    assert st["segment_misses"] == 6
    assert tokens(again) == tokens(first)  # recomputed standalone K/V is the same K/V
    assert conn.storage.contains(evicted) and torch.equal(conn.storage.get(corrupt), good)
    assert_idle(llm, conn)


def test_blended_kv_never_enters_the_prefix_cache_or_prefix_tiers(default_model_path, segments, reference):
    llm, conn = blend_llm(default_model_path, 0.0)  # ratio 0: the most approximate K/V
    p = prompt(segments)
    blended = tokens(llm.generate([p], GREEDY)[0])
    assert blended != reference  # otherwise this test could not tell poisoned from clean
    ids = p["prompt_token_ids"]
    prefix_keys = [k.to_str() for _, _, k in process_tokens(
        ids, CHUNK, model=llm.model_config.fingerprint, kv_dtype=conn._kv_dtype)]
    assert conn.flush(timeout=60)
    assert conn.storage.prefix_hits(prefix_keys) == 0  # no prefix chunk of the blended request
    exact = len(segments["system"]) // 16 * 16  # the standalone system prompt is exact
    assert llm.get_stats()["num_cached_blocks"] == exact // 16

    plain = llm.generate([{"prompt_token_ids": ids}], GREEDY)[0]  # same ids, not segmented
    assert tokens(plain) == reference
    assert plain.num_cached_tokens == exact
    assert_idle(llm, conn)


def test_segmented_prompt_forms(default_model_path, segments):
    llm, conn = blend_llm(default_model_path, 0.15)
    sep = conn.segment_separator
    eng = llm.engine
    seq = eng.make_sequence(SYSTEM + sep + DOCS[0] + sep + QUERY, GREEDY)
    assert seq.segment_lens == [len(segments["system"]), len(segments["docs"][0]), len(segments["query"])]
    assert seq.prompt_token_ids == segments["system"] + segments["docs"][0] + segments["query"]
    assert eng.make_sequence([SYSTEM, DOCS[0], QUERY], GREEDY).segment_lens == seq.segment_lens
    assert eng.make_sequence(SYSTEM + QUERY, GREEDY).segment_lens is None  # no separator: plain
    with pytest.raises(ValueError, match="segment 1 is empty"):
        eng.make_sequence(SYSTEM + sep + sep + QUERY, GREEDY)
    with pytest.raises(ValueError, match="segment_lens"):
        eng.make_sequence({"prompt_token_ids": [1, 2, 3], "segment_lens": [1, 1]}, GREEDY)
    with pytest.raises(ValueError, match="segment_lens"):
        eng.make_sequence({"prompt_token_ids": [1, 2, 3], "segment_lens": [3, 0]}, GREEDY)
    # A segmented prompt with one segment, or a plain one, takes the prefix path: no blend.
    llm.generate([{"prompt_token_ids": seq.prompt_token_ids, "segment_lens": [len(seq.prompt_token_ids)]}], GREEDY)
    assert conn.blend_stats()["requests"] == 0
    assert_idle(llm, conn)


def test_sliding_window_models_are_refused(tmp_path):
    """The recompute attends over the whole context, so a windowed model would be wrong."""
    from engine.model_config import ModelConfig
    from tests.fixtures.model import make_tiny_checkpoint

    cfg = ModelConfig.from_pretrained(make_tiny_checkpoint(tmp_path, "mistral", sliding_window=8))
    with pytest.raises(ValueError, match="sliding-window"):
        BlendConnector().register_model(cfg)
