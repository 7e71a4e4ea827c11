"""End to end against the oracle: transformers with the same fp32 weights, greedy decoding.

Our engine must produce exactly the tokens `generate(do_sample=False)` produces, for prompts
from 1 to ~2000 tokens, raw and chat-templated, one at a time and as one mixed batch (which
exercises chunked prefill next to decodes).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from harness.model import make_tiny_checkpoint
from harness.text import long_text

pytestmark = pytest.mark.slow
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def llm(default_model_path: Path) -> Iterator[LLM]:
    with LLM(str(default_model_path), device="cpu", dtype="float32", num_gpu_blocks=512) as llm:
        yield llm


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=2)
    return out[0, len(prompt_ids):].tolist()


@pytest.fixture(scope="module")
def prompts(llm: LLM) -> list:
    tok = llm.tokenizer
    chat = lambda text: llm.apply_chat_template([{"role": "user", "content": text}])  # noqa: E731
    doc_ids = tok.encode(long_text(60))
    assert len(doc_ids) > 2000
    return [
        {"prompt_token_ids": tok.encode("Once")[:1]},  # 1 token
        "The capital of France is",
        chat("What is the capital of France?"),
        chat("Write a haiku about autumn leaves."),
        chat("Explain in one sentence what a hash function is."),
        {"prompt_token_ids": doc_ids[:300]},
        chat("Summarise this text in two sentences:\n\n" + long_text(14)),
        {"prompt_token_ids": doc_ids[:1200]},  # the mixed batch is then past one step's 2048 tokens
    ]


@pytest.fixture(scope="module")
def oracle(llm: LLM, prompts: list, hf_default_model) -> list[list[int]]:
    ids = [llm.engine.make_sequence(p, SamplingParams()).prompt_token_ids for p in prompts]
    return [hf_greedy(hf_default_model, i, MAX_TOKENS) for i in ids]


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


def test_prompt_set_spans_lengths(llm: LLM, prompts: list) -> None:
    lens = [len(llm.engine.make_sequence(p, greedy()).prompt_token_ids) for p in prompts]
    assert min(lens) == 1 and max(lens) >= 1200 and len(prompts) >= 8
    assert sum(lens) > 2048  # the mixed batch is chunked: more than one step's token budget
    assert lens[6] > 500  # a long chat-templated prompt too


def test_one_at_a_time_matches_transformers(llm: LLM, prompts: list, oracle: list[list[int]]) -> None:
    for prompt, want in zip(prompts, oracle):
        (out,) = llm.generate(prompt, greedy())
        assert out.outputs[0].token_ids == want, f"prompt of {len(out.prompt_token_ids)} tokens"
        assert out.finished and out.metrics.ttft is not None and out.metrics.ttft >= 0


def test_mixed_batch_matches_transformers(llm: LLM, prompts: list, oracle: list[list[int]]) -> None:
    llm.reset_prefix_cache()
    outs = llm.generate(prompts, greedy())
    assert [o.outputs[0].token_ids for o in outs] == oracle
    tok = llm.tokenizer
    for o in outs:
        assert o.outputs[0].text == tok.decode(o.outputs[0].token_ids, skip_special_tokens=True)
    assert llm.get_stats()["num_free_blocks"] == llm.get_stats()["num_gpu_blocks"]


def engine_prefill_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """Drives the engine's own scheduler + runner step by step, keeping every row's logits."""
    eng = llm.engine
    seq = eng.make_sequence({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1))
    eng.add_sequence(seq)
    chunks = []
    while not seq.is_finished:
        out = eng.scheduler.schedule()
        input_ids, positions, meta = eng.runner.prepare(out)
        with torch.inference_mode():
            hidden = eng.runner.model(input_ids, positions, eng.runner.kv_caches, meta)
            chunks.append(eng.runner.model.compute_logits(hidden))
        eng.scheduler.update_from_output(
            out, [int(chunks[-1][-1].argmax()) if r.samples else None for r in out.requests]
        )
    return torch.cat(chunks)


def test_chunked_and_prefix_cached_prefill_logits_match(default_model_path: Path, hf_default_model) -> None:
    with LLM(str(default_model_path), device="cpu", max_num_batched_tokens=200, num_gpu_blocks=64) as llm:
        ids = llm.tokenizer.encode(long_text(20))[:500]
        cold = engine_prefill_logits(llm, ids)  # 3 chunks of <= 200 tokens
        warm = engine_prefill_logits(llm, ids)  # 496 tokens from the prefix cache, 4 computed
    with torch.no_grad():
        want = hf_default_model(torch.tensor([ids])).logits[0].float()
    assert cold.shape == want.shape
    torch.testing.assert_close(cold, want, atol=1e-3, rtol=0)
    assert warm.shape[0] == 500 - 496
    torch.testing.assert_close(warm, want[496:], atol=1e-3, rtol=0)


@pytest.mark.parametrize("model_type", ["qwen2", "mistral"])
def test_tiny_architectures_match_transformers(tmp_path: Path, model_type: str, default_model_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    path = make_tiny_checkpoint(tmp_path, model_type=model_type, tokenizer_dir=default_model_path)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    prompts = [[5, 17, 300, 41], list(range(1000, 1077)), [9] * 33]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(str(path), device="cpu", block_size=8, max_num_batched_tokens=64, num_gpu_blocks=128) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for p, o in zip(prompts, outs):
        ids = torch.tensor([p])
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        assert o.outputs[0].token_ids == ref[0, len(p):].tolist()


def test_last_layer_runs_only_the_sampling_rows(llm: LLM, prompts: list, oracle: list[list[int]]) -> None:
    """A prefill's last layer attends and runs its MLP for the sampling row alone (the model's
    first layer for every row), unless a request wants prompt logprobs; tokens stay the
    oracle's either way."""
    layers = llm.engine.runner.model.model.layers
    seen: dict[str, list[int]] = {"first": [], "last": []}
    hooks = [layers[0].mlp.register_forward_pre_hook(lambda m, a: seen["first"].append(a[0].shape[0])),
             layers[-1].mlp.register_forward_pre_hook(lambda m, a: seen["last"].append(a[0].shape[0]))]
    try:
        n = len(llm.engine.make_sequence(prompts[5], SamplingParams()).prompt_token_ids)
        assert llm.reset_prefix_cache()  # every prompt token computed
        out = llm.generate([prompts[5]], SamplingParams(temperature=0.0, max_tokens=2))
        assert seen == {"first": [n, 1], "last": [1, 1]}
        assert out[0].outputs[0].token_ids == oracle[5][:2]
        for key in seen:
            seen[key].clear()
        with_logprobs = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0)
        assert llm.reset_prefix_cache()
        out = llm.generate([prompts[5]], with_logprobs)
        assert seen["last"][0] == n and out[0].outputs[0].token_ids == oracle[5][:2]
    finally:
        for h in hooks:
            h.remove()


