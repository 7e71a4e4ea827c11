"""`kvtier cache ...`: operate a running `kvtier serve`'s cache over its `/kv/*` routes
(kvtier/server/cache_routes.py; docs/serving.md, "Operating the cache"; the same routes on
`vllm serve` with kvtier's connector: connector/vllm/lookup_route.py), and explain a miss
(`explain`: `/kv/lookup` with `"explain": true`, also on `vllm serve` with kvtier's connector;
docs/serving.md, "Explain a miss"). An HTTP client only: it loads no model and no torch; except
`plan`, which asks no server: it replays a request trace through the tiers given
(kvstore/trace_replay.py) to size them for that traffic.

Each subcommand is one entry of `COMMANDS`: its help, a function adding its flags and a
function running it (returning the exit code). Prompts are given as text (the positional
argument), `--chat JSON` (a messages list) or `--token-ids 1,2,3`, and are tokenized by the
server as a request would be.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from connector.cli_flags import FieldFlag, config_field
from kvsettings import ProcessEnv
from kvstore.deadlines import CACHE_CLI_TIMEOUT_S
from kvstore.traces import BLOCK_TOKENS, Request, read_trace

HELP = ("operate a running server's KV cache: inspect, pin, unpin, prefetch, move, drop, clear, budget, explain a "
        "miss; size the tiers for a trace (plan)")
DEFAULT_LOG_LEVEL = "warning"

DEFAULT_URL = "http://127.0.0.1:8000"


# ---- shared flags and the one HTTP call ---------------------------------------------------
def _server_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=DEFAULT_URL, metavar="URL",
                        help=f"the kvtier serve (or vllm serve with kvtier's connector) to ask "
                             f"(default: {DEFAULT_URL})")
    parser.add_argument("--api-key", default=None, metavar="KEY",
                        help="its API key, the operator's for pin, unpin, clear and budget "
                             "(default: $KVTIER_API_KEY, else none)")


def _prompt_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", nargs="?", default=None, help="the prompt text (or give --chat or --token-ids)")
    parser.add_argument("--chat", default=None, metavar="JSON",
                        help='a conversation, e.g. \'[{"role": "user", "content": "hi"}]\' (chat template applied)')
    parser.add_argument("--token-ids", default=None, metavar="IDS", help="the prompt's token ids: 1,2,3 or a JSON list")
    parser.add_argument("--cache-salt", default=None, metavar="SALT",
                        help="the requests' cache_salt; a tenant's key implies its own")
    parser.add_argument("--model", default=None, metavar="NAME",
                        help="the served model's name (default: the one served)")


def _prompt_body(args: argparse.Namespace) -> dict[str, Any]:
    """Returns the request body's prompt form and salt; ValueError unless exactly one form."""
    given = [f for f in ("prompt", "chat", "token_ids") if getattr(args, f) is not None]
    if len(given) != 1:
        raise ValueError("give exactly one prompt: text, --chat JSON or --token-ids")
    body: dict[str, Any] = {}
    if args.prompt is not None:
        body["prompt"] = args.prompt
    elif args.chat is not None:
        try:
            messages = json.loads(args.chat)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--chat: not JSON ({exc})") from None
        if not isinstance(messages, list):
            raise ValueError("--chat: expected a JSON list of messages")
        body["messages"] = messages
    else:
        text = args.token_ids.strip()
        try:
            ids = json.loads(text) if text.startswith("[") else [int(t) for t in text.split(",") if t.strip()]
        except ValueError:
            raise ValueError(f"--token-ids: expected 1,2,3 or a JSON list of ints, got {args.token_ids!r}") from None
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise ValueError("--token-ids: expected a list of ints")
        body["prompt_token_ids"] = ids
    if args.cache_salt is not None:
        body["cache_salt"] = args.cache_salt
    if args.model is not None:
        body["model"] = args.model
    return body


NOTHING_MATCHED = 3
"""The exit code of an operation that removed, released or moved nothing (as grep's "no match"):
a wrong tier, prompt or cache_salt reads differently from a done job."""


