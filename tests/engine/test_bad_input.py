"""Bad input is a ValueError naming the problem, raised before anything is queued."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.engine_config import EngineConfig

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm(default_model_path: Path) -> Iterator[LLM]:
    with LLM(str(default_model_path), device="cpu", max_model_len=256, num_gpu_blocks=64) as llm:
        yield llm


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-0.5), "temperature must be >= 0"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p must be in (0, 1]"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(max_tokens=0), "max_tokens must be >= 1"),
        (dict(max_tokens="8"), "max_tokens"),
        (dict(seed="x"), "seed"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
    ],
)
def test_invalid_sampling_params(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs, key",
    [
        (dict(block_size=0), "block_size"),
        (dict(num_gpu_blocks=-1), "num_gpu_blocks"),
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
        (dict(device="tpu"), "device"),
        (dict(dtype="int8"), "dtype"),
        (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
        (dict(enable_prefix_caching="yes"), "enable_prefix_caching"),
        (dict(no_such_option=1), "no_such_option"),
    ],
)
def test_invalid_engine_config_names_the_key(kwargs: dict, key: str) -> None:
    with pytest.raises(ValueError, match=key):
        EngineConfig.from_kwargs(**kwargs)


def test_bad_prompts_name_the_problem(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=4)
    with pytest.raises(ValueError, match="empty"):
        llm.generate("", greedy)
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, greedy)
    with pytest.raises(ValueError, match=r"300 tokens, longer than max_model_len=256"):
        llm.generate({"prompt_token_ids": [5] * 300}, greedy)
    with pytest.raises(ValueError, match="not a token id"):
        llm.generate({"prompt_token_ids": [5, 10**9]}, greedy)
    with pytest.raises(ValueError, match="a prompt must be"):
        llm.generate([123], greedy)
    with pytest.raises(ValueError, match="2 sampling_params for 1 prompts"):
        llm.generate(["hi"], [greedy, greedy])
    with pytest.raises(ValueError, match="prompts is empty"):
        llm.generate([], greedy)


def test_a_bad_prompt_in_a_batch_loses_nothing(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=4)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(["Hello there", {"prompt_token_ids": [7] * 1000}], greedy)
    stats = llm.get_stats()
    assert stats["num_waiting"] == 0 and stats["num_running"] == 0
    assert stats["num_free_blocks"] == stats["num_gpu_blocks"]
    (out,) = llm.generate("Hello there", greedy)  # the engine is still healthy
    assert len(out.outputs[0].token_ids) == 4


def test_pool_too_small_for_one_request(default_model_path: Path) -> None:
    with LLM(str(default_model_path), device="cpu", num_gpu_blocks=2) as small:
        with pytest.raises(ValueError, match=r"needs 3 KV blocks .* num_gpu_blocks=2"):
            small.generate({"prompt_token_ids": [5] * 40}, SamplingParams(temperature=0, max_tokens=1))
        # One that fits still runs on the same engine.
        (out,) = small.generate({"prompt_token_ids": [5] * 20}, SamplingParams(temperature=0, max_tokens=4))
    assert len(out.outputs[0].token_ids) == 4


def test_max_model_len_above_the_model_limit(default_model_path: Path) -> None:
    with pytest.raises(ValueError, match="max_model_len=100000 exceeds the model's limit 8192"):
        LLM(str(default_model_path), device="cpu", max_model_len=100000, num_gpu_blocks=8)


def test_unsupported_architecture_names_it(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    (tmp_path / "model.safetensors").write_bytes(b"")  # weights present; only the architecture is wrong
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        LLM(str(tmp_path), device="cpu")
    with pytest.raises(ValueError, match="not a local Hugging Face checkpoint"):
        LLM(str(tmp_path / "missing"), device="cpu")
