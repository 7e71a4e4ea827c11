"""The lookup channel's operations (connector/vllm/lookup_ops.py): each question and its answer
survive their encodings unchanged, and a body that is malformed, or an answer that is not one
to its question, is a ValueError naming the problem, never a wrong answer."""

from __future__ import annotations

from typing import Any

import pytest

from connector.vllm.lookup_ops import (
    MAX_KEYS,
    MAX_TEXT_BYTES,
    QUESTIONS,
    ClearQuestion,
    ControlQuestion,
    EnginePrefixQuestion,
    ExplainQuestion,
    FindQuestion,
    FoundRun,
    HeldQuestion,
    Question,
    Reader,
    TierPrefixQuestion,
)

CHAIN = bytes(range(16))
FIND = FindQuestion("m:ident", "tenant", 9, 4, bytes(16), [(4, 8, CHAIN), (8, 12, CHAIN[::-1])], list(range(4, 14)))
CASES: list[tuple[Question[Any], Any]] = [
    (HeldQuestion(["a", "b", "ç"]), [True, False, True]),
    (TierPrefixQuestion(["a", "b"]), {"0:cpu": 2, "1:disk": 0}),
    (ClearQuestion(), True),
    (ExplainQuestion([1, 2, 3], None, True), {"tiers": {"0:cpu": {"cause": "evicted"}}}),
    (ExplainQuestion([1, 2, 3], "s", False), None),
    (ControlQuestion({"op": "inspect", "token_ids": [1, 2]}), {"chunks": []}),
    (ControlQuestion({"op": "clear", "all": True}), None),
    (EnginePrefixQuestion([5, 6, 7], "s"), 2),
    (EnginePrefixQuestion([5], None), None),
    (FIND, FoundRun([1], ("0:cpu", "1:disk"), 10, CHAIN, 0)),
    (FIND, FoundRun([], ("0:cpu",))),
    (FIND, None),
]


def _decode(kind: type[Question[Any]], body: bytes) -> Question[Any]:
    r = Reader(body)
    q = kind.decode(r)
    r.end()
    return q


def _answer(q: Question[Any], body: bytes) -> Any:
    r = Reader(body)
    a = q.decode_answer(r)
    r.end()
    return a


def test_op_codes_are_distinct_and_every_question_type_is_listed() -> None:
    kinds = {HeldQuestion, TierPrefixQuestion, ClearQuestion, ExplainQuestion, ControlQuestion,
             EnginePrefixQuestion, FindQuestion}
    assert set(QUESTIONS.values()) == kinds and len(QUESTIONS) == len(kinds)
    assert all(code == kind.op and 0 <= code < 256 for code, kind in QUESTIONS.items())


@pytest.mark.parametrize(("question", "answer"), CASES)
def test_each_question_and_answer_survive_their_encodings(question: Question[Any], answer: Any) -> None:
    assert _decode(type(question), question.encode()) == question
    assert _answer(question, question.encode_answer(answer)) == answer


@pytest.mark.parametrize(("question", "answer"), [c for c in CASES if c[1] is not None])
def test_a_truncated_or_padded_body_is_refused(question: Question[Any], answer: Any) -> None:
    for body, decode in ((question.encode(), lambda b: _decode(type(question), b)),
                         (question.encode_answer(answer), lambda b: _answer(question, b))):
        if body:
            with pytest.raises(ValueError, match="truncated"):
                decode(body[:-1])
        with pytest.raises(ValueError, match="past a body's last field"):
            decode(body + b"\0")


@pytest.mark.parametrize(("question", "answer", "message"), [
    (HeldQuestion(["a"]), b"\x02", "0 or 1 per key"),
    (TierPrefixQuestion(["a"]), TierPrefixQuestion(["a", "b"]).encode_answer({"0:cpu": 2}), "holds 2 of 1 keys"),
    (EnginePrefixQuestion([1, 2], None), EnginePrefixQuestion([1, 2, 3], None).encode_answer(3),
     "3 cached tokens of a 2-token prompt"),
    (FIND, FIND.encode_answer(FoundRun([0, 0, 0], ("0:cpu",))), "a run of 3 chunks in an answer about 2"),
    (FIND, FIND.encode_answer(FoundRun([1], ("0:cpu",))), "names a tier it did not list"),
    (FIND, FIND.encode_answer(FoundRun([0], ("0:cpu",), 12, CHAIN)), "partial chunk outside the span"),
    (FIND, FIND.encode_answer(FoundRun([0, 0], ("0:cpu",), 13, CHAIN)), "partial chunk outside the span"),
])
def test_an_answer_that_is_not_one_to_its_question_is_refused(question: Question[Any], answer: bytes,
                                                              message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _answer(question, answer)


def test_bounds_are_checked_on_both_sides() -> None:
    with pytest.raises(ValueError, match=f"at most {MAX_KEYS}"):
        HeldQuestion(["k"] * (MAX_KEYS + 1)).encode()
    with pytest.raises(ValueError, match=f"at most {MAX_TEXT_BYTES}"):
        HeldQuestion(["k" * (MAX_TEXT_BYTES + 1)]).encode()
    with pytest.raises(ValueError, match=f"at most {MAX_KEYS}"):
        _decode(HeldQuestion, (MAX_KEYS + 1).to_bytes(4, "little"))
    with pytest.raises(ValueError, match="spans run past its tokens"):
        bad = FindQuestion("m", None, 0, 0, bytes(16), [(0, 8, CHAIN)], [1, 2, 3])
        _decode(FindQuestion, bad.encode())
    with pytest.raises(ValueError, match="JSON object"):
        _decode(ControlQuestion, (2).to_bytes(4, "little") + b"[]")