def test_a_script_written_for_vllm_runs_with_its_tokenizer(llm: LLM, oracle: list[list[int]], prompts: list) -> None:
    """vLLM's tokenizer idioms on `LLM.get_tokenizer()` (transformers' tokenizer there): chat
    template to text and, by transformers' default, to ids; `tok(text)`; a padded batch as
    torch tensors (`tok(texts, return_tensors="pt", padding=True)`); generation from ids;
    `decode`/`batch_decode` of what came out."""
    tok = llm.get_tokenizer()
    conversation = [{"role": "user", "content": "What is the capital of France?"}]
    text = tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == tok(text, add_special_tokens=False).input_ids == tok.encode(text, add_special_tokens=False)
    chat = tok.apply_chat_template(conversation, add_generation_prompt=True)  # transformers' default: tokenized
    assert chat["input_ids"] == chat.input_ids == ids and chat["attention_mask"] == [1] * len(ids)
    assert tok.apply_chat_template(conversation, add_generation_prompt=True, return_dict=False) == ids
    (out,) = llm.generate([{"prompt_token_ids": ids}], greedy())
    assert list(out.outputs[0].token_ids) == oracle[2]  # the same prompt as the oracle's chat one
    assert tok.decode(out.outputs[0].token_ids, skip_special_tokens=True) == out.outputs[0].text
    assert tok.batch_decode([out.outputs[0].token_ids], skip_special_tokens=True) == [out.outputs[0].text]
    assert tok.eos_token_id is not None

    texts = [text, "The capital of France is"]  # the oracle's prompts 2 and 1
    batch = tok(texts, return_tensors="pt", padding=True)
    assert isinstance(batch.input_ids, torch.Tensor) and batch.input_ids.dtype == torch.long
    assert batch.input_ids.shape == batch.attention_mask.shape == (2, len(ids))  # the short row padded
    assert batch.attention_mask[1].sum() < len(ids) and (batch.input_ids[1][batch.attention_mask[1] == 0]
                                                         == tok.pad_token_id).all()
    rows = [row[mask.bool()].tolist() for row, mask in zip(batch.input_ids, batch.attention_mask)]
    outs = llm.generate([{"prompt_token_ids": r} for r in rows], greedy())
    assert [list(o.outputs[0].token_ids) for o in outs] == [oracle[2], oracle[1]]