def _post(args: argparse.Namespace, route: str, body: dict[str, Any],
          matched: Callable[[dict[str, Any]], int] | None = None) -> int:
    """POSTs `body` to the server's `route`, prints the JSON answer; returns 0, 1 (the
    server's error message on one line) for an HTTP error or no answer, or NOTHING_MATCHED
    (said on stderr) when `matched(answer)` counts nothing."""
    answer = _answer(args, route, body)
    if answer is None:
        return 1
    print(json.dumps(answer, indent=2))
    if matched is not None and matched(answer) == 0:
        print(f"kvtier cache {args.cache_command}: nothing matched: no stored value was changed", file=sys.stderr)
        return NOTHING_MATCHED
    return 0


def _removed(answer: dict[str, Any]) -> int:
    """Returns the values a clear removed: per tier, and the engine's blocks for a tenant."""
    tiers = answer.get("tiers") or {}
    return sum(int(n) for n in tiers.values()) + int(answer.get("engine_blocks") or 0)


def _answer(args: argparse.Namespace, route: str, body: dict[str, Any]) -> dict[str, Any] | None:
    """Returns the server's JSON answer to `body` POSTed to `route`; None (the error printed
    on one line) for an HTTP error or no answer."""
    import httpx

    key = args.api_key or ProcessEnv.read().api_key
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    name = f"kvtier cache {args.cache_command}"
    try:
        r = httpx.post(args.url.rstrip("/") + route, json=body, headers=headers, timeout=CACHE_CLI_TIMEOUT_S)
    except httpx.HTTPError as exc:
        print(f"{name}: error: cannot reach {args.url}: {exc}", file=sys.stderr)
        return None
    try:
        answer = r.json()
    except ValueError:
        answer = {"error": {"message": r.text[:500]}}
    if r.status_code >= 400 or not isinstance(answer, dict):
        error = answer.get("error") if isinstance(answer, dict) else None
        message = error.get("message") if isinstance(error, dict) else None
        print(f"{name}: error: HTTP {r.status_code}: {message or r.text[:500]}", file=sys.stderr)
        return None
    return answer


# ---- the subcommands: one adder and one runner each ------------------------------------------
def _inspect_flags(parser: argparse.ArgumentParser) -> None:
    _prompt_flags(parser)


def _inspect(args: argparse.Namespace) -> int:
    return _post(args, "/kv/inspect", _prompt_body(args))


def _pin_flags(parser: argparse.ArgumentParser) -> None:
    _prompt_flags(parser)
    parser.add_argument("--tier", default=None, metavar="TIER",
                        help="the tier: its kind (cpu, disk), URL or name from inspect (default: the fastest)")
    parser.add_argument("--ttl", type=float, default=None, metavar="SECONDS",
                        help="the pin expires after this long (default: held until unpinned)")


def _pin(args: argparse.Namespace) -> int:
    body = _prompt_body(args) | {"tier": args.tier, "ttl_s": args.ttl}
    return _post(args, "/kv/pin", body)


def _tier_flags(parser: argparse.ArgumentParser) -> None:
    _prompt_flags(parser)
    parser.add_argument("--tier", default=None, metavar="TIER", help="the tier (default: the fastest)")


def _unpin(args: argparse.Namespace) -> int:
    return _post(args, "/kv/unpin", _prompt_body(args) | {"tier": args.tier}, lambda a: int(a.get("released", 0)))


def _prefetch_flags(parser: argparse.ArgumentParser) -> None:
    _prompt_flags(parser)
    parser.add_argument("--tier", default=None, metavar="TIER", help="the tier to fill (default: the fastest)")
    parser.add_argument("--compute", action="store_true",
                        help="run the prompt first, so what no tier holds is computed and stored")


def _prefetch(args: argparse.Namespace) -> int:
    return _post(args, "/kv/prefetch", _prompt_body(args) | {"tier": args.tier, "compute": args.compute})


def _move_flags(parser: argparse.ArgumentParser) -> None:
    _prompt_flags(parser)
    parser.add_argument("--from", dest="from_tier", required=True, metavar="TIER", help="the tier to move from")
    parser.add_argument("--to", dest="to_tier", required=True, metavar="TIER", help="the tier to move into")


def _move(args: argparse.Namespace) -> int:
    return _post(args, "/kv/move", _prompt_body(args) | {"from_tier": args.from_tier, "to_tier": args.to_tier},
                 lambda a: int(a.get("moved", 0)) + int(a.get("refused", 0)))


