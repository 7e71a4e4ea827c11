"""`kvtier cache-server`: the standalone KV cache server (see docs/protocol.md)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import tempfile
from typing import TYPE_CHECKING, Any

from hostmem import keep_freed_memory
from kvstore import sizes
from kvstore.deadlines import CACHE_SERVER_CLIENT_TIMEOUT_S, CACHE_SERVER_FRAME_TIMEOUT_S, CACHE_SERVER_IDLE_TIMEOUT_S

if TYPE_CHECKING:
    from kvstore.server.tenant_tokens import TenantTokens

HELP = "run the standalone KV cache server that engines on one or many machines share"


def parse_size(text: str, name: str) -> int:
    """Returns the byte count of '4GiB', '512MiB', '1.5GB', '65536'; raises ValueError
    naming the option `name` if it is not a positive size."""
    n = sizes.parse_size(str(text), name)
    if not n:
        raise ValueError(f"{name}: size {text!r} must be positive")
    return n


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
    parser.add_argument("--host", default="127.0.0.1", metavar="HOST",
                        help="address to bind (default: 127.0.0.1, loopback; use 0.0.0.0 explicitly to serve "
                             "the network)")
    parser.add_argument("--port", type=int, default=65432, metavar="N",
                        help="TCP port; 0 picks a free one and prints it")
    parser.add_argument("--max-bytes", default="4GiB", metavar="SIZE",
                        help="memory budget: key + value bytes of all entries")
    parser.add_argument("--disk", default=None, metavar="DIR",
                        help="spill evicted entries to this directory, created if absent (default: none, "
                             "evicted entries are dropped)")
    parser.add_argument("--max-disk-bytes", default="16GiB", metavar="SIZE",
                        help="budget of the disk spill (file sizes)")
    parser.add_argument("--tenant-quota", default=None, metavar="SIZE",
                        help="most bytes one tenant (cache_salt) may hold, in memory and on the disk spill "
                             "each; a tenant at its quota evicts its own least recently used entries "
                             "(default: no quota)")
    parser.add_argument("--pin-budget", default=None, metavar="SIZE",
                        help="most bytes operator pins (PIN, POST /kv/pin) may hold; pinned entries are "
                             "never evicted, and with --disk their pins are kept across a restart "
                             "(default: half of --max-bytes, at most --max-disk-bytes)")
    parser.add_argument("--auth-token", default=None, metavar="TOKEN",
                        help="require clients to send this token first (default: $KVTIER_AUTH_TOKEN, else none)")
    parser.add_argument("--tenant-tokens", default=None, metavar="FILE",
                        help="JSON/YAML file of per-tenant tokens: token -> tenant tag (16 hex) or {cache_salt: S} "
                             "(tagged with $KVTIER_TENANT_TAG_KEY when set); a client that authenticates with one "
                             "may touch only that tenant's keys (--auth-token stays the operator's, allowed "
                             "everything); see docs/security.md")
    parser.add_argument("--max-payload", default="512MiB", metavar="SIZE", help="largest payload one frame may carry")
    parser.add_argument("--idle-timeout", type=float, default=CACHE_SERVER_IDLE_TIMEOUT_S, metavar="SECONDS",
                        help="close connections that send nothing for this long")
    parser.add_argument("--frame-timeout", type=float, default=CACHE_SERVER_FRAME_TIMEOUT_S, metavar="SECONDS",
                        help="each request frame must arrive whole, and each reply piece be read, "
                             "within this long; also the TLS handshake limit and the longest a body waits "
                             "for memory or a GET for the disk "
                             f"(kvtier clients wait {CACHE_SERVER_CLIENT_TIMEOUT_S:g} s)")
    parser.add_argument("--max-connections", type=int, default=256, metavar="N",
                        help="connections served at once; more are refused with TOO_MANY_CONNECTIONS")
    parser.add_argument("--tls-cert", default=None, metavar="FILE",
                        help="serve TLS with this PEM certificate chain (needs --tls-key; clients use kvtiers://)")
    parser.add_argument("--tls-key", default=None, metavar="FILE", help="PEM private key of --tls-cert")


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
    from kvstore.server.tenant_tokens import TenantTokens

    secret = os.environ.get("KVTIER_TENANT_TAG_KEY") or None
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
    from kvstore.server.server import ServerConfig, serve
    from kvstore.server.spill import DiskSpill
    from kvstore.server.store import ByteStore

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    if args.idle_timeout <= 0:
        raise ValueError(f"--idle-timeout must be positive, got {args.idle_timeout}")
    if args.frame_timeout <= 0:
        raise ValueError(f"--frame-timeout must be positive, got {args.frame_timeout}")
    if args.max_connections < 1:
        raise ValueError(f"--max-connections must be at least 1, got {args.max_connections}")
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together")
    token = args.auth_token if args.auth_token is not None else os.environ.get("KVTIER_AUTH_TOKEN")
    if token is not None and not token:
        # An empty token would silently mean "no auth": refuse it rather than guess.
        source = "--auth-token" if args.auth_token is not None else "$KVTIER_AUTH_TOKEN"
        raise ValueError(f"{source} is empty; give a non-empty token, or leave both unset to run without auth")
    tenant_tokens = load_tenant_tokens(args.tenant_tokens) if args.tenant_tokens is not None else None
    quota = parse_size(args.tenant_quota, "--tenant-quota") if args.tenant_quota is not None else None
    max_bytes = parse_size(args.max_bytes, '--max-bytes')
    pin_budget = parse_size(args.pin_budget, "--pin-budget") if args.pin_budget is not None else None
    if pin_budget is not None and not 0 <= pin_budget <= max_bytes:
        raise ValueError(f"--pin-budget must be 0..--max-bytes ({max_bytes}), got {pin_budget}")
    spill = None
    if args.disk:
        max_disk = parse_size(args.max_disk_bytes, '--max-disk-bytes')
        if pin_budget is None:
            pin_budget = min(max_bytes // 2, max_disk)  # pinned entries fit on the spill at shutdown
        elif pin_budget > max_disk:
            raise ValueError(f"--pin-budget must not pass --max-disk-bytes ({max_disk}): pinned entries "
                             "must fit on the disk spill at shutdown")
        spill = DiskSpill(writable_dir(args.disk, "--disk"), max_disk, quota)
    store = ByteStore(max_bytes, spill, quota, pin_budget)
    config = ServerConfig(
        host=args.host,
        port=args.port,
        max_payload=parse_size(args.max_payload, '--max-payload'),
        auth_token=token,
        tenant_tokens=tenant_tokens,
        idle_timeout=args.idle_timeout,
        frame_timeout=args.frame_timeout,
        max_connections=args.max_connections,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
    )
    if args.tls_cert:
        from kvstore.server.server import server_tls_context

        server_tls_context(args.tls_cert, args.tls_key)  # a bad file fails here, named
    raise_fd_limit(args.max_connections)

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
