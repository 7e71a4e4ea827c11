"""GGUF files as models (engine/gguf_checkpoint.py): tiny random checkpoints of each family,
written as llama.cpp writes GGUF (tests/fixtures/gguf.py), give the logits and greedy tokens
of the same checkpoint loaded from safetensors; the tokenizer and chat template come from the
file; quantised files load under their own fingerprint; conversions are cached by content;
what kvtier cannot read is refused by name, through `LLM` and the CLI alike."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

from engine import LLM, SamplingParams
from engine.gguf_checkpoint import gguf_checkpoint
from engine.model_config import ModelConfig
from engine.model_loader import load_model
from harness.model import FAMILY_TINY, make_tiny_checkpoint
from harness.paged import PagedDriver
from kvtier.cli import main
from tests.fixtures.gguf import gguf_tensor_types, tiny_tokenizer_dir, write_gguf  # noqa: F401

# Gemma: a 16-token window the 50-token prompt exceeds; the attention scale llama.cpp assumes
# (head_dim, as query_pre_attn_scalar); Gemma 3 with six layers, so its default pattern has a
# global layer (the last), and its global RoPE linearly scaled.
_GEMMA = dict(head_dim=32, query_pre_attn_scalar=32, sliding_window=16)
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": dict(model_type="llama"),
    # Llama 3.1's rope scaling, which llama.cpp stores as a tensor of frequency divisors.
    "llama3": dict(model_type="llama", rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                        "original_max_position_embeddings": 8192}),
    "qwen2": dict(model_type="qwen2"),
    "qwen3": dict(model_type="qwen3", head_dim=32, attention_bias=True),
    "gemma2": dict(model_type="gemma2", **_GEMMA, attn_logit_softcapping=10.0, final_logit_softcapping=8.0),
    "gemma3": dict(model_type="gemma3_text", **_GEMMA, num_hidden_layers=6,
                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
}
PROMPT = list(range(3, 43))
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path) -> Callable[[str], Path]:  # noqa: F811
    """Returns the function giving a family's tiny checkpoint dir, each built once per module."""
    root = tmp_path_factory.mktemp("checkpoints")

    @functools.cache
    def build(family: str) -> Path:
        overrides = {**FAMILY_TINY, **FAMILIES[family]}
        return make_tiny_checkpoint(root / family, tokenizer_dir=tiny_tokenizer_dir, **overrides)
    return build


def _run(path: Path) -> tuple[torch.Tensor, list[int], ModelConfig]:
    """Returns (the prompt's logits, 5 greedy tokens after it, the ModelConfig) of the model at
    `path`, on PyTorch's ops (what is compared is the weights and config loaded, not kernels)."""
    model, cfg = load_model(path, CPU, torch.float32, kernels="torch")
    driver = PagedDriver(model, num_blocks=16)
    logits = driver.step([(0, PROMPT)])[0]
    tokens = [int(logits[-1].argmax())]
    while len(tokens) < 5:
        tokens.append(int(driver.step([(0, tokens[-1:])])[0][-1].argmax()))
    return logits, tokens, cfg


@pytest.mark.parametrize("family", list(FAMILIES))
def test_f32_gguf_matches_its_safetensors(family: str, tmp_path: Path, checkpoint: Callable[[str], Path]) -> None:
    ckpt = checkpoint(family)
    converted = gguf_checkpoint(write_gguf(ckpt, tmp_path / f"{family}.gguf"), home=tmp_path / "home", progress=False)
    logits, tokens, cfg = _run(ckpt)
    g_logits, g_tokens, g_cfg = _run(converted)
    assert torch.equal(g_logits, logits) and g_tokens == tokens
    # The same model: every field but the eps (float32 in a GGUF), the fingerprint and the path.
    differ = {f for f in cfg.__dataclass_fields__ if getattr(cfg, f) != getattr(g_cfg, f)}
    assert differ == {"rms_norm_eps", "fingerprint", "path"}
    assert g_cfg.rms_norm_eps == float(np.float32(cfg.rms_norm_eps))
    if family == "llama":  # q/k un-permuted to the bit: the converted file is the original
        assert (converted / "model.safetensors").read_bytes() == (ckpt / "model.safetensors").read_bytes()


def test_tokenizer_and_chat_template_come_from_the_file(tmp_path: Path, checkpoint: Callable[[str], Path]) -> None:
    from engine.model_loader import load_tokenizer

    ckpt = checkpoint("qwen2")
    converted = gguf_checkpoint(write_gguf(ckpt, tmp_path / "m.gguf"), home=tmp_path / "home", progress=False)
    assert (converted / "chat_template.jinja").read_text() == (ckpt / "chat_template.jinja").read_text()
    ours, theirs = load_tokenizer(converted), load_tokenizer(ckpt)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Où est Zürich? 42"}]
    assert ours.apply_chat_template(chat, add_generation_prompt=True)["input_ids"] == \
        theirs.apply_chat_template(chat, add_generation_prompt=True)["input_ids"]
    assert ModelConfig.from_pretrained(converted).eos_token_ids == [2]  # <|im_end|>, the file's eos


