"""A checkpoint's tokenizer through the `tokenizers` library alone, without importing transformers.

Importing transformers scans every model file it ships: a large part of every engine start.
For a checkpoint whose transformers tokenizer is its tokenizer.json and nothing more
(`load_plain_backend` says when), `Tokenizer` encodes, decodes and renders the chat template
exactly as transformers' `TokenizersBackend` does: the same ids, the same text, the same chat
prompt, and its call's batching (padding, truncation, tensors) with transformers' defaults
(tests/engine/test_tokenizer_loading.py holds it to that). Any other checkpoint gets
transformers' own tokenizer (engine/model_loader.py `load_tokenizer`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, cast

SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# tokenizer_config.json keys whose values `Tokenizer` honours or that change nothing it does;
# a config with any other key is left to transformers.
_KNOWN_KEYS = frozenset({
    *SPECIAL_NAMES, "tokenizer_class", "added_tokens_decoder", "chat_template", "backend", "is_local",
    "local_files_only", "model_max_length", "clean_up_tokenization_spaces", "split_special_tokens",
    "padding_side", "truncation_side", "model_input_names", "name_or_path", "errors",
})
_ADDED_TOKEN_FLAGS = ("special", "lstrip", "rstrip", "single_word", "normalized")
# transformers rewrites the pre-tokenizer of vocabularies larger than this (its Mistral regex fix)
_MAX_PLAIN_VOCAB = 100_000
# transformers' model_max_length without one in the config, and the length past which it means "no limit"
_NO_MAX_LENGTH = int(1e30)
_LARGE_INTEGER = int(1e20)
_SIDES = ("left", "right")
_INPUT_NAMES = ["input_ids", "attention_mask"]  # what a tokenizer call returns (transformers' default)


def load_plain_backend(path: Path, mapped_model_types: frozenset[str]) -> tuple[Any, dict[str, Any]] | None:
    """Returns (the `tokenizers.Tokenizer` of tokenizer.json, tokenizer_config.json) of the
    checkpoint at `path` when transformers would load it as a plain `TokenizersBackend` that
    changes nothing in tokenizer.json: that class named, no remote code, a model type
    transformers gives no tokenizer class of its own (`mapped_model_types`), no setting beyond
    `_KNOWN_KEYS`, every special and added token already in tokenizer.json as the config
    describes it, padding and truncation sides of "left" or "right", an integer
    model_max_length, the default model_input_names, a post-processor, no truncation or padding
    in tokenizer.json, one chat template at most. Else None."""
    configs = read_tokenizer_configs(path)
    if configs is None:
        return None
    config, model_cfg = configs
    if (not names_plain_backend(config, model_cfg, mapped_model_types)
            or not set(config) <= _KNOWN_KEYS or config.get("split_special_tokens")
            or config.get("clean_up_tokenization_spaces") or not isinstance(config.get("chat_template", ""), str)
            or config.get("padding_side", "right") not in _SIDES or config.get("truncation_side", "right") not in _SIDES
            or config.get("model_input_names", _INPUT_NAMES) != _INPUT_NAMES
            or not isinstance(config.get("model_max_length", _NO_MAX_LENGTH), int)
            or ("chat_template" in config and (path / "chat_template.jinja").exists())
            or any(p.name.startswith("chat_template_") for p in path.iterdir())
            or (path / "additional_chat_templates").exists()):
        return None
    from tokenizers import Tokenizer as Backend

    try:
        backend = Backend.from_file(str(path / "tokenizer.json"))
    except Exception:  # tokenizers raises a bare Exception for a file it cannot read
        return None
    if (backend.truncation is not None or backend.padding is not None or backend.post_processor is None
            or backend.get_vocab_size(with_added_tokens=False) > _MAX_PLAIN_VOCAB):
        return None
    added = {t.content: (i, t) for i, t in backend.get_added_tokens_decoder().items()}
    for name in SPECIAL_NAMES:
        token = _content(config.get(name))
        if token is not None and token not in added:
            return None
    for tid, token in (config.get("added_tokens_decoder") or {}).items():
        content = _content(token)
        have = added.get(content) if content is not None else None
        if (have is None or have[0] != int(tid)
                or (isinstance(token, dict) and any(k in token and token[k] != getattr(have[1], k)
                                                    for k in _ADDED_TOKEN_FLAGS))):
            return None
    return backend, config


def read_tokenizer_configs(path: Path) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """Returns (tokenizer_config.json, config.json) of the checkpoint at `path`, or None where
    either is missing, unreadable or not a JSON object."""
    try:
        config = json.loads((path / "tokenizer_config.json").read_text())
        model_cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return (config, model_cfg) if isinstance(config, dict) and isinstance(model_cfg, dict) else None


def names_plain_backend(config: Mapping[str, Any], model_cfg: Mapping[str, Any],
                        mapped_model_types: frozenset[str]) -> bool:
    """Returns whether transformers' AutoTokenizer loads a checkpoint with these configs as its
    plain `TokenizersBackend`: that class named, no remote code declared, and a model type
    transformers gives no tokenizer class of its own (`mapped_model_types`)."""
    model_type = model_cfg.get("model_type")
    return (config.get("tokenizer_class") == "TokenizersBackend" and "auto_map" not in config
            and "auto_map" not in model_cfg and isinstance(model_type, str) and bool(model_type)
            and model_type not in mapped_model_types)


def _content(token: Any) -> str | None:
    """Returns a special token's text, given as a string or as an AddedToken's dict."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


