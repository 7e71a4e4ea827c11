"""Deadlines of a remote tier's calls: the one place that says how long a lookup, a load, a
write and a connect to Redis, Redis Cluster or the cache server may wait (docs/architecture.md,
"Tiers and the storage manager").

A remote tier reads its options through `RemoteDeadlines.from_options` and keeps one connection
pool per kind of call, whose socket timeouts are that kind's deadline: a frozen or unreachable
server fails a lookup after `lookup_s` and a load after `load_s`, however long it stays frozen,
and the failure is a miss (the request recomputes). The storage manager reads `for_call` to
count calls that ran past their deadline, and its breaker (kvstore/health.py) backs off a tier
whose calls fail. Local tiers (cpu, device, disk) have no deadlines.

The fixed waits of the connector and the servers are named here too (the constants below), so
every bound on a wait has one home. The engine's own (engine/llm_engine.py `KV_WAIT_S`) stays
in the engine, which never imports kvstore.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, Literal

CallKind = Literal["lookup", "load", "write"]
"""Existence checks (the scheduler's step waits for them), reads of K/V (a request parked for
its load waits for them), and the background writer's puts and deletes."""

OPTIONS: dict[str, str] = {
    "lookup_timeout_s": "lookup_s",
    "load_timeout_s": "load_s",
    "write_timeout_s": "write_s",
    "connect_timeout_s": "connect_s",
}
"""Tier option -> `RemoteDeadlines` field: the same names for every remote tier."""

# A vLLM scheduler's question to a worker's lookup channel: seconds to wait for the answer.
LOOKUP_CHANNEL_ANSWER_S = 10.0
# A vLLM scheduler's connect to a worker's lookup channel (the worker may still be starting).
LOOKUP_CHANNEL_CONNECT_S = 30.0
# The vLLM `/kv/lookup` route's channel questions and connects (a router waits less: --lookup-timeout).
LOOKUP_ROUTE_CHANNEL_S = 2.0
# The vLLM `/kv/lookup` route's explain of a miss (one index read and one existence query per tier).
EXPLAIN_CHANNEL_S = 10.0
# The vLLM cache-control routes' (/kv/inspect, /kv/pin, /kv/clear, ...) question to each worker: past
# the worker's own STORE_FLUSH_TIMEOUT_S flush of queued stores, then a removal from every tier.
CONTROL_CHANNEL_S = 60.0
# An idle vLLM worker step's wait for a load in flight, or queued stores, before reporting.
VLLM_IDLE_WAIT_S = 0.05
# A producer's wait for its queued K/V stores to land before answering (kvtier serve); a vLLM
# worker's before a cache-control op (pin, clear).
STORE_FLUSH_TIMEOUT_S = 30.0
# How long kvtier serve and router keep an idle keep-alive connection: past what clients keep theirs
# (httpx 5 s, aiohttp 15 s), so none sends a request on a connection being closed.
KEEP_ALIVE_S = 75


@dataclass(frozen=True)
class RemoteDeadlines:
    """Seconds each kind of call to a remote tier may wait on its server (per wait on the
    socket: a server that answers nothing for this long fails the call)."""

    lookup_s: float = 0.5
    load_s: float = 1.0
    write_s: float = 5.0
    connect_s: float = 1.0

    def for_call(self, kind: CallKind) -> float:
        """Returns the deadline of one kind of call, in seconds."""
        return {"lookup": self.lookup_s, "load": self.load_s, "write": self.write_s}[kind]

    def connect_for(self, kind: CallKind) -> float:
        """Returns the connect timeout of a pool serving `kind`: never longer than its deadline,
        so a reconnect to a dead host cannot outlast a lookup's or a load's bound."""
        return min(self.connect_s, self.for_call(kind))

    @classmethod
    def from_options(cls, options: Mapping[str, Any], where: str,
                     aliases: Mapping[str, tuple[str, ...]] | None = None) -> RemoteDeadlines:
        """Returns the deadlines set by `options` (`OPTIONS`' names; `aliases`: a tier's older
        option names -> the fields each sets, beaten by the new names). Raises ValueError
        naming `where` and the option when a value is not a positive number. Other options
        are left for the tier to check."""
        values: dict[str, float] = {}
        given = [(name, (OPTIONS[name],)) for name in OPTIONS if name in options]
        older = [(name, targets) for name, targets in (aliases or {}).items() if name in options]
        for name, targets in older + given:  # new names last: they win
            value = _positive(options[name], where, name)
            for target in targets:
                values[target] = value
        return replace(cls(), **values)

    def describe(self) -> str:
        """Returns the deadlines as `lookup 0.5 s, load 1 s, ...` for logs and errors."""
        return ", ".join(f"{f.name.removesuffix('_s')} {getattr(self, f.name):g} s" for f in fields(self))


def _positive(value: Any, where: str, name: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: {name} must be a number of seconds, got {value!r}") from None
    if isinstance(value, bool) or not number > 0 or number == float("inf"):
        raise ValueError(f"{where}: {name} must be positive, got {value!r}")
    return number
