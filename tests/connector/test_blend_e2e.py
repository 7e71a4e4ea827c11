"""CacheBlend end to end on the default model: ratio 1 is a full prefill, ratio 0 is plain reuse
of the re-rotated segment K/V (in context and standalone, each checked against transformers
with a hand-built cache), segments hit in any order, missing or corrupt segments are computed
(inside the prompt: a cold prompt is a full prefill) and stored as computed, and approximate
K/V never leaks into the engine's prefix cache or the prefix tiers."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from connector.blend.blend_api import blend_stats, stored_segment
from connector.blend.blend_planner import BlendPlanner
from connector.connector_config import make_config
from connector.connector_metrics import ConnectorMetrics
from connector.engine_connector import EngineConnector, build_connector
from connector.planner import KVTierPlanner
from connector.presence import LocalHeldKeys, Presence
from engine import LLM, SamplingParams
from harness.text import PARAGRAPHS
from kvstore.storage_manager import StorageManager
from tests.fixtures.connector import engine

pytestmark = pytest.mark.slow

CHUNK = 32  # segments span several chunks, the last one short
GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
SYSTEM = "You are a careful assistant. Read the documents below, then answer the question in a few words.\n"
DOCS = [f"Document: {p}\n" for p in PARAGRAPHS[:3]]
QUERY = "Question: what did the lighthouse keeper count? Answer:"


def blend_connector(tiers: list[str], **blend: object) -> EngineConnector:
    return build_connector({"tiers": tiers, "chunk_size": CHUNK, "blend": {"enabled": True, **blend}})


@contextmanager
def blend_engine(model: Path, ratio: float, segment_kv: str = "in_context",
                 **kw: object) -> Iterator[tuple[LLM, EngineConnector]]:
    conn = blend_connector(["cpu"], ratio=ratio, segment_kv=segment_kv)
    kw.setdefault("num_gpu_blocks", 48)
    with engine(model, conn, **kw) as llm:
        yield llm, conn


def tokens(out) -> list[int]:
    return list(out.outputs[0].token_ids)


def assert_idle(llm: LLM, conn: EngineConnector) -> None:
    assert conn.flush(timeout=60)
    stats = llm.get_stats()
    assert stats["num_free_blocks"] == stats["num_gpu_blocks"]
    assert conn.storage.holds.total() == 0
    assert isinstance(conn.planner.extension, BlendPlanner) and conn.planner.extension.num_live() == 0


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
    with engine(default_model_path, None, enable_prefix_caching=False, num_gpu_blocks=48) as llm:
        return tokens(llm.generate([{"prompt_token_ids": prompt(segments)["prompt_token_ids"]}], GREEDY)[0])


def hf_layers_kv(hf_model, ids: list[int], offset: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-layer keys (after RoPE) and values `[1, H, T, D]` of transformers running `ids` as
    a sequence of their own at positions `offset..`."""
    pos = torch.arange(offset, offset + len(ids))[None]
    with torch.no_grad():
        layers = hf_model(torch.tensor([ids]), position_ids=pos, use_cache=True).past_key_values.layers
    return [layer.keys for layer in layers], [layer.values for layer in layers]


def hf_decode(hf_model, keys: list[torch.Tensor], values: list[torch.Tensor], query: list[int],
              steps: int) -> list[int]:
    """Greedy tokens of transformers decoding `query` over a hand-built cache (per layer
    `[1, H, T, D]`, T = the query's first position)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    for i, (k, v) in enumerate(zip(keys, values)):
        cache.update(k, v, i)
    offset, ids, out = keys[0].shape[2], query, []
    with torch.no_grad():
        for _ in range(steps):
            pos = torch.arange(offset, offset + len(ids))[None]
            logits = hf_model(torch.tensor([ids]), position_ids=pos, past_key_values=cache, use_cache=True).logits
            offset += len(ids)
            ids = [int(logits[0, -1].argmax())]
            out.append(ids[0])
    return out


def hf_full_reuse(hf_model, segments: dict, steps: int) -> list[int]:
    """Greedy tokens over standalone segment K/V: each context segment run on its own at its
    offset in the prompt (what re-rotated standalone K/V is), concatenated, then the query.
    Independent of kvtier's executor and rotary code."""
    parts = [segments["system"], *segments["docs"]]
    offsets = [sum(map(len, parts[:i])) for i in range(len(parts))]
    runs = [hf_layers_kv(hf_model, ids, o) for ids, o in zip(parts, offsets)]
    keys = [torch.cat([r[0][i] for r in runs], dim=2) for i in range(len(runs[0][0]))]
    values = [torch.cat([r[1][i] for r in runs], dim=2) for i in range(len(runs[0][0]))]
    return hf_decode(hf_model, keys, values, segments["query"], steps)


