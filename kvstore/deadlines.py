"""Deadlines of a remote tier's calls: the one place that says how long a lookup, a load, a
write and a connect to Redis, Redis Cluster or the cache server may wait (docs/architecture.md,
"Tiers and the storage manager").

A remote tier reads its options through `RemoteDeadlines.from_options` and keeps one connection
pool per kind of call, whose socket timeouts are that kind's deadline: a frozen or unreachable
server fails a lookup after `lookup_s` and a load after `load_s`, however long it stays frozen,
and the failure is a miss (the request recomputes). The storage manager reads `for_call` to
count calls that ran past their deadline, and its breaker (kvstore/health.py) backs off a tier
whose calls fail. Local tiers (cpu, device, disk) have no deadlines.

The fixed waits of the connector, the storage manager, the cache server, `kvtier serve`, the
router and the CLI are named here too (the constants below), so every bound on a wait has one
home; tests/test_wait_bounds.py fails on one written anywhere else under kvstore/, kvtier/ and
connector/. The engine's own (engine/llm_engine.py `KV_WAIT_S`, engine/default_model.py
`PIP_DOWNLOAD_TIMEOUT_S`) stay in the engine, which never imports kvstore. Standard library
only: the cache server (kvstore/cache_server/) imports this module.
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
# The pause between those connects while the worker side starts its server (loading the model).
LOOKUP_CHANNEL_RETRY_S = 0.05
# How often a process re-reads a shared tier's key-family record it already published: a record
# lost to a concurrent writer or to eviction is written again within this.
FAMILY_RECHECK_S = 60.0
# The vLLM `/kv/lookup` route's channel questions and connects (a router waits less: ROUTER_LOOKUP_TIMEOUT_S).
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

# ---- the storage manager (kvstore/storage_manager.py, kvstore/health.py) ----
# A shutdown's flush of the tiers' queued writes (config flush_timeout_s): a tier that never
# answers cannot hold a shutdown longer; what is still queued then is dropped.
FLUSH_TIMEOUT_S = 5.0
# A tier's breaker's first cool-down after it opens (config backoff_initial_s), doubled per failed
# probe: a tier that blipped is tried again soon, one that stays down is not hammered.
BACKOFF_INITIAL_S = 0.25
# The cap of that cool-down (config backoff_max_s): a tier that is back is used again within about this long.
BACKOFF_MAX_S = 1.0

# ---- the cache server (kvstore/cache_server/, kvtier cache-server) ----
# The server answers every request within this long (--frame-timeout): at worst BUSY for a body
# that waited for memory, or a miss for a value the disk could not read in time.
CACHE_SERVER_FRAME_TIMEOUT_S = 30.0
# A client waits a little longer than that for a reply, so that a live server's own answer (BUSY,
# a miss) always arrives first; the client's timeout only fires for a server that is stopped,
# frozen or unreachable.
CACHE_SERVER_CLIENT_TIMEOUT_S = CACHE_SERVER_FRAME_TIMEOUT_S + 5.0
# A client's connect when its caller sets none (a tier sets RemoteDeadlines.connect_s): a reachable
# server accepts within milliseconds, so longer only delays reporting an unreachable one.
CACHE_SERVER_CONNECT_TIMEOUT_S = 2.0
# The server closes a connection that sends nothing for this long (--idle-timeout), so clients that
# vanished without closing do not hold connection slots; pooled clients reconnect.
CACHE_SERVER_IDLE_TIMEOUT_S = 300.0
# The longest between two sweeps of the connections' deadlines (a quarter of the frame or idle
# timeout when that is shorter): a deadline is enforced at most this late.
CACHE_SERVER_SWEEP_S = 1.0
# A refused connection (--max-connections) is half-closed, then aborted after this long: time for
# the client to read the refusal, while a client that never closes cannot keep the socket.
CACHE_SERVER_REFUSED_ABORT_S = 1.0

# ---- kvtier serve (kvtier/server/engine_loop.py, kvtier/cmd_serve.py) ----
# A step's wait for a K/V load when only loads are left to run: short, so new requests and aborts
# do not queue behind a slow load (the next step waits again).
SERVE_STEP_KV_WAIT_S = 0.005
# An idle engine thread's wait for a command before it checks again whether it was stopped.
SERVE_IDLE_POLL_S = 0.05
# At most one heap trim per this long when the engine goes idle after steps: RSS returns to what
# is held, without a trim in every short gap between requests.
SERVE_IDLE_TRIM_INTERVAL_S = 5.0
# Shutdown's wait for the engine thread to abort its requests and end: a step stuck in the engine
# cannot hold the exit forever (the thread is a daemon).
SERVE_STOP_TIMEOUT_S = 10.0
# Seconds in-flight requests get to finish on SIGINT/SIGTERM (kvtier serve --shutdown-grace, kvtier
# router): a finished answer beats a cut-off one, but a stuck stream cannot hold the exit.
SHUTDOWN_GRACE_S = 5.0

# ---- kvtier router (kvtier/router/, kvtier/cmd_router.py) ----
# The wait for each backend's /kv/lookup (--lookup-timeout): a late answer counts as no hit, so a
# slow backend delays routing by at most this.
ROUTER_LOOKUP_TIMEOUT_S = 0.5
# Between two health checks of each backend (--health-interval): a backend that is back serves
# again within about this long.
ROUTER_HEALTH_INTERVAL_S = 1.0
# A backend's /health answer: a backend that cannot answer this cheap route in time is taken out of rotation.
ROUTER_HEALTH_TIMEOUT_S = 1.0
# A backend's answer or next stream chunk (--request-timeout): long prefills and generations are
# legitimate, only a stuck backend takes longer.
ROUTER_REQUEST_TIMEOUT_S = 600.0
# A connect to a backend: a down backend fails fast and the next one in the policy's order is tried.
ROUTER_CONNECT_TIMEOUT_S = 2.0
# /v1/models asks the healthy backends in turn; one that has not answered in this long is skipped.
ROUTER_MODELS_TIMEOUT_S = 5.0

# ---- kvtier cache (kvtier/cmd_cache.py) ----
# One /kv/* call to a server: a pin, clear or move first lands the queued stores, then touches
# every tier, which takes long on a big cache (as long as a vLLM server's own bound, CONTROL_CHANNEL_S).
CACHE_CLI_TIMEOUT_S = 60.0


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