def _drop(args: argparse.Namespace) -> int:
    return _post(args, "/kv/drop", _prompt_body(args) | {"tier": args.tier}, lambda a: int(a.get("removed", 0)))


def _clear_flags(parser: argparse.ArgumentParser) -> None:
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--cache-salt", default=None, metavar="SALT", help="remove one tenant's entries")
    which.add_argument("--all", action="store_true", help="remove everything: the engine's prefix cache and every tier")
    which.add_argument("--stored-model", default=None, metavar="MODEL",
                       help="remove every chunk of this model, any tenant (its name, or the model field "
                            "inspect's by_model shows)")
    which.add_argument("--older-than", type=float, default=None, metavar="SECONDS",
                       help="remove the chunks not used for this long (not pinned ones; cpu, device, disk and "
                            "cache server (kvtier://) tiers; redis cannot tell and is reported)")
    parser.add_argument("--local-only", action="store_true", help="with --all: only the cpu and device tiers")


def _clear(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"local_only": args.local_only}
    if args.cache_salt is not None:
        body["cache_salt"] = args.cache_salt
    elif args.all:
        body["all"] = True
    elif args.stored_model is not None:
        body["stored_model"] = args.stored_model
    else:
        body["older_than_s"] = args.older_than
    return _post(args, "/kv/clear", body, None if args.all else _removed)


def _budget_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tier", default=None, metavar="TIER",
                        help="the tier: its kind (cpu, disk), URL or name from inspect (default: the fastest)")
    parser.add_argument("--budget", default=None, metavar="SIZE",
                        help="its new byte budget, e.g. 1GiB or 512MB (default: unchanged)")
    parser.add_argument("--pin-budget", default=None, metavar="SIZE",
                        help="the bytes the operator may pin in it (default: unchanged, at most the budget)")
    parser.add_argument("--tenant-quota", default=None, metavar="SIZE",
                        help="the bytes each tenant (cache_salt) may hold in it (default: unchanged)")


def _budget(args: argparse.Namespace) -> int:
    """Sets the tier's limits given (sizes parsed here: a bad one is a one-line error)."""
    from kvstore.sizes import parse_size

    limits = {"budget": parse_size(args.budget, "--budget"),
              "pin_budget": parse_size(args.pin_budget, "--pin-budget"),
              "tenant_quota": parse_size(args.tenant_quota, "--tenant-quota")}
    if all(v is None for v in limits.values()):
        raise ValueError("give at least one of --budget, --pin-budget and --tenant-quota")
    return _post(args, "/kv/budget", {"tier": args.tier} | {k: v for k, v in limits.items() if v is not None})


def _explain_flags(parser: argparse.ArgumentParser) -> None:
    _prompt_flags(parser)
    parser.add_argument("--json", action="store_true", help="print the server's whole answer as JSON")


def _explain(args: argparse.Namespace) -> int:
    """Prints per tier the tokens held and the cause; 1 if the server has no tiers to explain."""
    answer = _answer(args, "/kv/lookup", _prompt_body(args) | {"explain": True})
    if answer is None:
        return 1
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


