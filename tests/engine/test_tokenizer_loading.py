"""engine.model_loader.load_tokenizer returns what transformers' AutoTokenizer returns, also
where it skips AutoTokenizer's config step (the default model's TokenizersBackend)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engine.model_loader import _is_plain_tokenizers_backend, load_tokenizer

TEXTS = ["Hello <|im_start|> world \U0001f642\n\n  tabs\t", "", "The capital of France is"]


def _same_tokenizer(got, ref) -> None:
    assert type(got) is type(ref)
    assert got.init_kwargs == ref.init_kwargs
    assert got.special_tokens_map == ref.special_tokens_map
    assert got.model_max_length == ref.model_max_length
    for text in TEXTS:
        assert got(text) == ref(text)
    chat = [{"role": "user", "content": "Name three primary colours."}]
    assert (got.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
            == ref.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))


def test_default_model_tokenizer_matches_auto_tokenizer(default_model_path: Path) -> None:
    from transformers import AutoTokenizer

    assert _is_plain_tokenizers_backend(default_model_path)  # the fast path is what runs here
    _same_tokenizer(load_tokenizer(default_model_path),
                    AutoTokenizer.from_pretrained(str(default_model_path), local_files_only=True))


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
