"""`kvtier cache <op>`: operate a running server's cache over HTTP (`kvtier serve`, or `vllm
serve` with kvtier's connector and its `/kv/lookup` route). Each op is one entry of `OPS`: its
help, its own arguments and its run; they share `--url`, `--api-key` and the prompt forms.

- `explain`: `POST /kv/lookup` with `"explain": true`: per tier the leading tokens held and
  why not more (another model, engine tag, dtype, layout, chunk size or tenant holds the
  prompt, or its chunk was evicted, or never stored: docs/serving.md, "Explain a miss").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

HELP = "operate a running server's KV cache over HTTP (explain: why a prompt misses)"
DEFAULT_LOG_LEVEL = "warning"


@dataclass(frozen=True)
class Op:
    """One `kvtier cache` operation."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL (default: %(default)s)")
    parser.add_argument("--api-key", default=os.environ.get("KVTIER_API_KEY"), metavar="KEY",
                        help="the server's API key (default: $KVTIER_API_KEY); a tenant's key explains its own "
                             "entries only")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the answer (default: 60)")


def _add_prompt(parser: argparse.ArgumentParser) -> None:
    form = parser.add_mutually_exclusive_group(required=True)
    form.add_argument("prompt", nargs="?", help="the prompt as text (tokenized as a completion would be)")
    form.add_argument("--chat", metavar="JSON", help="the prompt as chat messages, a JSON list")
    form.add_argument("--token-ids", metavar="IDS", help="the prompt as token ids, comma-separated or a JSON list")
    parser.add_argument("--model", help="the served model name (default: the server's)")
    parser.add_argument("--cache-salt", metavar="SALT", help="explain for requests of this cache_salt")


def prompt_body(args: argparse.Namespace) -> dict[str, Any]:
    """Returns the prompt fields of a `/kv/lookup` body from the arguments; ValueError for bad input."""
    body: dict[str, Any] = {}
    if args.chat is not None:
        try:
            messages = json.loads(args.chat)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--chat is not JSON: {exc}") from None
        if not isinstance(messages, list) or not messages:
            raise ValueError("--chat must be a non-empty JSON list of messages")
        body["messages"] = messages
    elif args.token_ids is not None:
        raw = args.token_ids.strip()
        try:
            ids = json.loads(raw) if raw.startswith("[") else [int(t) for t in raw.split(",") if t.strip()]
        except ValueError:
            raise ValueError("--token-ids must be comma-separated integers or a JSON list") from None
        if not ids or not all(type(t) is int and t >= 0 for t in ids):
            raise ValueError("--token-ids must be non-negative integers")
        body["prompt_token_ids"] = ids
    else:
        body["prompt"] = args.prompt
    for name in ("model", "cache_salt"):
        if getattr(args, name) is not None:
            body[name] = getattr(args, name)
    return body


def _post(args: argparse.Namespace, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """Returns the JSON answer of `body` POSTed to `path`; RuntimeError naming the server's error."""
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        r = httpx.post(args.url.rstrip("/") + path, json=body, headers=headers, timeout=args.timeout)
    except httpx.HTTPError as exc:
        raise RuntimeError(f"{args.url}: {exc}") from None
    try:
        answer = r.json()
    except ValueError:
        answer = None
    if r.status_code != 200 or not isinstance(answer, dict):
        error = answer.get("error") if isinstance(answer, dict) else None
        detail = error.get("message") if isinstance(error, dict) else r.text[:500]
        raise RuntimeError(f"{path}: HTTP {r.status_code}: {detail}")
    return answer


def _explain_arguments(parser: argparse.ArgumentParser) -> None:
    _add_prompt(parser)
    parser.add_argument("--json", action="store_true", help="print the server's whole answer as JSON")


def _explain(args: argparse.Namespace) -> int:
    """Prints per tier the tokens held and the cause; exit code 1 if the server has no explain."""
    answer = _post(args, "/kv/lookup", {**prompt_body(args), "explain": True})
    explained = answer.get("explain")
    if args.json:
        print(json.dumps(answer, indent=2))
    elif isinstance(explained, dict):
        print(f"{answer.get('num_tokens')} prompt tokens; {answer.get('engine_prefix_cache_tokens', 0)} "
              "in the engine's prefix cache")
        for name, tier in explained.get("tiers", {}).items():
            print(f"{name}: {tier.get('held_tokens')} tokens held; {tier.get('cause')}: {tier.get('message')}")
    if not isinstance(explained, dict):
        print("the server has no kvtier connector tiers to explain", file=sys.stderr)
        return 1
    return 0


OPS: dict[str, Op] = {
    "explain": Op("say per tier why a prompt's hit is shorter than its chunks", _explain_arguments, _explain),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    ops = parser.add_subparsers(dest="op", metavar="OP", required=True)
    for name, op in OPS.items():
        p = ops.add_parser(name, help=op.help, description=op.help)
        _add_common(p)
        op.add_arguments(p)
        p.set_defaults(_op=op.run)


def run(args: argparse.Namespace) -> int:
    """Runs the chosen op; a server that cannot be reached or refuses is exit code 1."""
    try:
        return int(args._op(args))
    except RuntimeError as exc:
        print(f"kvtier cache {args.op}: error: {exc}", file=sys.stderr)
        return 1
