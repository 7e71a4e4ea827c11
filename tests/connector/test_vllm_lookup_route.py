"""`vllm serve`'s /kv/lookup (connector/vllm_lookup_route.py), the parts that need no vLLM: the
body's forms, tier answers turned into tokens, and the middleware's pass-through. The route
inside a real `vllm serve`: tests/vllm/test_router.py."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import torch

from connector.keyspace import Keyspace
from connector.vllm_lookup_route import KvLookupRoute, Message, Rejected, Scope, held_tokens, lookup_form


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


@pytest.mark.parametrize("layerwise", [False, True])
def test_tier_answers_become_leading_tokens_never_the_last(layerwise: bool) -> None:
    ks = Keyspace("m", torch.float32, 4, num_layers=3, layerwise=layerwise)
    per = ks.values_per_chunk
    ids = list(range(10))  # chunks [0,4) [4,8) [8,10)
    hits = {"0:cpu": 2 * per, "1:disk": 3 * per, "2:redis": per - 1 if layerwise else 0}
    assert held_tokens(ks, ids, hits) == {"0:cpu": 8, "1:disk": 9, "2:redis": 0}
    assert held_tokens(ks, list(range(8)), {"0:cpu": 2 * per}) == {"0:cpu": 7}
    assert held_tokens(ks, ids, {}) == {}


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
    start, body = _run(route, {"type": "http", "path": "/kv/lookup", "method": "GET", "root_path": ""})
    assert start["status"] == 405 and "takes POST" in json.loads(body["body"])["error"]["message"]
    assert seen == ["/v1/completions", "/kv/lookups", "/health", ""]  # answered by the route itself