@pytest.mark.parametrize("qtype, bound", [(GGMLQuantizationType.Q8_0, 1 / 127), (GGMLQuantizationType.Q4_0, 1 / 8)])
def test_quantised_gguf_runs_under_its_own_fingerprint(qtype: GGMLQuantizationType, bound: float, tmp_path: Path,
                                                       checkpoint: Callable[[str], Path]) -> None:
    from safetensors.torch import load_file

    ckpt = checkpoint("llama")
    f32 = gguf_checkpoint(write_gguf(ckpt, tmp_path / "f32.gguf"), home=tmp_path / "home", progress=False)
    quantised = write_gguf(ckpt, tmp_path / "q.gguf", qtype)
    assert gguf_tensor_types(quantised) == {"F32", qtype.name}  # the norms stay F32, as llama.cpp keeps them
    converted = gguf_checkpoint(quantised, home=tmp_path / "home", progress=False)
    # Dequantised into float32, each weight within its block's rounding step (a tiny random
    # model amplifies such differences too much for its logits to be compared).
    original, dequantised = load_file(str(ckpt / "model.safetensors")), load_file(str(converted / "model.safetensors"))
    assert original.keys() == dequantised.keys()
    for name, w in original.items():
        assert dequantised[name].dtype == torch.float32
        err = float((dequantised[name] - w).abs().max()) / float(w.abs().max())
        assert (err == 0) if w.dim() == 1 else (0 < err <= bound), name
    logits, tokens, q_cfg = _run(converted)
    assert bool(logits.isfinite().all()) and len(tokens) == 5
    fingerprints = {q_cfg.fingerprint, ModelConfig.from_pretrained(f32).fingerprint,
                    ModelConfig.from_pretrained(ckpt).fingerprint}
    assert len(fingerprints) == 3  # never sharing chunks with the F32 file or the safetensors


@pytest.mark.parametrize("qtype, dtype", [(GGMLQuantizationType.F16, torch.float16),
                                          (GGMLQuantizationType.BF16, torch.bfloat16)])
def test_half_gguf_keeps_its_type(qtype: GGMLQuantizationType, dtype: torch.dtype, tmp_path: Path,
                                  checkpoint: Callable[[str], Path]) -> None:
    from safetensors.torch import load_file

    ckpt = checkpoint("llama")
    converted = gguf_checkpoint(write_gguf(ckpt, tmp_path / "h.gguf", qtype), home=tmp_path / "home", progress=False)
    original, stored = load_file(str(ckpt / "model.safetensors")), load_file(str(converted / "model.safetensors"))
    for name, w in original.items():  # the norms F32 in the file, as llama.cpp keeps them
        expected = w if w.dim() == 1 else w.to(dtype)
        assert stored[name].dtype == expected.dtype and torch.equal(stored[name], expected), name
    assert ModelConfig.from_pretrained(converted).checkpoint_dtype == str(dtype).removeprefix("torch.")


