"""The lookup channel's operations: one typed question per operation, each knowing its op code,
its answer's type and both bodies' encodings (connector/vllm/lookup_channel.py carries them).

Every body is fields in order, little-endian: u8/u32/i64 numbers, a text as a u32 length and its
UTF-8 bytes (length 0xFFFFFFFF: None), a list as a u32 count and its items, a JSON document as
a text. No pickle. Decoding reads every byte of a body, checks each count against its bound and
an answer against its question (a tier index the answer did not list, a count past the keys
asked), and raises ValueError naming what is wrong.

| question | asked by | answer |
|---|---|---|
| `FindQuestion` | the planner, one per admitted request per rank | `FoundRun` or None (refused) |
| `HeldQuestion` | the saver, explain | per key, held or not |
| `TierPrefixQuestion` | `vllm serve`'s /kv/lookup | per tier, leading keys it holds |
| `ClearQuestion` | vLLM's `reset_cache` | done or not |
| `ExplainQuestion` | /kv/lookup with `"explain": true` | explain's document, or None |
| `ControlQuestion` | the /kv/<op> control routes | the op's document, or None |
| `EnginePrefixQuestion` | /kv/lookup, of the scheduler side | leading tokens, or None |
"""

from __future__ import annotations

import json
import struct
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

from connector.presence import Found
from kvkeys.keyspace import Keyspace, Span

MAX_KEYS = 1 << 16  # keys, spans or token ids in one question
MAX_TEXT_BYTES = 4096  # a key or a tier name
MAX_TIERS = 64
MAX_BODY_BYTES = 16 << 20  # a question's or an answer's body (an 8k-token find is about 70 KiB)

A = TypeVar("A")
Q = TypeVar("Q", bound="Question[Any]")
_U8, _U32, _I64 = struct.Struct("<B"), struct.Struct("<I"), struct.Struct("<q")
_NONE = 0xFFFFFFFF  # a text's length when it is None
_SPAN = struct.Struct("<qq16s")


class Reader:
    """Reads a body's fields in order; ValueError when one runs past its end or breaks a bound."""

    def __init__(self, raw: bytes) -> None:
        self.raw = raw
        self.at = 0

    def take(self, n: int) -> bytes:
        if n < 0 or self.at + n > len(self.raw):
            raise ValueError("lookup channel: a truncated body")
        out = self.raw[self.at:self.at + n]
        self.at += n
        return out

    def unpack(self, fmt: struct.Struct) -> tuple[Any, ...]:
        return fmt.unpack(self.take(fmt.size))

    def u8(self) -> int:
        return int(self.unpack(_U8)[0])

    def u32(self) -> int:
        return int(self.unpack(_U32)[0])

    def i64(self) -> int:
        return int(self.unpack(_I64)[0])

    def count(self, what: str, limit: int) -> int:
        """Returns a list's u32 count; ValueError past `limit`."""
        n = self.u32()
        if n > limit:
            raise ValueError(f"lookup channel: {n} {what} in one body, at most {limit}")
        return n

    def text(self, what: str) -> str | None:
        n = self.u32()
        if n == _NONE:
            return None
        if n > MAX_TEXT_BYTES:
            raise ValueError(f"lookup channel: {what} of {n} bytes, at most {MAX_TEXT_BYTES}")
        return self.take(n).decode()

    def name(self, what: str) -> str:
        """Returns a text that may not be None."""
        value = self.text(what)
        if value is None:
            raise ValueError(f"lookup channel: {what} missing")
        return value

    def ints(self, what: str) -> list[int]:
        n = self.count(what, MAX_KEYS)
        return list(struct.unpack(f"<{n}q", self.take(8 * n)))

    def document(self) -> dict[str, Any]:
        """Returns a JSON object (a u32 length and its UTF-8 JSON)."""
        doc = json.loads(self.take(self.u32()))
        if not isinstance(doc, dict):
            raise ValueError("lookup channel: a JSON document is a JSON object")
        return doc

    def end(self) -> None:
        """ValueError unless every byte was read."""
        if self.at != len(self.raw):
            raise ValueError(f"lookup channel: {len(self.raw) - self.at} bytes past a body's last field")


def text(value: str | None) -> bytes:
    if value is None:
        return _U32.pack(_NONE)
    raw = value.encode()
    if len(raw) > MAX_TEXT_BYTES:
        raise ValueError(f"lookup channel: a text of {len(raw)} bytes, at most {MAX_TEXT_BYTES}")
    return _U32.pack(len(raw)) + raw


def ints(values: Sequence[int]) -> bytes:
    if len(values) > MAX_KEYS:
        raise ValueError(f"lookup channel: {len(values)} token ids in one question, at most {MAX_KEYS}")
    return _U32.pack(len(values)) + struct.pack(f"<{len(values)}q", *values)


def texts(values: Sequence[str]) -> bytes:
    if len(values) > MAX_KEYS:
        raise ValueError(f"lookup channel: {len(values)} keys in one question, at most {MAX_KEYS}")
    return _U32.pack(len(values)) + b"".join(text(v) for v in values)