def _plan_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", required=True, metavar="FILE",
                        help="requests as JSON Lines (.gz too), Mooncake's format: input_length and hash_ids, one id "
                             "per --block-tokens tokens, equal where prompts share those tokens from the start; "
                             "timestamp orders them (docs/serving.md, \"Size the tiers for a trace\")")
    parser.add_argument("--tier", action="append", required=True, metavar="URL",
                        help="a tier, fastest first, as in KVTIER_TIERS: its kind with budget, eviction and fill, "
                             "e.g. --tier 'cpu?budget=8GiB' --tier 'disk:///d?budget=200GiB&fill=demote' (repeat)")
    parser.add_argument("--kv-bytes-per-token", default=str(DEFAULT_KV_BYTES_PER_TOKEN), metavar="SIZE",
                        help="the model's K/V bytes per token: layers x 2 x KV heads x head size x dtype bytes "
                             f"(default: {DEFAULT_KV_BYTES_PER_TOKEN}, SmolLM2-135M-Instruct in float32)")
    parser.add_argument("--block-tokens", action=FieldFlag, field=lambda: config_field(Request, "block_size"),
                        metavar="N", help="prompt tokens per hash id, as in Mooncake's traces")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def _plan(args: argparse.Namespace) -> int:
    """Prints the hit rate, prefill saved and bytes written per tier that the trace would see."""
    from dataclasses import asdict

    from kvstore.sizes import parse_size
    from kvstore.store_config import TierSpec
    from kvstore.trace_replay import plan

    per_token = parse_size(args.kv_bytes_per_token, "--kv-bytes-per-token")
    if per_token is None or per_token <= 0:
        raise ValueError(f"--kv-bytes-per-token: must be a positive size, got {args.kv_bytes_per_token!r}")
    block_tokens = BLOCK_TOKENS if args.block_tokens is None else args.block_tokens
    if block_tokens <= 0:
        raise ValueError(f"--block-tokens: must be positive, got {block_tokens}")
    specs = [TierSpec.from_url(url, f"--tier[{i}]") for i, url in enumerate(args.tier)]
    try:
        requests = read_trace(args.trace, block_tokens)
    except OSError as exc:
        raise ValueError(f"--trace: cannot read {args.trace}: {exc.strerror or exc}") from None
    if not requests:
        raise ValueError(f"--trace: {args.trace} holds no requests")
    result = plan(requests, specs, per_token)
    if args.json:
        print(json.dumps(asdict(result) | {"hit_rate": result.hit_rate}, indent=2))
        return 0
    print(f"{result.requests} requests, {result.prompt_tokens:,} prompt tokens; hit rate {result.hit_rate:.3f}: "
          f"{result.hit_tokens:,} prompt tokens not computed again")
    for tier in result.tiers:
        capacity = "unbounded" if tier.capacity_blocks is None else f"{tier.capacity_blocks:,} blocks"
        print(f"{tier.url}: {capacity}; served {tier.hit_tokens:,} tokens "
              f"({tier.hit_tokens / max(result.prompt_tokens, 1):.3f} of the prompts); "
              f"wrote {_gib(tier.bytes_written)}")
    return 0


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:,.1f} GiB"


DEFAULT_KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4
"""SmolLM2-135M-Instruct's K/V per token in float32: 30 layers x K and V x 3 KV heads x 64 x 4 bytes."""

OFFLINE = {"plan"}
"""Subcommands that ask no server (no --url, no --api-key)."""

Adder = Callable[[argparse.ArgumentParser], None]
Runner = Callable[[argparse.Namespace], int]

COMMANDS: dict[str, tuple[str, Adder, Runner]] = {
    "inspect": ("a prompt's chunks, the tiers holding each (bytes, age, last use, pin) and per tier totals",
                _inspect_flags, _inspect),
    "pin": ("pin a prompt's held prefix in one tier against eviction (operator key)", _pin_flags, _pin),
    "unpin": ("release a prompt's pins in one tier (operator key)", _tier_flags, _unpin),
    "prefetch": ("copy a prompt's held prefix into one tier from the others, or compute it first (--compute); "
                 "operator key", _prefetch_flags, _prefetch),
    "move": ("move a prompt's chunks from one tier into another (operator key)", _move_flags, _move),
    "drop": ("remove a prompt's chunks from one tier, pinned or not (operator key)", _tier_flags, _drop),
    "clear": ("remove one tenant's entries, one model's, everything, or what was not used for a while (operator key)",
              _clear_flags, _clear),
    "budget": ("change one tier's byte budget, pin budget or per-tenant quota now, evicting at once to meet them "
               "(operator key)", _budget_flags, _budget),
    "explain": ("say per tier why a prompt's hit is shorter than its chunks (another model, engine tag, dtype, "
                "layout, chunk size or tenant holds it; evicted; never stored)", _explain_flags, _explain),
    "plan": ("size the tiers for a request trace: the hit rate, prefill saved and bytes written per tier it would "
             "see with the budgets, eviction policies and fills given (offline: asks no server)", _plan_flags, _plan),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvtier.cli_help import HelpFormatter

    sub = parser.add_subparsers(dest="cache_command", metavar="SUBCOMMAND", required=True)
    for name, (help_text, add, runner) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=HelpFormatter)
        add(p)
        if name not in OFFLINE:
            _server_flags(p)
        p.set_defaults(_cache_run=runner)


def run(args: argparse.Namespace) -> int:
    return int(args._cache_run(args))
