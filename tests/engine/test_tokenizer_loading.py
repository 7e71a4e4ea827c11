"""engine.model_loader.load_tokenizer: kvtier's `tokenizers`-only Tokenizer (engine/tokenizer.py)
for a checkpoint whose transformers tokenizer is its plain tokenizer.json, giving what
transformers' AutoTokenizer gives (ids, text, chat prompts) without importing transformers; and
AutoTokenizer's own tokenizer, also where it skips AutoTokenizer's config step, for the rest."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine.model_loader import _is_plain_tokenizers_backend, load_tokenizer, tokenizer_mapped_model_types
from engine.tokenizer import Tokenizer
from harness import process

REPO = Path(__file__).resolve().parents[2]
TEXTS = ["Hello <|im_start|> world \U0001f642\n\n  tabs\t", "", "The capital of France is",
         "<|im_end|><|endoftext|> ünïcödé — 漢字 \u200b  spaces   end ", "x" * 300, "12345 + 67890 = ?\r\n"]
CHATS = [
    [{"role": "user", "content": "Name three primary colours."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <|im_end|>"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Again 漢字"}],
    [{"role": "user", "content": "with a none field", "name": None}],
]


def _auto(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def _same_as_transformers(got: Tokenizer, ref: Any) -> None:
    assert got.special_tokens_map == ref.special_tokens_map
    assert got.eos_token_id == ref.eos_token_id and got.vocab_size == len(ref)
    for text in TEXTS:
        for special in (True, False):
            ids = got.encode(text, add_special_tokens=special)
            assert ids == ref.encode(text, add_special_tokens=special), (text, special)
        assert got.convert_ids_to_tokens(ids) == ref.convert_ids_to_tokens(ids)
        for skip in (True, False):  # every window, so split multi-byte characters are met too
            for a in range(0, len(ids), 3):
                for b in range(a, min(len(ids), a + 6) + 1):
                    assert (got.decode(ids[a:b], skip_special_tokens=skip)
                            == ref.decode(ids[a:b], skip_special_tokens=skip)), (text, a, b, skip)
    for special in (True, False):  # called as vLLM users call the tokenizer `LLM.get_tokenizer()` gives
        want = ref(TEXTS, add_special_tokens=special)
        got_batch = got(TEXTS, add_special_tokens=special)
        assert got_batch["input_ids"] == want["input_ids"] and got_batch.attention_mask == want["attention_mask"]
        one = TEXTS[0]
        assert got(one, add_special_tokens=special).input_ids == ref(one, add_special_tokens=special).input_ids
        assert got.batch_decode(want["input_ids"], skip_special_tokens=special) == \
            ref.batch_decode(want["input_ids"], skip_special_tokens=special)
    for chat in CHATS:
        for gen in (True, False):
            want = ref.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False)
            assert got.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False) == want
            # transformers' defaults: tokenized, as a dict of input_ids and attention_mask
            assert dict(got.apply_chat_template(chat, add_generation_prompt=gen)) == \
                dict(ref.apply_chat_template(chat, add_generation_prompt=gen))
            assert got.apply_chat_template(chat, add_generation_prompt=gen, return_dict=False) == \
                ref.apply_chat_template(chat, add_generation_prompt=gen, return_dict=False)
    batch = dict(padding=True, return_tensors="pt", add_generation_prompt=True)  # several conversations at once
    _same_encoding(got.apply_chat_template(CHATS, **batch), ref.apply_chat_template(CHATS, **batch))
    assert got.apply_chat_template(CHATS, tokenize=False) == ref.apply_chat_template(CHATS, tokenize=False)
    _same_calls_as_transformers(got, ref)


def _same_encoding(got: Any, want: Any) -> None:
    """Asserts a call's answer is transformers': the same keys, lists or the same tensors."""
    import torch

    assert set(got) == set(want) == {"input_ids", "attention_mask"}
    for key in want:
        if isinstance(want[key], (torch.Tensor, np.ndarray)):
            assert type(got[key]) is type(want[key]) and got[key].dtype == want[key].dtype, key
            assert got[key].shape == want[key].shape and got[key].tolist() == want[key].tolist(), key
        else:
            assert got[key] == want[key], key
    assert got.input_ids is got["input_ids"]


def _same_calls_as_transformers(got: Tokenizer, ref: Any) -> None:
    """The tokenizer called as vLLM users call transformers' (`tok(texts, return_tensors="pt",
    padding=True)` and the rest): the same ids, padding, truncation and tensors."""
    import warnings

    texts = ["hi there", TEXTS[3], "", "x"]
    cases = [dict(padding=True, return_tensors="pt"), dict(padding="longest", return_tensors="np"),
             dict(padding=True), dict(padding=True, padding_side="left", return_tensors="pt"),
             dict(padding="max_length", max_length=40, return_tensors="pt"), dict(padding="max_length", max_length=3),
             dict(truncation=True, max_length=4), dict(max_length=4), dict(truncation="only_first", max_length=5),
             dict(truncation="longest_first", max_length=6, padding=True, return_tensors="pt"),
             dict(truncation=True), dict(truncation=False, max_length=2), dict(padding=True, max_length=3),
             dict(padding=True, pad_to_multiple_of=8, return_tensors="pt"),
             dict(padding="max_length", truncation=True, max_length=8, pad_to_multiple_of=4, return_tensors="pt"),
             dict(padding="max_length"), dict(padding="do_not_pad", truncation="do_not_truncate")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' notes on max_length unused
        for kwargs in cases:
            for special in (True, False):
                for text in (texts, texts[0], texts[2]):
                    _same_encoding(got(text, add_special_tokens=special, **kwargs),
                                   ref(text, add_special_tokens=special, **kwargs))


def test_default_model_tokenizer_is_kvtiers_own_and_equals_auto_tokenizer(default_model_path: Path) -> None:
    tok = load_tokenizer(default_model_path)
    assert isinstance(tok, Tokenizer)
    _same_as_transformers(tok, _auto(default_model_path))


def test_loading_the_default_tokenizer_does_not_import_transformers(default_model_path: Path) -> None:
    code = ("import sys; from engine.model_loader import load_tokenizer; "
            f"tok = load_tokenizer({str(default_model_path)!r}); "
            "tok.apply_chat_template([dict(role='user', content='x')]); "
            "print(type(tok).__name__, 'transformers' in sys.modules)")
    out = process.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.stdout.split() == ["Tokenizer", "False"], out.stderr[-2000:]


# A chat template using what transformers' environment gives templates: namespace, tojson (no
# HTML escaping), loop controls, the generation tag, the special tokens as variables, trimmed blocks.
TEMPLATE = """{{ bos_token }}{% set ns = namespace(n=0) %}
{% for m in messages %}
  {% if m['role'] == 'system' %}{% continue %}{% endif %}
  {% set ns.n = ns.n + 1 %}
  {{ ns.n }}:{{ m['role'] | tojson }} {{ {'c': m['content']} | tojson }}
{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{{ eos_token }}{% endgeneration %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}<|im_start|>assistant{% endif %}"""


def _variant(src: Path, out: Path, config: dict[str, Any] | None = None, spec: dict[str, Any] | None = None,
             template: str | None = TEMPLATE) -> Path:
    """Copies the default tokenizer to `out` with edits to tokenizer_config.json and tokenizer.json."""
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "config.json", out / "config.json")
    cfg = {**json.loads((src / "tokenizer_config.json").read_text()), **(config or {})}
    (out / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    tj = {**json.loads((src / "tokenizer.json").read_text()), **(spec or {})}
    (out / "tokenizer.json").write_text(json.dumps(tj))
    if template is not None:
        (out / "chat_template.jinja").write_text(template)
    return out


def test_a_bos_adding_post_processor_and_a_richer_template_equal_auto_tokenizer(default_model_path: Path,
                                                                                tmp_path: Path) -> None:
    bos = {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}},
                                                    {"Sequence": {"id": "A", "type_id": 0}}],
           "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
           "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}}}
    added = {"2": {"content": "<|im_end|>", "lstrip": False, "rstrip": False, "normalized": False,
                   "single_word": False, "special": True}}
    sides = {"padding_side": "left", "truncation_side": "left"}  # padded and cut on the left
    path = _variant(default_model_path, tmp_path / "v", {"added_tokens_decoder": added, "unk_token": None, **sides},
                    {"post_processor": bos})
    tok = load_tokenizer(path)
    assert isinstance(tok, Tokenizer)
    assert tok.encode("hi")[0] == 1 and tok.encode("hi", add_special_tokens=False)[0] != 1
    assert tok(["hi", "hi there"], padding=True).input_ids == [[2, 1, 6004], [1, 6004, 665]]
    assert tok(["hi", "hi there"], max_length=2, truncation=True).input_ids == [[1, 6004], [1, 665]]
    _same_as_transformers(tok, _auto(path))


def test_calls_it_cannot_honour_raise_value_error_naming_the_value(default_model_path: Path,
                                                                  tmp_path: Path) -> None:
    tok = load_tokenizer(default_model_path)
    texts = ["hi", "hi there"]
    for kwargs, named in [(dict(return_tensors="tf"), "'tf'"), (dict(padding="sideways"), "'sideways'"),
                          (dict(truncation="only_second", max_length=2), "'only_second'"),
                          (dict(padding=True, padding_side="middle"), "'middle'"),
                          (dict(return_tensors="pt"), "padding=True"), (dict(return_tensors="np"), "padding=True"),
                          (dict(padding="max_length", truncation=True, max_length=6, pad_to_multiple_of=4), "(6)")]:
        with pytest.raises(ValueError, match=re.escape(named)):
            tok(texts, **kwargs)
    with pytest.raises(TypeError):  # an argument it does not take at all is not swallowed
        tok(texts, stride=2)
    no_pad = load_tokenizer(_variant(default_model_path, tmp_path / "v", {"pad_token": None}))
    assert isinstance(no_pad, Tokenizer) and no_pad(texts).input_ids == tok(texts).input_ids
    with pytest.raises(ValueError, match="pad token"):
        no_pad(texts, padding=True)
    bos = {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}},
                                                    {"Sequence": {"id": "A", "type_id": 0}}],
           "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
           "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}}}
    with_bos = load_tokenizer(_variant(default_model_path, tmp_path / "b", spec={"post_processor": bos}))
    with pytest.raises(ValueError, match="max_length=0"):  # transformers' tokenizers wraps around: no cut at all
        with_bos(texts, max_length=0)
    assert with_bos(texts, max_length=0, add_special_tokens=False).input_ids == [[], []]


def test_truncation_without_max_length_is_the_configs_model_max_length(default_model_path: Path,
                                                                      tmp_path: Path) -> None:
    path = _variant(default_model_path, tmp_path / "v", {"model_max_length": 3})
    tok, ref = load_tokenizer(path), _auto(path)
    assert isinstance(tok, Tokenizer)
    for kwargs in (dict(truncation=True), dict(padding="max_length"), dict(padding="max_length", truncation=True)):
        assert dict(tok(TEXTS, **kwargs)) == dict(ref(TEXTS, **kwargs)), kwargs
    assert len(tok(TEXTS[3], truncation=True).input_ids) == 3


@pytest.mark.parametrize("config, spec, template", [
    ({"add_bos_token": True}, None, None),  # transformers rebuilds the post-processor
    ({"clean_up_tokenization_spaces": True}, None, None),
    ({"eos_token": "<not-a-token>"}, None, None),  # transformers would add it
    ({"added_tokens_decoder": {"2": {"content": "<|im_end|>", "special": False}}}, None, None),  # re-flagged
    ({"added_tokens_decoder": {"5": {"content": "<|im_end|>", "special": True}}}, None, None),  # another id
    (None, {"truncation": {"max_length": 8, "stride": 0, "strategy": "LongestFirst", "direction": "Right"}}, None),
    (None, {"post_processor": None}, None),
    ({"chat_template": "{{ messages }}"}, None, TEMPLATE),  # two templates
    ({"chat_template": {"default": "x", "tool_use": "y"}}, None, None),
    ({"tokenizer_class": "PreTrainedTokenizerFast"}, None, None),
    ({"model_input_names": ["input_ids", "token_type_ids", "attention_mask"]}, None, None),  # other call keys
    ({"model_max_length": 2048.0}, None, None),
])
def test_other_tokenizers_are_left_to_transformers(default_model_path: Path, tmp_path: Path, config: Any, spec: Any,
                                                   template: str | None) -> None:
    path = _variant(default_model_path, tmp_path / "v", config, spec, template)
    assert Tokenizer.from_pretrained(path, tokenizer_mapped_model_types()) is None
    assert not isinstance(load_tokenizer(path), Tokenizer)


@pytest.mark.parametrize("edit", [
    {"config.json": {"model_type": "qwen2"}},  # transformers maps qwen2 to its own class
    {"tokenizer_config.json": {"auto_map": {"AutoTokenizer": [None, "x.Tok"]}}},  # remote code
    {"tokenizer_config.json": {"tokenizer_class": "PreTrainedTokenizerFast"}},
    {"config.json": {"model_type": None}},
])
def test_other_checkpoints_go_through_auto_tokenizer(default_model_path: Path, tmp_path: Path,
                                                     edit: dict[str, dict[str, object]]) -> None:
    for name in ("config.json", "tokenizer_config.json"):
        data = json.loads((default_model_path / name).read_text())
        data.update(edit.get(name, {}))
        (tmp_path / name).write_text(json.dumps(data))
    assert not _is_plain_tokenizers_backend(tmp_path)


def test_unreadable_tokenizer_config_goes_through_auto_tokenizer(default_model_path: Path,
                                                                 tmp_path: Path) -> None:
    shutil.copy(default_model_path / "config.json", tmp_path / "config.json")
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    assert not _is_plain_tokenizers_backend(tmp_path)


def test_the_mapped_model_types_read_from_source_are_transformers_own() -> None:
    """`tokenizer_mapped_model_types` reads AutoTokenizer's mapping from its source (importing
    it costs every process start 0.5-2 s); the installed transformers' mapping has the same
    keys, and `qwen2` (its own class) is one of them, `llama` (TokenizersBackend) is not."""
    import ast

    import transformers

    from engine.model_loader import _mapping_keys, tokenizer_mapped_model_types

    source = Path(transformers.__file__).parent / "models" / "auto" / "tokenization_auto.py"
    parsed = _mapping_keys(ast.parse(source.read_text()))
    assert parsed is not None  # the fast path is what runs here, not the import fallback
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    assert parsed == frozenset(TOKENIZER_MAPPING_NAMES) == tokenizer_mapped_model_types()
    assert "qwen2" in parsed and "llama" not in parsed
    assert _mapping_keys(ast.parse("TOKENIZER_MAPPING_NAMES = dict(x)")) is None  # another shape: the import


def test_a_checkpoints_tokenizer_is_loaded_once_until_its_files_change(default_model_path: Path,
                                                                        tmp_path: Path) -> None:
    path = _variant(default_model_path, tmp_path / "v")
    first = load_tokenizer(path)
    assert isinstance(first, Tokenizer) and load_tokenizer(path) is first  # one per process
    (path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    second = load_tokenizer(path)
    assert second is not first
    assert second.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False) == "x!"
