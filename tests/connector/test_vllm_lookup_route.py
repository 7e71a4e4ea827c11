"""`vllm serve`'s /kv/lookup (connector/vllm/lookup_route.py), the parts that need no vLLM: the
body's forms, tier answers turned into tokens, and the middleware's pass-through (the control
routes, one per CONTROL_OPS entry, are its own). The route inside a real `vllm serve`:
tests/vllm/test_router.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from connector.presence import Found, HeldKeys, Presence, held_tokens
from connector.vllm.control_ops import CONTROL_OPS
from connector.vllm.lookup_route import KvLookupRoute, Message, Rejected, Scope, lookup_form
from kvkeys.keyspace import Keyspace


@pytest.mark.parametrize(("body", "form"), [
    ({"prompt": "hi", "model": "m"}, "prompt"),
    ({"prompt_token_ids": [0, 5, 7]}, "prompt_token_ids"),
    ({"messages": [{"role": "user", "content": "hi"}], "prompt": None}, "messages"),
])
def test_each_form_is_taken(body: dict[str, Any], form: str) -> None:
    assert lookup_form(body) == (form, body[form])


@pytest.mark.parametrize(("body", "message"), [
    ([1, 2], "JSON object"),
    ({}, "exactly one of"),
    ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "exactly one of"),
    ({"prompt": ""}, "non-empty string"),
    ({"prompt": ["a", "b"]}, "non-empty string"),
    ({"prompt_token_ids": []}, "non-empty list of non-negative integers"),
    ({"prompt_token_ids": [1, -2]}, "non-negative integers"),
    ({"prompt_token_ids": [1, True]}, "non-negative integers"),
    ({"prompt_token_ids": "1 2"}, "non-negative integers"),
    ({"messages": {"role": "user"}}, "non-empty list of chat messages"),
])
def test_a_bad_body_is_a_400_naming_the_problem(body: Any, message: str) -> None:
    with pytest.raises(Rejected, match=message) as info:
        lookup_form(body)
    assert info.value.status == 400 and info.value.body()["error"]["message"] == info.value.message


@pytest.mark.parametrize("split", ["whole", "layerwise", "heads"])
def test_tier_answers_become_leading_tokens_never_the_last(split: str) -> None:
    ks = Keyspace("m", torch.float32, 4, num_layers=3, layerwise=split == "layerwise",
                  heads=(0, 2) if split == "heads" else None)
    per = ks.values_per_chunk
    ids = list(range(10))  # chunks [0,4) [4,8) [8,10)
    spans = ks.spans(ids)
    held = {"0:cpu": 2 * per, "1:disk": 3 * per, "2:redis": per - 1}  # redis: one value short of a chunk
    presence = Presence([_Answers(held)])
    assert held_tokens(spans, presence.tier_prefix_chunks(ks, spans), len(ids)) == {"0:cpu": 8, "1:disk": 9,
                                                                                  "2:redis": 0}
    short = ks.spans(list(range(8)))
    one = Presence([_Answers({"0:cpu": 2 * per})])
    assert held_tokens(short, one.tier_prefix_chunks(ks, short), 8) == {"0:cpu": 7}
    assert held_tokens(spans, {}, len(ids)) == {}


class _Answers(HeldKeys):
    """Tiers that hold, each, their first n stored keys of whatever is asked."""

    def __init__(self, leading: dict[str, int]) -> None:
        self.leading = leading

    def held(self, keys: Sequence[str]) -> list[bool]:
        return [i < max(self.leading.values()) for i in range(len(keys))]

    def tier_prefix_hits(self, keys: Sequence[str]) -> dict[str, int]:
        return {name: min(n, len(keys)) for name, n in self.leading.items()}

    def find(self, *args: Any) -> Found:
        raise AssertionError("/kv/lookup asks each tier's run, never the planner's lookup")


def _run(app: KvLookupRoute, scope: Scope) -> list[Message]:
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return sent


def test_other_paths_go_straight_through_and_lookup_takes_post() -> None:
    seen: list[str] = []

    async def inner(scope: Scope, receive: Any, send: Any) -> None:
        seen.append(scope.get("path", ""))

    route = KvLookupRoute(inner)
    for path in ("/v1/completions", "/kv/lookups", "/health"):
        assert _run(route, {"type": "http", "path": path, "method": "POST"}) == []
    _run(route, {"type": "lifespan"})
    assert seen == ["/v1/completions", "/kv/lookups", "/health", ""]
    for path in ("/kv/lookup", *(f"/kv/{op}" for op in CONTROL_OPS)):  # the control routes: one per op
        start, body = _run(route, {"type": "http", "path": "/api" + path, "method": "GET", "root_path": "/api"})
        assert start["status"] == 405 and f"{path} takes POST" in json.loads(body["body"])["error"]["message"]
    assert seen == ["/v1/completions", "/kv/lookups", "/health", ""]  # answered by the route itself