def document(doc: dict[str, Any]) -> bytes:
    raw = json.dumps(doc).encode()
    return _U32.pack(len(raw)) + raw


def _optional(value: bytes | None) -> bytes:
    """A status byte (0: the value follows, 1: None) and the value."""
    return b"\x01" if value is None else b"\x00" + value


class Question(ABC, Generic[A]):
    """One operation's question, answered by an `A`. `op` is its code on the wire."""

    op: ClassVar[int]

    @abstractmethod
    def encode(self) -> bytes:
        """Returns this question's body."""

    @classmethod
    @abstractmethod
    def decode(cls: type[Q], r: Reader) -> Q:
        """Returns the question in body `r` (read to its end); ValueError if malformed."""

    @abstractmethod
    def encode_answer(self, answer: A) -> bytes:
        """Returns the body of `answer` to this question."""

    @abstractmethod
    def decode_answer(self, r: Reader) -> A:
        """Returns the answer in body `r` (read to its end); ValueError if malformed or not an
        answer to this question."""


K = TypeVar("K", bound="_KeysQuestion[Any]")


@dataclass(frozen=True)
class _KeysQuestion(Question[A]):
    """A question about stored keys, its body the list of them."""

    keys: list[str]

    def encode(self) -> bytes:
        return texts(self.keys)

    @classmethod
    def decode(cls: type[K], r: Reader) -> K:
        return cls([r.name("a key") for _ in range(r.count("keys", MAX_KEYS))])


@dataclass(frozen=True)
class HeldQuestion(_KeysQuestion[list[bool]]):
    """Which of `keys` the worker holds (stored, or carried by a pending store): a byte per key."""

    op = 0

    def encode_answer(self, answer: list[bool]) -> bytes:
        return bytes(answer)

    def decode_answer(self, r: Reader) -> list[bool]:
        raw = r.take(len(self.keys))
        if any(b > 1 for b in raw):
            raise ValueError("lookup channel: a held answer is 0 or 1 per key")
        return [b == 1 for b in raw]


@dataclass(frozen=True)
class TierPrefixQuestion(_KeysQuestion[dict[str, int]]):
    """Per tier name (fastest first), how many of `keys` from the start that tier holds by itself."""

    op = 1

    def encode_answer(self, answer: dict[str, int]) -> bytes:
        return _U32.pack(len(answer)) + b"".join(text(name) + _U32.pack(n) for name, n in answer.items())

    def decode_answer(self, r: Reader) -> dict[str, int]:
        hits: dict[str, int] = {}
        for _ in range(r.count("tiers", MAX_TIERS)):
            name, held = r.name("a tier name"), r.u32()
            if held > len(self.keys):
                raise ValueError(f"lookup channel: tier {name!r} holds {held} of {len(self.keys)} keys")
            hits[name] = held
        return hits


@dataclass(frozen=True)
class ClearQuestion(Question[bool]):
    """vLLM's `reset_cache`: the worker clears its process-local tiers (every tier with
    `reset_clears_shared_tiers`); answered True once it did."""

    op = 2

    def encode(self) -> bytes:
        return b""

    @classmethod
    def decode(cls, r: Reader) -> ClearQuestion:
        return cls()

    def encode_answer(self, answer: bool) -> bytes:
        return bytes([answer])

    def decode_answer(self, r: Reader) -> bool:
        return r.u8() == 1


class _DocumentQuestion(Question["dict[str, Any] | None"]):
    """A question answered with a JSON document, or None where the worker has no such part."""

    def encode_answer(self, answer: dict[str, Any] | None) -> bytes:
        return _optional(None if answer is None else document(answer))

    def decode_answer(self, r: Reader) -> dict[str, Any] | None:
        return None if r.u8() else r.document()


@dataclass(frozen=True)
class ExplainQuestion(_DocumentQuestion):
    """Why the worker's tiers hold no more of a prompt (connector/explain.py's document; None:
    the worker has no explain)."""

    op = 3
    token_ids: list[int]
    cache_salt: str | None
    other_tenants: bool

    def encode(self) -> bytes:
        return ints(self.token_ids) + text(self.cache_salt) + bytes([self.other_tenants])

    @classmethod
    def decode(cls, r: Reader) -> ExplainQuestion:
        return cls(r.ints("token ids"), r.text("a cache_salt"), r.u8() == 1)


@dataclass(frozen=True)
class ControlQuestion(_DocumentQuestion):
    """A cache-control op (`{"op": name, ...}`, connector/vllm/control_ops.py) as the route
    received it; answered with its document (a refusal as `{"error": ...}`), None where the
    worker has no controller."""

    op = 4
    request: dict[str, Any]

    def encode(self) -> bytes:
        return document(self.request)

    @classmethod
    def decode(cls, r: Reader) -> ControlQuestion:
        return cls(r.document())


