"""What the router reads from a request body to route it: the prompt in `/kv/lookup`'s form
and the prompt's first chunk (the prefix-hash key). Parsing is lenient on purpose: the
backend validates the request and answers any error in OpenAI's shape."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

PREFIX_CHARS = 1024  # about one 256-token chunk of English text
PREFIX_TOKENS = 256
TOKENIZE_FIELDS = ("add_special_tokens", "add_generation_prompt", "continue_final_message", "chat_template",
                   "chat_template_kwargs", "tools")
"""Request fields that change a prompt's tokens; passed on in the lookup, so a `vllm serve`
backend tokenizes it as it will the request (connector/vllm/lookup_route.py; kvtier serve
ignores them)."""


@dataclass(frozen=True)
class PromptView:
    """`lookup`: the body of a `/kv/lookup` call for this prompt (None: nothing to look up).
    `prefix_key`: the prompt's first chunk as bytes (empty when the body has no prompt)."""

    lookup: dict[str, Any] | None
    prefix_key: bytes


def view_request(body: dict[str, Any], prefix_chars: int = PREFIX_CHARS,
                 prefix_tokens: int = PREFIX_TOKENS) -> PromptView:
    """Returns the routing view of a completions or chat body (a batch routes by its first
    prompt)."""
    model = body.get("model")
    base = {k: body[k] for k in TOKENIZE_FIELDS if body.get(k) is not None}
    if isinstance(model, str):
        base["model"] = model
    if isinstance(body.get("cache_salt"), str):  # the lookup counts only this tenant's entries
        base["cache_salt"] = body["cache_salt"]
    messages = body.get("messages")
    if isinstance(messages, list) and messages:
        text = "".join(f"{m.get('role')}\x00{_text(m.get('content'))}\x00" for m in messages if isinstance(m, dict))
        return PromptView({**base, "messages": messages}, text[:prefix_chars].encode())
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch: its first prompt
    if isinstance(prompt, str):
        return PromptView({**base, "prompt": prompt}, prompt[:prefix_chars].encode())
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and 0 <= t < 2**32 for t in prompt):
        head = prompt[:prefix_tokens]
        return PromptView({**base, "prompt_token_ids": prompt}, struct.pack(f"<{len(head)}I", *head))
    return PromptView(None, b"")


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # multi-part content: its text parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return json.dumps(content)
