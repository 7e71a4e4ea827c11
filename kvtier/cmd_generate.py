"""`kvtier generate`: run the engine on one or more prompts from the command line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from engine.sampling_params import SamplingParams  # torch-free: its defaults are the flags'
from kvtier.log_setup import ENGINE_LOG_HELP

HELP = "generate text with the paged engine (default model: bundled SmolLM2-135M-Instruct)"
LOG_LEVEL_HELP = ENGINE_LOG_HELP


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", nargs="?", help="prompt text (or use --prompt-file)")
    parser.add_argument("--prompt-file", action="append", default=[], metavar="FILE",
                        help="read a prompt from FILE ('-' = stdin); repeatable, one prompt per file")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt as a user turn in the chat template")
    parser.add_argument("--max-tokens", type=int, default=64, metavar="N",
                        help="most tokens generated per prompt (default: 64; SamplingParams and the "
                             "server's API default to 16)")
    parser.add_argument("--temperature", type=float, default=0.0, metavar="X",
                        help="sampling temperature; 0 = greedy (default: 0)")
    parser.add_argument("--top-p", type=float, default=SamplingParams.top_p, metavar="X",
                        help="nucleus sampling: keep the smallest set of tokens with this much probability")
    parser.add_argument("--top-k", type=int, default=SamplingParams.top_k, metavar="N",
                        help="keep only the N most likely tokens; -1 = all")
    parser.add_argument("--seed", type=int, default=None, metavar="N",
                        help="per-request sampling seed (default: none, not reproducible)")
    parser.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object per prompt: prompt_token_ids, token_ids, text, num_cached_tokens, ttft_s, "
             "finish_reason, kv_connector (default: off, plain text)",
    )
    # Engine flags (kvtier/engine_args.py), then the KV connector flags (connector/cli_flags.py):
    # --kv-tier URL (repeatable), --chunk-size, --kv-codec, --config, --blend.
    from kvtier.engine_args import add_model_arguments

    add_model_arguments(parser)


def _read_prompts(args: argparse.Namespace) -> list[str]:
    """Returns the prompts in command-line order; ValueError names a file that is missing, a
    directory, unreadable or not UTF-8 text, and an empty prompt."""
    prompts = [] if args.prompt is None else [args.prompt]
    prompts.extend(_read_text(f) for f in args.prompt_file)
    if not prompts:
        raise ValueError("no prompt given (pass PROMPT or --prompt-file FILE)")
    for i, p in enumerate(prompts):
        if not p.strip():
            raise ValueError(f"prompt {i + 1} is empty")
    return prompts


def _read_text(f: str) -> str:
    """Returns the UTF-8 text of file `f` ('-': stdin); ValueError naming `f` otherwise."""
    path = Path(f)
    try:
        data = sys.stdin.buffer.read() if f == "-" else path.read_bytes()
    except FileNotFoundError:
        raise ValueError(f"--prompt-file {f}: no such file") from None
    except IsADirectoryError:
        raise ValueError(f"--prompt-file {f}: is a directory, not a file") from None
    except OSError as exc:
        raise ValueError(f"--prompt-file {f}: cannot read ({exc.strerror or exc})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"--prompt-file {f}: not UTF-8 text (byte 0x{data[exc.start]:02x} "
                         f"at offset {exc.start})") from None


def run(args: argparse.Namespace) -> int:
    """Generates for each prompt in turn (so TTFT and prefix-cache reuse show per prompt).
    Text mode prints each completion; several are each headed "--- prompt i/n ---"."""
    prompts = _read_prompts(args)  # bad files fail before the heavy imports

    from kvtier.engine_args import build_llm

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            seed=args.seed, max_tokens=args.max_tokens)
    llm = build_llm(args)
    connector = llm.engine.kv_connector
    try:
        for i, prompt in enumerate(prompts):
            if args.chat:
                prompt = llm.apply_chat_template([{"role": "user", "content": prompt}])
            (out,) = llm.generate(prompt, params)
            completion = out.outputs[0]
            if args.json and connector is not None:
                # a chunk's store is counted once its put ran: report this prompt's once written
                connector.flush()
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
                if len(prompts) > 1:
                    print(f"--- prompt {i + 1}/{len(prompts)} ---")
                print(completion.text, flush=True)
    finally:
        llm.shutdown()
    return 0
