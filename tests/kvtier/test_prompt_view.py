"""What the router reads from a request to route it (kvtier/router/prompt_view.py): the
`/kv/lookup` body for each prompt form and the prefix-hash key."""

from __future__ import annotations

import struct

from kvtier.router.prompt_view import PREFIX_TOKENS, view_request


def test_each_prompt_form_becomes_its_lookup_body() -> None:
    assert view_request({"model": "m", "prompt": "hello", "max_tokens": 3}).lookup == {"model": "m", "prompt": "hello"}
    ids = list(range(300))
    view = view_request({"prompt": [ids, [1]]})  # a batch routes by its first prompt
    assert view.lookup == {"prompt_token_ids": ids}
    assert view.prefix_key == struct.pack(f"<{PREFIX_TOKENS}I", *ids[:PREFIX_TOKENS])
    msgs = [{"role": "user", "content": "hi"}]
    assert view_request({"model": "m", "messages": msgs}).lookup == {"model": "m", "messages": msgs}
    assert view_request({"model": "m"}).lookup is None


def test_fields_that_change_the_tokens_go_with_the_lookup() -> None:
    """A vLLM backend tokenizes the lookup as it will the request (its /tokenize takes these)."""
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure"}]
    body = {"model": "m", "messages": msgs, "add_generation_prompt": False, "continue_final_message": True,
            "chat_template_kwargs": {"enable_thinking": False}, "temperature": 0, "tools": None}
    assert view_request(body).lookup == {"model": "m", "messages": msgs, "add_generation_prompt": False,
                                         "continue_final_message": True,
                                         "chat_template_kwargs": {"enable_thinking": False}}
    assert view_request({"prompt": "x", "add_special_tokens": False}).lookup == {"prompt": "x",
                                                                                  "add_special_tokens": False}