def hf_in_context_reuse(hf_model, segments: dict, first_order: tuple, order: tuple, steps: int) -> list[int]:
    """Greedy tokens of `order`'s prompt over the K/V each document had inside a full prefill
    of `first_order`'s context, its keys moved to their new offsets by transformers' own
    rotary embedding (RoPE rotations compose). Independent of kvtier's executor and rotary."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    sys_ids, docs = segments["system"], segments["docs"]
    keys, values = hf_layers_kv(hf_model, sys_ids + [t for i in first_order for t in docs[i]], 0)
    old = {d: len(sys_ids) + sum(len(docs[i]) for i in first_order[:j]) for j, d in enumerate(first_order)}
    new = {d: len(sys_ids) + sum(len(docs[i]) for i in order[:j]) for j, d in enumerate(order)}
    moved_k, moved_v = [], []
    for k, v in zip(keys, values):
        ks, vs = [k[:, :, :len(sys_ids)]], [v[:, :, :len(sys_ids)]]
        for d in order:
            seg = slice(old[d], old[d] + len(docs[d]))
            shift = torch.full((1, len(docs[d])), new[d] - old[d])
            cos, sin = hf_model.model.rotary_emb(v, shift)
            ks.append(apply_rotary_pos_emb(k[:, :, seg], k[:, :, seg], cos, sin)[1])
            vs.append(v[:, :, seg])
        moved_k.append(torch.cat(ks, dim=2))
        moved_v.append(torch.cat(vs, dim=2))
    return hf_decode(hf_model, moved_k, moved_v, segments["query"], steps)


def test_ratio_one_gives_full_prefill_tokens(default_model_path, segments, reference):
    with blend_engine(default_model_path, 1.0) as (llm, conn):
        out = llm.generate([prompt(segments)], GREEDY)[0]
        assert tokens(out) == reference
        st = blend_stats(conn)
        assert st["requests"] == 1 and st["recomputed_tokens"] == st["blended_tokens"] > 0
        # Cold: the connector computed every segment inside the prompt; nothing was cached or loaded.
        assert out.num_cached_tokens == 0
        m = conn.request_metrics(out.request_id)
        assert (m.connector_hit_tokens, m.bytes_loaded, m.load_seconds) == (0, 0, 0.0)
        assert_idle(llm, conn)


def test_ratio_zero_gives_full_reuse_tokens(default_model_path, segments, hf_default_model, reference):
    # In context (the default): a cold prompt computes every segment inside itself, which is a
    # full prefill; another order then reuses those K/V, re-rotated, with nothing recomputed.
    with blend_engine(default_model_path, 0.0, enable_prefix_caching=False) as (llm, conn):
        assert tokens(llm.generate([prompt(segments, (0, 1, 2))], GREEDY)[0]) == reference
        out = tokens(llm.generate([prompt(segments, (2, 0, 1))], GREEDY)[0])
        st = blend_stats(conn)
        assert (st["segment_hits"], st["segment_misses"]) == (4, 4)
        assert st["recomputed_tokens"] == st["blended_tokens"] // 2  # the cold prompt only
        assert out == hf_in_context_reuse(hf_default_model, segments, (0, 1, 2), (2, 0, 1), GREEDY.max_tokens)
        assert_idle(llm, conn)

    # Standalone (LMCache's precompute): each segment's K/V is computed on its own.
    with blend_engine(default_model_path, 0.0, "standalone", enable_prefix_caching=False) as (llm, conn):
        out = tokens(llm.generate([prompt(segments)], GREEDY)[0])
        assert blend_stats(conn)["recomputed_tokens"] == 0
        assert out == hf_full_reuse(hf_default_model, segments, GREEDY.max_tokens)
        assert_idle(llm, conn)


def test_metrics_count_only_the_segments_loaded(default_model_path, segments):
    """Tokens a blend computes (cold segments, in the prompt or standalone) are neither cached
    nor loaded, and computing is not load time; loaded segments are, with their bytes."""
    with blend_engine(default_model_path, 0.15, enable_prefix_caching=False) as (llm, conn):
        lens = prompt(segments)["segment_lens"]
        context = sum(lens[:-1])
        cold = llm.generate([prompt(segments, (0, 1, 2))], GREEDY)[0]
        m = conn.request_metrics(cold.request_id)
        assert cold.num_cached_tokens == 0 and (m.connector_hit_tokens, m.bytes_loaded, m.load_seconds) == (0, 0, 0.0)
        assert conn.flush(timeout=60)
        assert conn.request_metrics(cold.request_id).stored_tokens == context  # every segment, as computed

        warm = llm.generate([prompt(segments, (2, 0, 1))], GREEDY)[0]
        m = conn.request_metrics(warm.request_id)
        assert warm.num_cached_tokens == m.connector_hit_tokens == context
        assert m.bytes_loaded == context * conn.worker.layout.bytes_per_token() and m.load_seconds > 0
        assert m.loaded_tokens_by_tier == {"0:cpu": context}

        # A new document right after the system prompt is computed in context; the rest is loaded.
        new_doc = llm.get_tokenizer().encode(f"Document: {PARAGRAPHS[3]}\n")
        parts = [segments["system"], new_doc, segments["docs"][2], segments["docs"][0], segments["query"]]
        mixed = llm.generate([{"prompt_token_ids": [t for p in parts for t in p],
                               "segment_lens": [len(p) for p in parts]}], GREEDY)[0]
        m = conn.request_metrics(mixed.request_id)
        loaded = len(segments["system"]) + len(segments["docs"][2]) + len(segments["docs"][0])
        assert mixed.num_cached_tokens == m.connector_hit_tokens == loaded
        assert m.loaded_tokens_by_tier == {"0:cpu": loaded}
        assert m.bytes_loaded == loaded * conn.worker.layout.bytes_per_token()
        assert conn.flush(timeout=60)
        assert conn.request_metrics(mixed.request_id).stored_tokens == len(new_doc)
        assert_idle(llm, conn)


def test_loaded_tokens_are_counted_per_tier_and_logged(default_model_path, segments, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="kvtier.request")
    disk = f"disk://{tmp_path}"
    conn = blend_connector(["cpu", disk], ratio=0.15)
    with engine(default_model_path, conn, enable_prefix_caching=False, num_gpu_blocks=48) as llm:
        context = sum(prompt(segments)["segment_lens"][:-1])
        llm.generate([prompt(segments, (0, 1, 2))], GREEDY)  # cold: computed, stored in both tiers
        assert conn.flush(timeout=60)
        conn.storage.tiers[0].clear()  # only the disk tier holds the segments now
        from_disk = llm.generate([prompt(segments, (2, 0, 1))], GREEDY)[0]
        assert conn.request_metrics(from_disk.request_id).loaded_tokens_by_tier == {f"1:{disk}": context}
        assert conn.flush(timeout=60)
        promoted = llm.generate([prompt(segments, (1, 2, 0))], GREEDY)[0]  # the disk hits were promoted
        assert conn.request_metrics(promoted.request_id).loaded_tokens_by_tier == {"0:cpu": context}
        lines = [r.getMessage() for r in caplog.records if r.name == "kvtier.request"]
        assert len(lines) == 3 and "loaded_tokens_by_tier" not in lines[0]
        assert f'loaded_tokens={context} loaded_tokens_by_tier={{"1:{disk}":{context}}} load_ms=' in lines[1]
        assert_idle(llm, conn)


def test_a_missing_segment_is_stored_as_its_prompt_computed_it(default_model_path, segments):
    """In context: the stored K/V of a cold prompt's documents are the full prefill's K/V of
    that prompt, moved to positions 0.. (the system prompt, at position 0, is standalone)."""
    from connector.blend.executor import compute_segment_kv, rerotate_kv

    with blend_engine(default_model_path, 0.15, enable_prefix_caching=False) as (llm, conn):
        p = prompt(segments, (1, 2, 0))
        llm.generate([p], GREEDY)
        assert conn.flush(timeout=60)
        model = llm.engine.runner.model
        full = compute_segment_kv(model, p["prompt_token_ids"])
        offset = len(segments["system"])
        for d in (1, 2, 0):
            ids = segments["docs"][d]
            want = rerotate_kv(full[:, :, offset:offset + len(ids)], -offset, model.model.rotary.inv_freq)
            torch.testing.assert_close(stored_segment(conn, ids), want, atol=1e-4, rtol=1e-4)
            assert stored_segment(conn, ids, "standalone") is None
            offset += len(ids)
        torch.testing.assert_close(stored_segment(conn, segments["system"], "standalone"),
                                   compute_segment_kv(model, segments["system"]), atol=1e-4, rtol=1e-4)
        assert_idle(llm, conn)


def test_segments_hit_in_any_order_and_missing_ones_are_computed(default_model_path, segments, reference):
    with blend_engine(default_model_path, 0.15) as (llm, conn):
        first = llm.generate([prompt(segments, (0, 1, 2))], GREEDY)[0]  # cold: every segment computed
        st = blend_stats(conn)
        assert (st["segment_hits"], st["segment_misses"]) == (0, 4)
        context = sum(prompt(segments)["segment_lens"][:-1])
        assert first.num_cached_tokens == 0  # computed, not cached
        assert tokens(first) == reference  # computed inside the prompt: a full prefill
        # ... so all of its context is exact and enters the engine's prefix cache: a repeat hits
        # it there (every full block), and blends nothing but the partial last block.
        assert llm.get_stats()["num_cached_blocks"] == context // 16
        repeat = llm.generate([prompt(segments, (0, 1, 2))], GREEDY)[0]
        assert tokens(repeat) == reference
        assert blend_stats(conn)["blended_tokens"] - st["blended_tokens"] == context % 16
        llm.reset_prefix_cache()

        for order in [(2, 0, 1), (1, 2, 0)]:
            llm.generate([prompt(segments, order)], GREEDY)
        st = blend_stats(conn)
        assert st["segment_misses"] == 4  # nothing computed again: all hits
        # The repeat's last document, then per order 3 documents + the system prompt (its tail past
        # the engine's hit once the first order has cached it).
        assert st["segment_hits"] == 9
        assert 0 < st["recomputed_tokens"] < st["blended_tokens"]

        # One chunk of a document evicted, one replaced by a foreign-shaped value: both segments are
        # computed again (a miss, never an error or wrong K/V) and their chunks stored again.
        ks = conn.planner.keyspace
        evicted = ks.segment_spans(segments["docs"][0], "in_context")[1].key
        corrupt = ks.segment_spans(segments["docs"][1], "in_context")[0].key
        assert conn.flush(timeout=60)
        conn.storage.delete(evicted)
        [(good, _)] = conn.storage.fetch([corrupt])
        conn.storage.batched_put([(corrupt, good[:, :, :3].clone())])
        assert stored_segment(conn, segments["docs"][0]) is None and stored_segment(conn, segments["docs"][1]) is None
        again = llm.generate([prompt(segments, (0, 1, 2))], GREEDY)[0]
        st = blend_stats(conn)
        assert st["segment_misses"] == 6
        assert tokens(again) == tokens(first)  # recomputed in the first prompt's order: the same K/V
        assert conn.flush(timeout=60)  # segment stores go through the background queue
        assert conn.storage.batched_contains([evicted])[0]
        torch.testing.assert_close(conn.storage.fetch([corrupt])[0][0], good, atol=1e-4, rtol=1e-4)
        assert_idle(llm, conn)


def test_segments_promised_exact_are_computed_even_if_stored_meanwhile(default_model_path, segments):
    """Two cold prompts admitted in one step: the second's documents are stored (by the first,
    in another order) between its admission and its load. It promised them exact (its prefix
    cache keeps them), so it computes them itself instead of loading the other order's K/V."""
    with engine(default_model_path, None, enable_prefix_caching=False, num_gpu_blocks=48) as plain:
        want = tokens(plain.generate([{"prompt_token_ids": prompt(segments, (0, 2, 1))["prompt_token_ids"]}],
                                     GREEDY)[0])
    with blend_engine(default_model_path, 0.15) as (llm, conn):
        first, second = llm.generate([prompt(segments, (0, 1, 2)), prompt(segments, (0, 2, 1))], GREEDY)
        st = blend_stats(conn)
        assert st["requests"] == 2
        # The first: all 4 computed. The second: the system prompt loaded (exact at position 0),
        # its 3 documents computed again in its own order.
        assert (st["segment_hits"], st["segment_misses"]) == (1, 7)
        assert tokens(second) == want
        context = sum(prompt(segments)["segment_lens"][:-1])
        again = llm.generate([prompt(segments, (0, 2, 1))], GREEDY)[0]
        assert blend_stats(conn)["blended_tokens"] - st["blended_tokens"] == context % 16  # an exact prefix hit
        assert tokens(again) == want
        assert_idle(llm, conn)


