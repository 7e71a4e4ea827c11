"""`kvtier router`'s settings, each declared once, in its `RouterConfig` field: its default, and in
the metadata (`kvsettings.opt`) its help and metavar. kvtier/cmd_router.py builds the flags from
these fields (kvtier/cli_help.py `add_config_arguments`) and `validate` alone checks them; the
policies take their defaults from here too.

Only the standard library and kvsettings, kvstore/deadlines.py (standard library only) are
imported here: the CLI builds every parser on start-up."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvsettings import opt
from kvstore.deadlines import ROUTER_HEALTH_INTERVAL_S, ROUTER_LOOKUP_TIMEOUT_S, ROUTER_REQUEST_TIMEOUT_S
from kvtier.router import POLICIES

BACKEND_FLAGS = ("backend", "prefill", "decode", "policy", "lookup_timeout", "balance_threshold", "health_interval",
                 "request_timeout", "backend_api_key")
"""The settings of the flags' "backends" group, in help order; the rest are the "server" group's."""


@dataclass
class RouterConfig:
    """Everything `kvtier router` takes: its backends and how it picks one, and how it serves."""

    backend: list[str] = field(default_factory=list, metadata=opt(
        "a `kvtier serve` base URL, e.g. http://127.0.0.1:8001 (repeatable)", "URL", action="append"))
    prefill: list[str] = field(default_factory=list, metadata=opt(
        "a `kvtier serve --kv-role producer` URL (repeatable; needs --decode)", "URL", action="append"))
    decode: list[str] = field(default_factory=list, metadata=opt(
        "a `kvtier serve --kv-role consumer` URL (repeatable; needs --prefill)", "URL", action="append"))
    policy: str = field(default="kv-aware", metadata=opt(
        "how a backend is picked per request", choices=POLICIES))
    lookup_timeout: float = field(default=ROUTER_LOOKUP_TIMEOUT_S, metadata=opt(
        "kv-aware: seconds to wait for each backend's /kv/lookup; late = no hit", "SECONDS"))
    balance_threshold: int = field(default=16, metadata=opt(
        "kv-aware: a backend with more than N requests (running + waiting) above the least loaded one ranks "
        "last, whatever it holds", "N"))
    health_interval: float = field(default=ROUTER_HEALTH_INTERVAL_S, metadata=opt(
        "seconds between health checks of each backend", "SECONDS"))
    request_timeout: float = field(default=ROUTER_REQUEST_TIMEOUT_S, metadata=opt(
        "seconds a backend may take to answer or between stream chunks", "SECONDS"))
    backend_api_key: str | None = field(default=None, repr=False, metadata=opt(
        "API key sent to the backends (default: forward the client's Authorization header)", "KEY"))
    host: str = field(default="127.0.0.1", metadata=opt("address to bind", "HOST"))
    port: int = field(default=8000, metadata=opt("TCP port; 0 picks a free one", "N"))
    api_key: str | None = field(default=None, repr=False, metadata=opt(
        "require Authorization: Bearer KEY on /v1/* (default: $KVTIER_API_KEY, else none)", "KEY"))

    def validate(self) -> RouterConfig:
        """Returns self; raises ValueError naming the first invalid flag."""
        self.pairs()
        if self.policy not in POLICIES:
            raise ValueError(f"--policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.balance_threshold < 0:
            raise ValueError(f"--balance-threshold must be >= 0, got {self.balance_threshold}")
        for name in ("lookup_timeout", "health_interval", "request_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        return self

    @property
    def disaggregated(self) -> bool:
        """Whether requests prefill on one backend and decode on another (--prefill/--decode)."""
        return bool(self.prefill)

    def pairs(self) -> list[tuple[str, str]]:
        """Returns [(url, role)] of the backends; ValueError naming the flag."""
        if self.backend and (self.prefill or self.decode):
            raise ValueError("give either --backend or --prefill/--decode, not both")
        if bool(self.prefill) != bool(self.decode):
            raise ValueError("disaggregated prefill needs both --prefill and --decode")
        pairs = [(u, "any") for u in self.backend] + [(u, "prefill") for u in self.prefill] + \
                [(u, "decode") for u in self.decode]
        if not pairs:
            raise ValueError("give at least one --backend URL (or --prefill and --decode)")
        for url, _ in pairs:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"a backend URL must start with http:// or https://, got {url!r}")
        return [(u.rstrip("/"), r) for u, r in pairs]