@dataclass(frozen=True)
class EnginePrefixQuestion(Question["int | None"]):
    """How many leading tokens of a prompt the engine's own prefix cache holds for requests of
    `cache_salt` (asked of the scheduler side; None: it has no engine)."""

    op = 5
    token_ids: list[int]
    cache_salt: str | None

    def encode(self) -> bytes:
        return ints(self.token_ids) + text(self.cache_salt)

    @classmethod
    def decode(cls, r: Reader) -> EnginePrefixQuestion:
        return cls(r.ints("token ids"), r.text("a cache_salt"))

    def encode_answer(self, answer: int | None) -> bytes:
        return _optional(None if answer is None else _I64.pack(answer))

    def decode_answer(self, r: Reader) -> int | None:
        if r.u8():
            return None
        n = r.i64()
        if not 0 <= n <= len(self.token_ids):
            raise ValueError(f"lookup channel: {n} cached tokens of a {len(self.token_ids)}-token prompt")
        return n


@dataclass(frozen=True)
class FoundRun:
    """A find's answer on the wire: per chunk of the held run its tier's index in `tier_names`,
    and the partial chunk stored where the run stops (its end and chain; `partial_end` 0: none)."""

    tiers: list[int]
    tier_names: tuple[str, ...]
    partial_end: int = 0
    partial_chain: bytes = bytes(16)
    partial_tier: int = 0

    @classmethod
    def of(cls, found: Found) -> FoundRun:
        p = found.partial
        return cls(found.tiers, found.tier_names, 0 if p is None else p.end,
                   bytes(16) if p is None else p.chain, found.partial_tier)

    def found(self, keyspace: Keyspace, spans: Sequence[Span]) -> Found:
        """Returns this run as a `Found` over the `spans` asked, the partial chunk keyed in `keyspace`."""
        if not self.partial_end:
            return Found(self.tiers, self.tier_names)
        start = spans[len(self.tiers)].start
        partial = Span(start, self.partial_end, keyspace.key(self.partial_chain), self.partial_chain)
        return Found(self.tiers, self.tier_names, partial, self.partial_tier)


_PARTIAL = struct.Struct("<q16sB")


@dataclass(frozen=True)
class FindQuestion(Question["FoundRun | None"]):
    """The planner's lookup (`HeldKeys.find`'s arguments): spans as (start, end, chain), keyed
    again by the worker in its own keyspace, which must have the asker's `identity`; answered
    with the run held (None: refused, the worker keys chunks otherwise)."""

    op = 6
    identity: str
    cache_salt: str | None
    after: int
    base: int
    parent: bytes
    spans: list[tuple[int, int, bytes]]
    tokens: list[int]

    def encode(self) -> bytes:
        if len(self.spans) > MAX_KEYS:
            raise ValueError(f"lookup channel: {len(self.spans)} spans in one question, at most {MAX_KEYS}")
        return b"".join([text(self.identity), text(self.cache_salt), _I64.pack(self.after), _I64.pack(self.base),
                         self.parent, _U32.pack(len(self.spans)), *(_SPAN.pack(*sp) for sp in self.spans),
                         ints(self.tokens)])

    @classmethod
    def decode(cls, r: Reader) -> FindQuestion:
        identity, salt = r.name("a keyspace identity"), r.text("a cache_salt")
        after, base, parent = r.i64(), r.i64(), r.take(16)
        spans = [r.unpack(_SPAN) for _ in range(r.count("spans", MAX_KEYS))]
        tokens = r.ints("token ids")
        if any(not base <= s < e <= base + len(tokens) for s, e, _ in spans):
            raise ValueError("lookup channel: a find question's spans run past its tokens")
        return cls(identity, salt, after, base, parent, [(s, e, c) for s, e, c in spans], tokens)

    def encode_answer(self, answer: FoundRun | None) -> bytes:
        if answer is None:
            return b"\x01"
        return b"".join([b"\x00", _U32.pack(len(answer.tier_names)), *(text(n) for n in answer.tier_names),
                         _U32.pack(len(answer.tiers)), bytes(answer.tiers),
                         _PARTIAL.pack(answer.partial_end, answer.partial_chain, answer.partial_tier)])

    def decode_answer(self, r: Reader) -> FoundRun | None:
        if r.u8():
            return None
        names = tuple(r.name("a tier name") for _ in range(r.count("tiers", MAX_TIERS)))
        run = r.u32()
        if run > len(self.spans):
            raise ValueError(f"lookup channel: a run of {run} chunks in an answer about {len(self.spans)}")
        tiers = list(r.take(run))
        end, chain, tier = r.unpack(_PARTIAL)
        if any(t >= len(names) for t in tiers) or (end and tier >= len(names)):
            raise ValueError("lookup channel: an answer names a tier it did not list")
        if end and (run == len(self.spans) or not self.spans[run][0] < end < self.spans[run][1]):
            raise ValueError("lookup channel: a partial chunk outside the span it starts")
        return FoundRun(tiers, names, end, chain, tier)


QUESTIONS: dict[int, type[Question[Any]]] = {q.op: q for q in (
    HeldQuestion, TierPrefixQuestion, ClearQuestion, ExplainQuestion, ControlQuestion, EnginePrefixQuestion,
    FindQuestion)}
"""Each question type by its op code."""
