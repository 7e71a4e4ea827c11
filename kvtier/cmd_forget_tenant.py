"""`kvtier forget-tenant`: removes every stored entry of one `cache_salt` from shared tiers
(Redis, the cache server, a disk directory) without a running server. A running `kvtier
serve` also holds the tenant in its own prefix cache and private tiers: use its
`POST /kv/forget_tenant` (operator key) for those. Tenant tags are keyed by
$KVTIER_TENANT_TAG_KEY when set, as the engines' (kvkeys/tenants.py)."""

from __future__ import annotations

import argparse
import json

HELP = "remove every stored K/V entry of one cache_salt from the given tiers, and print what was removed"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cache-salt", required=True, metavar="SALT", help="the tenant's cache_salt (required)")
    parser.add_argument("--kv-tier", action="append", default=[], metavar="URL", required=True,
                        help="a tier to clean (repeatable): redis://..., kvtier://..., disk:///path")


def run(args: argparse.Namespace) -> int:
    """Prints `{"tiers": {name: removed}, "errors": {name: error}}`; exit code 1 if a tier failed."""
    from connector.key_families import FamilyIndex
    from kvkeys.tenants import tenant_prefix, tenant_tag, validate_cache_salt
    from kvsettings import ProcessEnv
    from kvstore.storage_manager import StorageManager
    from kvstore.store_config import KVStoreConfig, TierSpec

    salt = validate_cache_salt(args.cache_salt)
    assert salt is not None  # required by the parser
    config = KVStoreConfig(tiers=[TierSpec.from_url(u, f"--kv-tier[{i}]") for i, u in enumerate(args.kv_tier)])
    storage = StorageManager.from_config(config)
    try:
        tag = tenant_tag(salt, ProcessEnv.read().tenant_tag_key)  # the engines' key, if any
        FamilyIndex.of(storage).forget_tenant(tag)  # its key families, from each tier's index
        removed, errors = storage.operations.delete_prefix(tenant_prefix(tag))
    finally:
        storage.close()
    print(json.dumps({"tiers": removed, "errors": errors}))
    return 1 if errors else 0