def test_blended_kv_never_enters_the_prefix_cache_or_prefix_tiers(default_model_path, segments, reference):
    # Ratio 0 over standalone K/V: the most approximate K/V (in context, the tokens come out equal).
    with blend_engine(default_model_path, 0.0, "standalone") as (llm, conn):
        p = prompt(segments)
        blended = tokens(llm.generate([p], GREEDY)[0])
        assert blended != reference  # otherwise this test could not tell poisoned from clean
        ids = p["prompt_token_ids"]
        prefix_keys = [sp.key for sp in conn.planner.keyspace.spans(ids)]
        assert conn.flush(timeout=60)
        assert not any(conn.storage.batched_contains(prefix_keys[:1]))  # no prefix chunk of the blended request
        exact = len(segments["system"]) // 16 * 16  # the standalone system prompt is exact
        assert llm.get_stats()["num_cached_blocks"] == exact // 16

        plain = llm.generate([{"prompt_token_ids": ids}], GREEDY)[0]  # same ids, not segmented
        assert tokens(plain) == reference
        assert plain.num_cached_tokens == exact
        assert_idle(llm, conn)


def test_segmented_prompt_forms(default_model_path, segments):
    with blend_engine(default_model_path, 0.15) as (llm, conn):
        sep = conn.planner.segment_separator
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
        assert blend_stats(conn)["requests"] == 0
        assert_idle(llm, conn)


def test_longrope_models_are_refused_by_the_scheduler_side(tmp_path):
    """Keys under longrope cannot be moved by a rotation (tests/connector/test_blend_families.py
    covers every family CacheBlend serves, sliding windows included)."""
    from engine.model_config import ModelConfig
    from harness.families import FAMILIES
    from harness.model import FAMILY_TINY, make_tiny_checkpoint

    cfg = ModelConfig.from_pretrained(make_tiny_checkpoint(tmp_path, **{**FAMILY_TINY, **FAMILIES["phi3"]}))
    config = make_config({"tiers": ["cpu"], "chunk_size": CHUNK, "blend": {"enabled": True}})
    with StorageManager.from_config(config.kvstore) as storage, pytest.raises(ValueError, match="longrope"):
        planner = KVTierPlanner(config, Presence([LocalHeldKeys(storage)]), ConnectorMetrics())
        planner.register_model(cfg, torch.float32, 16)
