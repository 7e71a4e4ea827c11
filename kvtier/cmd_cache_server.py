"""`kvtier cache-server`: the standalone KV cache server (see docs/protocol.md)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import tempfile
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from hostmem import keep_freed_memory
from kvsettings import ProcessEnv, variable
from kvtier.cli_help import add_config_arguments

if TYPE_CHECKING:
    from kvstore.cache_server.tenant_tokens import TenantTokens

HELP = "run the standalone KV cache server that engines on one or many machines share"


def raise_fd_limit(max_connections: int) -> None:
    """Raises the soft open-file limit so that `max_connections` sockets (plus spill files
    and slack) can be open; warns when the hard limit is lower."""
    import resource

    want = max_connections + 64
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        if new < want:
            logging.getLogger(__name__).warning(
                "open-file limit %d is below --max-connections %d + 64: connections past it fail",
                new, max_connections)


DEFAULT_LOG_LEVEL = "warning"  # a server: quiet unless asked


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the cache server's flags, each built from its field in kvstore/cache_server/server.py
    (`ServerConfig`, `StoreBudgets`: its default, metavar and help are declared there, once)."""
    from kvstore.cache_server.server import ServerConfig, StoreBudgets

    add_config_arguments(parser, ServerConfig, ("host", "port"))
    add_config_arguments(parser, StoreBudgets)
    add_config_arguments(parser, ServerConfig, ("auth_token", "tenant_tokens", "max_payload", "idle_timeout",
                                                "frame_timeout", "max_connections", "tls_cert", "tls_key"))


def writable_dir(path: str, flag: str) -> str:
    """Returns `path` once it is a directory files can be created in (created if absent);
    raises ValueError naming `flag` and `path` otherwise."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise ValueError(f"{flag} {path}: not a writable directory ({exc.strerror or exc})") from None
    return path


def load_tenant_tokens(path: str) -> TenantTokens:
    """Returns the tokens of a --tenant-tokens file: JSON or YAML, one token -> tenant per
    entry, the tenant's tag (16 hex digits, the `kvtier:tenant-<tag>:` of its keys) or
    `{cache_salt: S}`, tagged as the engines tag it (kvkeys/tenants.py, keyed by
    $KVTIER_TENANT_TAG_KEY when that is set):

        {"tok-alice-...": "3f2a9c0d1e4b5a67", "tok-bob-...": {"cache_salt": "tenant-bob"}}

    ValueError naming the file and the entry's position, never a token (nor a salt)."""
    import yaml

    from kvkeys.tenants import tag_key_bytes
    from kvstore.cache_server.tenant_tokens import TenantTokens

    secret = ProcessEnv.read().tenant_tag_key
    if secret is not None:
        tag_key_bytes(secret)  # a short key fails here, once, not per entry
    name = f"--tenant-tokens {path}"
    try:
        with open(path, encoding="utf-8") as f:
            raw: Any = yaml.safe_load(f)
    except OSError as exc:
        raise ValueError(f"{name}: cannot read it: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, yaml.YAMLError) as exc:  # the parser's message may quote a token: not shown
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ValueError(f"{name}: not valid JSON or YAML{where}") from None
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f"{name}: expected a non-empty mapping of token -> tenant tag or {{cache_salt: ...}}")
    tokens: dict[str, str] = {}
    for i, (token, value) in enumerate(raw.items()):
        where = f"{name}: entry {i}"
        if not isinstance(token, str) or not token.strip():
            raise ValueError(f"{where}: the token must be a non-empty string")
        tokens[token] = _entry_tag(value, where, secret)
    return TenantTokens(tokens)


def _entry_tag(value: Any, where: str, secret: str | None) -> str:
    """Returns the tenant tag of one --tenant-tokens entry (a tag, or {cache_salt: S})."""
    from kvkeys.tenants import check_tag, tenant_tag, validate_cache_salt

    if isinstance(value, dict):
        if set(value) != {"cache_salt"}:
            raise ValueError(f"{where}: a mapping holds exactly cache_salt, got keys {sorted(map(str, value))}")
        try:
            salt = validate_cache_salt(value["cache_salt"])
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        if salt is None:
            raise ValueError(f"{where}: cache_salt must be a non-empty string")
        return tenant_tag(salt, secret)
    try:
        return check_tag(value)
    except ValueError:
        raise ValueError(f"{where}: a tenant tag is 16 lowercase hex digits (write {{cache_salt: ...}} "
                         "to give a salt instead)") from None


def run(args: argparse.Namespace) -> int:
    from kvstore.cache_server.server import ServerConfig, StoreBudgets, serve
    from kvstore.cache_server.spill import DiskSpill
    from kvstore.cache_server.store import ByteStore

    budgets = StoreBudgets(**{f.name: getattr(args, f.name) for f in fields(StoreBudgets)}).validate()
    values = {f.name: getattr(args, f.name) for f in fields(ServerConfig)}
    names = {}
    if values["auth_token"] is None:  # the variable stands in for the flag, and is named in errors
        values["auth_token"] = ProcessEnv.read().auth_token
        names["auth_token"] = "$" + variable(ProcessEnv, "auth_token")
    if values["tenant_tokens"] is not None:
        values["tenant_tokens"] = load_tenant_tokens(values["tenant_tokens"])
    config = ServerConfig(**values).validate(names)  # the one check of every flag (and the store's budgets')
    spill = None
    if budgets.disk:
        spill = DiskSpill(writable_dir(budgets.disk, "--disk"), budgets.max_disk_bytes, budgets.tenant_quota)
    store = ByteStore(budgets.max_bytes, spill, budgets.tenant_quota, budgets.store_pin_budget(),
                      eviction=budgets.eviction)
    if config.tls_cert is not None and config.tls_key is not None:
        from kvstore.cache_server.server import server_tls_context

        server_tls_context(config.tls_cert, config.tls_key)  # a bad file fails here, named
    raise_fd_limit(config.max_connections)

    def listening(host: str, port: int) -> None:
        # One line, flushed, so scripts and tests can wait for it.
        print(f"kvtier cache-server listening on {host}:{port}", flush=True)

    keep_freed_memory()
    try:
        asyncio.run(serve(store, config, on_listening=listening))
    except OSError as exc:  # e.g. address already in use
        print(f"kvtier cache-server: error: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m kvtier.cmd_cache_server ...`: the same command without the CLI dispatcher
    (which imports every subcommand), for scripts and test fixtures that want a light start."""
    from kvtier.cli_help import HelpFormatter
    from kvtier.log_setup import add_log_level_argument, configure_logging

    parser = argparse.ArgumentParser(prog="kvtier cache-server", description=HELP, formatter_class=HelpFormatter)
    add_arguments(parser)
    add_log_level_argument(parser, DEFAULT_LOG_LEVEL)
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    try:
        return run(args)
    except ValueError as exc:
        print(f"kvtier cache-server: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