class Encoding(dict[str, Any]):
    """A tokenizer call's answer, as transformers' `BatchEncoding` reads: by key or attribute."""

    @property
    def input_ids(self) -> Any:
        return self["input_ids"]

    @property
    def attention_mask(self) -> Any:
        return self["attention_mask"]


class Tokenizer:
    """A plain checkpoint's tokenizer (see the module docstring). Thread-safe for reading."""

    def __init__(self, backend: Any, config: Mapping[str, Any], chat_template: str | None) -> None:
        self._backend = backend
        self._backend.encode_special_tokens = False  # transformers' split_special_tokens=False
        self.special_tokens_map = {n: t for n in SPECIAL_NAMES if (t := _content(config.get(n))) is not None}
        self.chat_template = chat_template
        self.model_max_length: int = config.get("model_max_length", _NO_MAX_LENGTH)
        self.padding_side: str = config.get("padding_side", "right")
        self.truncation_side: str = config.get("truncation_side", "right")
        self._template: Any = None

    @classmethod
    def from_pretrained(cls, path: str | Path, mapped_model_types: frozenset[str]) -> Tokenizer | None:
        """Returns the tokenizer of the checkpoint at `path`, or None when its transformers
        tokenizer is not a plain tokenizer.json (`load_plain_backend`)."""
        path = Path(path)
        loaded = load_plain_backend(path, mapped_model_types)
        if loaded is None:
            return None
        backend, config = loaded
        jinja = path / "chat_template.jinja"
        template = jinja.read_text() if jinja.is_file() else config.get("chat_template")
        return cls(backend, config, template or None)

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens_map.get("eos_token")

    @property
    def eos_token_id(self) -> int | None:
        """Returns the eos token's id (None without one)."""
        return None if self.eos_token is None else self._backend.token_to_id(self.eos_token)

    @property
    def pad_token(self) -> str | None:
        return self.special_tokens_map.get("pad_token")

    @property
    def pad_token_id(self) -> int | None:
        """Returns the padding token's id (None without one)."""
        return None if self.pad_token is None else self._backend.token_to_id(self.pad_token)

    @property
    def vocab_size(self) -> int:
        """Returns the vocabulary's size, added tokens included."""
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Returns `text`'s token ids (with the post-processor's special tokens if asked)."""
        return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: int | Sequence[int], skip_special_tokens: bool = False) -> str:
        """Returns the text of `token_ids` (special tokens left out if asked)."""
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        return str(self._backend.decode(ids, skip_special_tokens=skip_special_tokens))

    def __call__(self, text: str | Sequence[str], add_special_tokens: bool = True, padding: bool | str = False,
                 truncation: bool | str | None = None, max_length: int | None = None,
                 pad_to_multiple_of: int | None = None, padding_side: str | None = None,
                 return_tensors: str | None = None) -> Encoding:
        """Returns `text`'s ids as transformers' tokenizers do (what vLLM's `get_tokenizer()`
        gives): `{"input_ids": ids, "attention_mask": mask}`, one row per text for a batch; also
        as attributes (`.input_ids`). `padding` (True/"longest", "max_length", False),
        `truncation` (True/"longest_first"/"only_first", False), `max_length`,
        `pad_to_multiple_of` and `padding_side` mean what they mean there, with the same defaults
        (max_length alone truncates; the config's model_max_length where none is given);
        `return_tensors` "pt" (torch) or "np" (numpy) gives (batch, length) int64 arrays.
        ValueError names any value it cannot honour (another strategy or tensor type, padding
        without a pad token, ragged rows as tensors)."""
        pad_to, cut_to = self._lengths(padding, truncation, max_length, pad_to_multiple_of)
        side = self.padding_side if padding_side is None else padding_side
        if side not in _SIDES:
            raise ValueError(f"padding_side={side!r} is not supported: use 'left' or 'right'")
        if return_tensors not in (None, "pt", "np"):
            raise ValueError(f"return_tensors={return_tensors!r} is not supported: use 'pt', 'np' or None")
        batch = [self._encode_cut(t, add_special_tokens, cut_to) for t in ([text] if isinstance(text, str) else text)]
        masks = [[1] * len(ids) for ids in batch]
        if pad_to is not None and batch:
            target = max(len(ids) for ids in batch) if pad_to == "longest" else int(pad_to)
            if pad_to_multiple_of and target % pad_to_multiple_of:
                target += pad_to_multiple_of - target % pad_to_multiple_of
            pad_id = cast(int, self.pad_token_id)  # `_lengths` refused padding without one
            for ids, mask in zip(batch, masks):
                n = target - len(ids)
                if n > 0 and side == "left":
                    ids[:0], mask[:0] = [pad_id] * n, [0] * n
                elif n > 0:
                    ids += [pad_id] * n
                    mask += [0] * n
        if return_tensors is not None:
            if len({len(ids) for ids in batch}) > 1:
                raise ValueError(f"return_tensors={return_tensors!r} needs rows of one length: "
                                 "pass padding=True (or truncation with padding='max_length')")
            return Encoding(input_ids=_array(batch, return_tensors), attention_mask=_array(masks, return_tensors))
        if isinstance(text, str):
            return Encoding(input_ids=batch[0], attention_mask=masks[0])
        return Encoding(input_ids=batch, attention_mask=masks)

    def _lengths(self, padding: bool | str, truncation: bool | str | None, max_length: int | None,
                 pad_to_multiple_of: int | None) -> tuple[str | int | None, int | None]:
        """Returns (what rows are padded to: "longest", a length or None; the length rows are
        cut to or None) as transformers resolves these arguments."""
        if max_length is not None and padding is False and truncation is None:
            truncation = True  # transformers: max_length alone truncates
        pad: str | int | None
        if padding is True or padding == "longest":
            pad = "longest"
        elif padding is False or padding == "do_not_pad":
            pad = None
        elif padding == "max_length":
            pad = "max_length"
        else:
            raise ValueError(f"padding={padding!r} is not supported: use True, 'longest', 'max_length' or False")
        if truncation is True or truncation in ("longest_first", "only_first"):
            cut = True
        elif truncation is None or truncation is False or truncation == "do_not_truncate":
            cut = False
        else:
            raise ValueError(f"truncation={truncation!r} is not supported for single texts: "
                             "use True, 'longest_first', 'only_first' or False")
        if max_length is None and (pad == "max_length" or cut):
            if self.model_max_length > _LARGE_INTEGER:  # no limit: transformers neither pads nor cuts
                pad, cut = (None if pad == "max_length" else pad), False
            else:
                max_length = self.model_max_length
        if pad is not None and self.pad_token_id is None:
            raise ValueError("padding needs a pad token and this tokenizer has none")
        if (cut and pad is not None and pad_to_multiple_of and max_length is not None
                and max_length % pad_to_multiple_of):
            raise ValueError(f"truncation length ({max_length}) is not a multiple of "
                             f"pad_to_multiple_of ({pad_to_multiple_of})")
        if pad == "max_length":
            pad = max_length
        return pad, (max_length if cut else None)

    def _encode_cut(self, text: str, add_special_tokens: bool, max_length: int | None) -> list[int]:
        """Returns `text`'s ids, at most `max_length` of them with the special tokens (cut on
        the truncation side before they are added, as `tokenizers` truncates)."""
        if max_length is None:
            return self.encode(text, add_special_tokens)
        added = self._backend.num_special_tokens_to_add(False) if add_special_tokens else 0
        if max_length < added:
            raise ValueError(f"max_length={max_length} leaves no room for the {added} special tokens added")
        encoding = self._backend.encode(text, add_special_tokens=False)
        encoding.truncate(max_length - added, direction=self.truncation_side)
        if add_special_tokens:
            encoding = self._backend.post_process(encoding, None, True)
        return list(encoding.ids)

    def batch_decode(self, sequences: Iterable[Sequence[int]], skip_special_tokens: bool = False) -> list[str]:
        """Returns the text of each id sequence (`decode`)."""
        return [self.decode(ids, skip_special_tokens) for ids in sequences]

    def convert_ids_to_tokens(self, token_ids: Iterable[int]) -> list[str | None]:
        """Returns each id's token string (None for an id outside the vocabulary)."""
        return [self._backend.id_to_token(i) for i in token_ids]

    def apply_chat_template(self, conversation: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
                            add_generation_prompt: bool = False, tokenize: bool = True,
                            padding: bool | str = False, truncation: bool = False, max_length: int | None = None,
                            return_tensors: str | None = None, return_dict: bool = True) -> Any:
        """Returns `conversation` (or each of a list of conversations) rendered with the
        checkpoint's chat template as transformers renders it without tools or documents (its
        sandbox, filters and globals; the special tokens as template variables; None-valued
        message fields dropped). With transformers' defaults: tokenized (no special tokens
        added) into an `Encoding` as `__call__` gives one (`padding`, `truncation`,
        `max_length`, `return_tensors` passed on), its input_ids alone if not `return_dict`,
        the text if not `tokenize`. ValueError without a template or for an empty conversation."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        if not conversation:
            raise ValueError("cannot apply a chat template to an empty conversation")
        if self._template is None:
            self._template = compile_chat_template(self.chat_template)
        batched = isinstance(conversation[0], (list, tuple))
        convs = cast("Sequence[Sequence[Mapping[str, Any]]]", conversation if batched else [conversation])
        texts = [self._template.render(messages=[{k: v for k, v in dict(m).items() if v is not None} for m in conv],
                                       tools=None, documents=None, add_generation_prompt=add_generation_prompt,
                                       **self.special_tokens_map) for conv in convs]
        if not tokenize:
            return texts if batched else texts[0]
        out = self(texts if batched else texts[0], add_special_tokens=False, padding=padding, truncation=truncation,
                   max_length=max_length, return_tensors=return_tensors)
        return out if return_dict else out.input_ids


def _array(rows: list[list[int]], kind: str) -> Any:
    """Returns `rows` (of one length) as a (len(rows), length) int64 torch tensor ("pt") or
    numpy array ("np")."""
    if kind == "pt":
        import torch

        return torch.tensor(rows, dtype=torch.long)
    import numpy

    return numpy.array(rows, dtype=numpy.int64)


def compile_chat_template(source: str) -> Any:
    """Returns `source` compiled in the environment transformers renders chat templates in: an
    immutable sandbox trimming blocks, loop controls, a `generation` block tag, its `tojson`
    (no HTML escaping), `raise_exception`, `strftime_now`, and `dict`/`namespace` that refuse
    underscore names."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """`{% generation %}...{% endgeneration %}` renders its body (transformers marks the
        assistant's tokens with it)."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return str(caller())

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    def check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot store underscore names, got {name!r}")

    class TemplateDict:
        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=TemplateDict(),
                       namespace=TemplateNamespace)
    return env.from_string(source)
