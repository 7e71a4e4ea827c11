"""`kvtier generate`: run the engine on one or more prompts from the command line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HELP = "generate text with the paged engine (default model: bundled SmolLM2-135M-Instruct)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", nargs="?", help="prompt text (or use --prompt-file)")
    parser.add_argument("--prompt-file", action="append", default=[], metavar="F",
                        help="read a prompt from file F ('-' = stdin); repeatable, one prompt per file")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt as a user turn in the chat template")
    parser.add_argument("--max-tokens", type=int, default=64, metavar="N")
    parser.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    parser.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object per prompt: prompt_token_ids, token_ids, text, num_cached_tokens, ttft_s",
    )
    # Engine flags (kvtier/engine_args.py), then the KV connector flags (connector/cli.py):
    # --kv-tier URL (repeatable), --chunk-size, --kv-codec, --config, --blend.
    from connector.cli import add_connector_arguments
    from kvtier.engine_args import add_engine_arguments

    add_engine_arguments(parser)
    add_connector_arguments(parser)


def _read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = [] if args.prompt is None else [args.prompt]
    for f in args.prompt_file:
        if f == "-":
            prompts.append(sys.stdin.read())
            continue
        path = Path(f)
        if not path.is_file():
            raise ValueError(f"--prompt-file {f}: no such file")
        prompts.append(path.read_text())
    if not prompts:
        raise ValueError("no prompt given (pass PROMPT or --prompt-file F)")
    for i, p in enumerate(prompts):
        if not p.strip():
            raise ValueError(f"prompt {i + 1} is empty")
    return prompts


def run(args: argparse.Namespace) -> int:
    """Generates for each prompt in turn (so TTFT and prefix-cache reuse show per prompt)."""
    from engine import SamplingParams  # heavy imports only when this command runs
    from kvtier.engine_args import build_llm

    prompts = _read_prompts(args)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            seed=args.seed, max_tokens=args.max_tokens)
    llm = build_llm(args)
    connector = llm.engine.kv_connector
    try:
        for prompt in prompts:
            if args.chat:
                prompt = llm.apply_chat_template([{"role": "user", "content": prompt}])
            (out,) = llm.generate(prompt, params)
            completion = out.outputs[0]
            if args.json:
                print(
                    json.dumps(
                        {
                            "prompt_token_ids": out.prompt_token_ids,
                            "token_ids": completion.token_ids,
                            "text": completion.text,
                            "num_cached_tokens": out.num_cached_tokens,
                            "ttft_s": out.metrics.ttft,
                            "finish_reason": completion.finish_reason,
                            **(
                                {}
                                if connector is None
                                else {"kv_connector": connector.request_metrics(out.request_id).to_dict()}
                            ),
                        }
                    ),
                    flush=True,
                )
            else:
                print(completion.text, flush=True)
    finally:
        llm.shutdown()
    return 0
