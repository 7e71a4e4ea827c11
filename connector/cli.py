"""Command-line flags that enable the connector (`kvtier generate`, examples, benchmarks).

`--kv-tier URL` (repeatable, fastest first), `--chunk-size`, `--kv-codec`, `--config FILE`.
With neither `--kv-tier` nor `--config`, there is no connector. Only argparse is imported at
module level: the CLI builds every subcommand's parser on start-up.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from connector.kvtier_connector import KVTierConnector


def add_connector_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the connector flags to `parser` (one argument group)."""
    g = parser.add_argument_group("KV connector (offload and reuse KV across tiers)")
    g.add_argument("--kv-tier", action="append", default=[], metavar="URL",
                   help="a storage tier, repeatable, fastest first: device, cpu, disk:///path, "
                        "redis://host:port/db, kvtier://host:port (query options: ?budget=4GiB&codec=lz4)")
    g.add_argument("--chunk-size", type=int, default=None, metavar="N",
                   help="tokens per stored chunk (default 256)")
    g.add_argument("--kv-codec", default=None, metavar="NAME",
                   help="codec for every tier: raw, lz4 (exact) or int8, int4 (lossy)")
    g.add_argument("--config", default=None, metavar="FILE",
                   help="connector YAML (tiers, chunk_size, save_decode_tokens, ...); --kv-tier "
                        "replaces its tiers")


def connector_from_args(args: argparse.Namespace) -> KVTierConnector | None:
    """Returns the connector the flags describe, or None when no tier or config is given.
    Raises ValueError naming the bad flag or config key."""
    if not args.kv_tier and not args.config:
        if args.chunk_size is not None or args.kv_codec is not None:
            raise ValueError("--chunk-size/--kv-codec need a --kv-tier or --config")
        return None
    from connector.config import ConnectorConfig, make_config
    from connector.kvtier_connector import KVTierConnector
    from kvstore.codecs import CODEC_NAMES
    from kvstore.config import TierSpec

    if args.kv_codec is not None and args.kv_codec not in CODEC_NAMES:
        raise ValueError(f"--kv-codec: unknown codec {args.kv_codec!r}; choose one of {list(CODEC_NAMES)}")

    base = ConnectorConfig.load(args.config)  # also $KVTIER_CONFIG and KVTIER_* overrides
    if args.kv_tier:
        base.kvstore.tiers = [TierSpec.from_url(u, f"--kv-tier[{i}]") for i, u in enumerate(args.kv_tier)]
    if args.chunk_size is not None and args.chunk_size <= 0:
        raise ValueError(f"--chunk-size must be > 0, got {args.chunk_size}")
    return KVTierConnector(make_config(base, chunk_size=args.chunk_size, codec=args.kv_codec))