def test_large_conversions_are_sharded(tmp_path: Path, checkpoint: Callable[[str], Path],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import engine.gguf_checkpoint

    monkeypatch.setattr(engine.gguf_checkpoint, "SHARD_BYTES", 300_000)  # the embedding alone is 512 KB
    ckpt = checkpoint("qwen2")
    converted = gguf_checkpoint(write_gguf(ckpt, tmp_path / "m.gguf"), home=tmp_path / "home", progress=False)
    shards = sorted(p.name for p in converted.glob("*.safetensors"))
    index = json.loads((converted / "model.safetensors.index.json").read_text())
    assert len(shards) > 2 and sorted(set(index["weight_map"].values())) == shards
    assert all(p.stat().st_size <= 600_000 for p in converted.glob("*.safetensors"))
    logits, tokens, _ = _run(ckpt)
    s_logits, s_tokens, _ = _run(converted)
    assert torch.equal(s_logits, logits) and s_tokens == tokens


def test_conversions_are_cached_by_content(tmp_path: Path, checkpoint: Callable[[str], Path]) -> None:
    ckpt = checkpoint("llama")
    gguf = write_gguf(ckpt, tmp_path / "a.gguf")
    first = gguf_checkpoint(gguf, home=tmp_path / "home", progress=False)
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    copy = tmp_path / "elsewhere" / "a.gguf"
    copy.parent.mkdir()
    copy.write_bytes(gguf.read_bytes())
    assert gguf_checkpoint(gguf, home=tmp_path / "home") == first  # not converted again
    assert gguf_checkpoint(copy, home=tmp_path / "home") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime
    # Another machine converts the same bytes to the same model: chunks are shared between them.
    other = gguf_checkpoint(copy, home=tmp_path / "other-home", progress=False)
    assert ModelConfig.from_pretrained(other).fingerprint == ModelConfig.from_pretrained(first).fingerprint
    # An edited file (metadata only, here) converts anew; its record names the new bytes.
    write_gguf(ckpt, gguf, extra={"rope.scaling.finetuned": (False, GGUFValueType.BOOL)})
    edited = gguf_checkpoint(gguf, home=tmp_path / "home", progress=False)
    assert edited != first and edited.parent == first.parent
    assert json.loads((edited / "gguf_source.json").read_text())["sha256"] != \
        json.loads((first / "gguf_source.json").read_text())["sha256"]


@pytest.mark.parametrize("extra, extra_tensors, named", [
    ({"expert_count": (4, GGUFValueType.UINT32)}, {}, "llama.expert_count=4"),
    ({"rope.scaling.type": ("yarn", GGUFValueType.STRING)}, {}, "llama.rope.scaling.type='yarn'"),
    ({"attention.layer_norm_epsilon": (1e-5, GGUFValueType.FLOAT32)}, {}, "llama.attention.layer_norm_epsilon"),
    ({}, {"rope_freqs.weight": np.linspace(1, 3, 16, dtype=np.float32)}, "'rope_freqs.weight' holds rope frequency"),
    ({}, {"blk.0.attn_rot_embd.weight": np.ones(16, np.float32)}, "'blk.0.attn_rot_embd.weight' has no place"),
    ({}, {"blk.0.attn_q_scale.weight": np.ones(4, np.int8)}, "'blk.0.attn_q_scale.weight' is stored as I8"),
])
def test_what_kvtier_cannot_read_is_refused_by_name(extra: dict[str, Any], extra_tensors: dict[str, np.ndarray],
                                                    named: str, tmp_path: Path,
                                                    checkpoint: Callable[[str], Path]) -> None:
    ckpt = checkpoint("llama")
    gguf = write_gguf(ckpt, tmp_path / "m.gguf", extra=extra, extra_tensors=extra_tensors)
    with pytest.raises(ValueError) as e:
        gguf_checkpoint(gguf, home=tmp_path / "home", progress=False)
    assert named in str(e.value)
    assert not (tmp_path / "home" / "models" / "gguf").exists() or \
        not [p for p in (tmp_path / "home" / "models" / "gguf").iterdir() if not p.name.startswith(".")]


def test_llm_and_cli_take_a_gguf_path(tmp_path: Path, checkpoint: Callable[[str], Path],
                                      monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from engine.model_loader import load_tokenizer

    monkeypatch.setenv("KVTIER_HOME", str(tmp_path / "home"))
    ckpt = checkpoint("qwen2")
    gguf = write_gguf(ckpt, tmp_path / "tiny-qwen2.gguf")
    chat = [{"role": "user", "content": "Name a colour."}]
    # The safetensors model's answer: its tokenizer's chat prompt, greedy up to eos.
    prompt_ids = load_tokenizer(ckpt).apply_chat_template(chat, add_generation_prompt=True)["input_ids"]
    model, _ = load_model(ckpt, CPU, torch.float32, kernels="torch")
    expected = PagedDriver(model).greedy(0, prompt_ids, 5)
    expected = expected[:expected.index(2) + 1] if 2 in expected else expected
    with LLM(str(gguf), device="cpu", kernels="torch", num_gpu_blocks=32) as llm:
        out = llm.generate([llm.apply_chat_template(chat)], SamplingParams(max_tokens=5, temperature=0.0))[0]
    assert out.prompt_token_ids == prompt_ids and out.outputs[0].token_ids == expected
    # The CLI's --model takes the file too (its conversion cached by now) ...
    argv = ["generate", chat[0]["content"], "--chat", "--model", str(gguf), "--max-tokens", "5", "--json",
            "--device", "cpu", "--kernels", "torch", "--num-gpu-blocks", "32"]
    assert main(argv) == 0
    line = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert line["prompt_token_ids"] == prompt_ids and line["token_ids"] == expected
    # ... and refuses one it cannot read in one line naming why.
    bad = tmp_path / "bad.gguf"
    w = GGUFWriter(str(bad), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert main(["generate", "Hello", "--model", str(bad), "--device", "cpu"]) == 2
    assert "unsupported GGUF architecture 'gpt2'" in capsys.readouterr().err
