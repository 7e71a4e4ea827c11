"""Engine flags shared by `kvtier generate` and `kvtier serve` (vLLM's names and meanings).

Only argparse is imported here: the CLI builds every subcommand's parser on start-up.
"""

from __future__ import annotations

import argparse
from typing import Any

from kvtier.cli_help import KV_CODECS, device_arg, restrict_choices


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the engine flags to `parser` (one argument group)."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None, metavar="PATH",
                   help="local Hugging Face checkpoint dir (default: the bundled SmolLM2-135M-Instruct)")
    g.add_argument("--device", default="auto", type=device_arg, metavar="DEVICE",
                   help="auto (CUDA when available), cpu, cuda or cuda:N (default: auto)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                   help="weights and KV dtype (default: auto = float32 on CPU, the checkpoint's on CUDA)")
    g.add_argument("--block-size", type=int, default=16, metavar="N", help="tokens per KV block (default: 16)")
    g.add_argument("--num-gpu-blocks", type=int, default=None, metavar="N",
                   help="KV pool size in blocks (default: from --gpu-memory-utilization on CUDA, 1 GiB on CPU)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.5, metavar="X",
                   help="fraction of free CUDA memory for the KV pool (default: 0.5)")
    g.add_argument("--max-model-len", type=int, default=None, metavar="N",
                   help="longest prompt + output in tokens (default: the model's limit)")
    g.add_argument("--max-num-seqs", type=int, default=64, metavar="N",
                   help="most requests in one batch (default: 64)")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, metavar="N",
                   help="token budget of one step; longer prefills are chunked (default: 2048)")
    g.add_argument("--no-prefix-caching", action="store_true", help="disable the engine's automatic prefix caching")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the engine flags and the KV connector flags (connector/cli.py) to `parser`, with
    --kv-codec restricted to the codecs kvstore has."""
    from connector.cli import add_connector_arguments

    add_engine_arguments(parser)
    add_connector_arguments(parser)
    restrict_choices(parser, "--kv-codec", KV_CODECS)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Returns `LLM(...)` keyword arguments (model first) for the engine flags in `args`."""
    return dict(model=args.model, device=args.device, dtype=args.dtype, block_size=args.block_size,
                num_gpu_blocks=args.num_gpu_blocks, gpu_memory_utilization=args.gpu_memory_utilization,
                max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                enable_prefix_caching=not args.no_prefix_caching)


def build_llm(args: argparse.Namespace) -> Any:
    """Returns an `LLM` for the engine and connector flags in `args`; a connector built here
    is shut down if the engine then fails to start. Raises ValueError naming a bad flag."""
    from connector.cli import connector_from_args
    from engine import LLM

    connector = connector_from_args(args)  # None without --kv-tier/--config/--blend
    kwargs = engine_kwargs(args)
    try:
        return LLM(kwargs.pop("model"), kv_connector=connector, **kwargs)
    except BaseException:
        if connector is not None:
            connector.shutdown()
        raise
