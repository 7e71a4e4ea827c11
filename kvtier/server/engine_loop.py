"""The engine's own thread, and the HTTP layer's only way to the engine (`EngineLoop`).

The engine is not thread-safe, so exactly one thread (this loop) drives it: it runs the
commands handlers queue (add, abort, reads of engine state), steps the engine while it has
work, and hands each step's outputs to the asyncio queue of the request they belong to.
Handlers never hold the engine: they submit, stream and abort (`submit`, `RequestStream`),
look up prefixes, read stats, reset the prefix cache and wait for stores through
`EngineLoop`, which says for each value it reads off the engine thread why that is safe.
An exception in a step fails every request in flight with `EngineFailedError` (500), marks
the loop dead (`/health` and later requests answer 503) and is logged; the loop does not
restart on a broken engine.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from connector.engine_connector import EngineConnector
from engine.llm_engine import LLMEngine, PromptType
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from hostmem import trim_heap
from kvstore.deadlines import SERVE_IDLE_POLL_S, SERVE_IDLE_TRIM_INTERVAL_S, SERVE_STEP_KV_WAIT_S, SERVE_STOP_TIMEOUT_S

logger = logging.getLogger("kvtier.server")
T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine loop stopped (an exception in a step, or shutdown): no request can run."""


class EngineFailedError(EngineDeadError):
    """The engine failed while this request was in it (answered 500; later requests get 503)."""


class QueueFullError(RuntimeError):
    """`max_queue` requests already wait: the server refuses more instead of growing."""


class ClientDisconnected(Exception):
    """The HTTP client went away: its requests are aborted."""


@dataclass
class _Subscriber:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]

    def put(self, item: RequestOutput | BaseException) -> None:
        """Hands `item` to the subscriber's event loop (called from the engine thread)."""
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class RequestStream:
    """The outputs of one HTTP call's requests, in step order, until all finished.

    Iterate it on the event loop that created it; `close()` (idempotent, also on error or
    disconnect) aborts the requests that have not finished, so their blocks are freed.
    """

    def __init__(self, engine_loop: EngineLoop, request_ids: list[str], sub: _Subscriber,
                 num_sequences: int | None = None) -> None:
        self._loop = engine_loop
        self._sub = sub
        # Engine sequences in flight for these requests (an n > 1 request runs n).
        self.num_sequences = len(request_ids) if num_sequences is None else num_sequences
        self.remaining = set(request_ids)
        self._closed = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self.remaining:
            raise StopAsyncIteration
        item = await self._sub.queue.get()
        if isinstance(item, BaseException):
            raise item
        if item.finished:
            self.remaining.discard(item.request_id)
        return item

    def cancel(self, exc: BaseException) -> None:
        """Makes the next (or pending) `__anext__` raise `exc` (from the event loop's thread)."""
        self._sub.queue.put_nowait(exc)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._loop._release(self)


@dataclass(frozen=True)
class PrefixLookup:
    """How many leading tokens of a prompt the engine and its tiers hold, and the engine's load."""

    num_tokens: int
    engine_prefix_cache_tokens: int
    tiers: dict[str, int] = field(default_factory=dict)  # tier name -> tokens, fastest first
    num_requests_running: int = 0
    num_requests_waiting: int = 0

    @property
    def max_hit_tokens(self) -> int:
        return max([self.engine_prefix_cache_tokens, *self.tiers.values()])


class EngineLoop:
    """Owns an `LLMEngine` on one daemon thread; the HTTP layer's front to it.

    `max_waiting` bounds the requests admitted beyond what one batch runs
    (`max_num_seqs`): past it `submit` raises QueueFullError, so a flood of clients costs
    a refusal each, not memory. `num_in_flight` counts requests submitted and not finished.
    """

    def __init__(self, engine: LLMEngine, max_waiting: int,
                 on_step: Callable[[LLMEngine, list[RequestOutput]], None] | None = None,
                 on_forget: Callable[[str], None] | None = None) -> None:
        self._engine = engine
        self.max_in_flight = engine.max_num_seqs + max_waiting
        self.num_in_flight = 0  # event-loop side only
        self._on_step = on_step
        self._on_forget = on_forget
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._subs: dict[str, _Subscriber] = {}  # engine thread only
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvtier-engine", daemon=True)

    # ---- lifecycle ----
    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None and not self._stop.is_set()

    def stop(self, timeout: float = SERVE_STOP_TIMEOUT_S) -> None:
        """Aborts every unfinished request and ends the thread (waits up to `timeout` s)."""
        if self._thread.is_alive():
            self._commands.put(self._abort_all)
            self._commands.put(self._stop.set)
            self._thread.join(timeout)
        self._stop.set()

    # ---- the event-loop side ----
    def submit(self, seqs: list[Sequence]) -> RequestStream:
        """Queues `seqs` (validated) and returns their stream. Raises EngineDeadError if the
        loop is not running, QueueFullError past `max_waiting` (an n > 1 request counts n)."""
        if not self.alive:
            raise EngineDeadError("the engine is not running")
        weight = sum(s.sampling_params.n for s in seqs)
        if self.num_in_flight + weight > self.max_in_flight:
            raise QueueFullError(f"{self.num_in_flight} requests are in flight (at most "
                                 f"{self.max_in_flight}: max_num_seqs + max_queue); retry later")
        sub = _Subscriber(asyncio.get_running_loop(), asyncio.Queue())
        self.num_in_flight += weight
        stream = RequestStream(self, [s.request_id for s in seqs], sub, weight)
        self._commands.put(lambda: self._add(seqs, sub))
        return stream

    async def call(self, fn: Callable[[], T]) -> T:
        """Returns `fn()` run on the engine thread (for reads of engine state)."""
        if not self.alive:
            raise EngineDeadError("the engine is not running")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()

        def run() -> None:
            try:
                result = fn()
            except BaseException as exc:  # handed to the caller, never kills the loop
                loop.call_soon_threadsafe(_set_exception, fut, exc)
            else:
                loop.call_soon_threadsafe(_set_result, fut, result)

        self._commands.put(run)
        return await fut

    def _release(self, stream: RequestStream) -> None:
        self.num_in_flight -= stream.num_sequences
        unfinished = list(stream.remaining)
        if unfinished:
            self._commands.put(lambda: self._abort(unfinished))

    # ---- engine state, for handlers (marshalled, or read where that is safe) ----
    async def stats(self) -> dict[str, Any]:
        """Returns the engine's `get_stats()`, read between two steps."""
        return await self.call(self._engine.get_stats)

    async def reset_prefix_cache(self) -> bool:
        """Drops the engine's prefix cache between two steps; False (nothing dropped) while
        requests hold blocks."""
        return await self.call(self._engine.reset_prefix_cache)

    async def lookup(self, token_ids: list[int], cache_salt: str | None = None) -> PrefixLookup:
        """Returns how many leading tokens of `token_ids` the engine's prefix cache and each
        tier hold for requests of `cache_salt` (no other salt's entries count), and the
        engine's load; runs, loads and counts nothing."""
        engine = self._engine

        def engine_side() -> tuple[int, tuple[int, int]]:
            # Off the engine thread on purpose: a router's lookup must not wait behind a long
            # prefill step. Both read dict entries and len()s, each atomic under the GIL, so
            # the answer is at most one step stale, never torn.
            return engine.num_cached_prefix_tokens(token_ids, cache_salt), engine.load()

        in_engine, (running, waiting) = await asyncio.to_thread(engine_side)
        tiers: dict[str, int] = {}
        connector = engine.kv_connector
        # The tiers also serve the connector's load and store threads: an existence query is
        # safe from any thread, and off the engine thread it never waits behind a step.
        if isinstance(connector, EngineConnector):
            tiers = await asyncio.to_thread(connector.lookup, token_ids, cache_salt)
        return PrefixLookup(len(token_ids), in_engine, tiers, running, waiting)

    async def explain(self, token_ids: list[int], cache_salt: str | None = None,
                      other_tenants: bool = True) -> dict[str, Any] | None:
        """Returns per tier why it holds no more of `token_ids` for requests of `cache_salt`
        (connector/explain.py), off the engine thread; None without kvtier's connector."""
        connector = self._engine.kv_connector
        if not isinstance(connector, EngineConnector):
            return None
        return await asyncio.to_thread(connector.explain, token_ids, cache_salt, other_tenants)

    async def forget_tenant(self, cache_salt: str) -> dict[str, Any]:
        """Removes `cache_salt`'s entries from the engine's prefix cache (between two steps)
        and from every tier; returns what was removed: `engine_blocks`, per tier `tiers`, and
        per tier that failed `errors`."""
        blocks = await self.call(lambda: self._engine.forget_tenant(cache_salt))
        tiers: dict[str, int] = {}
        errors: dict[str, str] = {}
        connector = self._engine.kv_connector
        if isinstance(connector, EngineConnector):
            tiers, errors = await asyncio.to_thread(connector.forget_tenant, cache_salt)
        return {"engine_blocks": blocks, "tiers": tiers, "errors": errors}

    def cached_prefix_tokens(self, token_ids: list[int], cache_salt: str | None = None) -> int:
        """Returns how many leading tokens of `token_ids` the engine's prefix cache holds for
        `cache_salt`; safe off the engine thread, as `lookup` reads it."""
        return self._engine.num_cached_prefix_tokens(token_ids, cache_salt)

    @property
    def connector(self) -> EngineConnector | None:
        """Returns the engine's kvtier connector (its tiers), or None when it has none."""
        connector = self._engine.kv_connector
        return connector if isinstance(connector, EngineConnector) else None

    async def clear_all(self, local_only: bool = False) -> dict[str, Any]:
        """Drops the engine's prefix cache (`reset_prefix_cache`) and every chunk of every tier
        (with `local_only`, of the cpu and device tiers); returns `engine_reset` and per tier
        the entries it held."""
        reset = await self.reset_prefix_cache()
        connector = self.connector
        tiers = await asyncio.to_thread(connector.clear_tiers, local_only) if connector is not None else {}
        return {"engine_reset": reset, "tiers": tiers}

    async def flush_stores(self, timeout_s: float) -> bool:
        """Returns once every K/V store the connector queued reached its tiers: True, or
        False after `timeout_s`; True at once without a connector."""
        connector = self._engine.kv_connector
        if connector is None:
            return True
        # Waiting for the worker's queues only waits (the engine thread keeps feeding them);
        # it runs on a worker thread so the event loop keeps serving meanwhile.
        return await asyncio.to_thread(connector.flush, timeout_s)

    # ---- read without the engine thread: fixed once the engine is built ----
    # The model, limits and tokenizer settings never change after start-up, so reading them
    # races with no step. The tokenizer is shared: the engine thread decodes, the event loop
    # encodes (no truncation or padding, so neither call changes its settings).
    @property
    def max_model_len(self) -> int:
        return self._engine.max_model_len

    @property
    def model_path(self) -> str | None:
        path = self._engine.model_config.path
        return str(path) if path is not None else None

    @property
    def tokenizer(self) -> Any:
        return self._engine.tokenizer

    @property
    def vocab_size(self) -> int:
        return self._engine.model_config.vocab_size

    def make_sequence(self, prompt: PromptType, params: SamplingParams, request_id: str) -> Sequence:
        """Returns a validated, not yet queued request (the engine's `make_sequence`);
        ValueError names what is wrong."""
        return self._engine.make_sequence(prompt, params, request_id)

    def check_request(self, seq: Sequence) -> None:
        """Raises ValueError if `seq` can never run on this engine (too long, too many blocks)."""
        self._engine.check_request(seq)

    # ---- the engine thread ----
    def _run(self) -> None:
        engine = self._engine
        stepped_since_trim = False
        last_trim = 0.0
        try:
            while not self._stop.is_set():
                self._run_commands(block=not engine.has_unfinished_requests())
                if self._stop.is_set():
                    break
                if engine.has_unfinished_requests():
                    # A short wait for loads keeps new requests and aborts from waiting behind it.
                    outputs = engine.step(kv_wait_s=SERVE_STEP_KV_WAIT_S)
                    stepped_since_trim = True
                else:
                    outputs = []
                    # Idle: the steps' freed activations go back to the OS, so a server's RSS
                    # is what it holds, not the heap's high-water mark (benchmarks/soak.py).
                    if stepped_since_trim and time.monotonic() - last_trim >= SERVE_IDLE_TRIM_INTERVAL_S:
                        trim_heap()
                        stepped_since_trim, last_trim = False, time.monotonic()
                if self._on_step is not None:
                    self._on_step(engine, outputs)
                for out in outputs:
                    sub = self._subs.get(out.request_id)
                    if out.finished:
                        self._subs.pop(out.request_id, None)
                    if sub is not None:
                        sub.put(out)
        except BaseException as exc:
            self.error = exc
            logger.exception("engine loop failed; failing %d request(s) in flight", len(self._subs))
            dead = EngineFailedError(f"the engine failed: {type(exc).__name__}: {exc}")
            for sub in self._subs.values():
                sub.put(dead)
            self._subs.clear()
            # Commands queued around the failure still get an answer (`_add` refuses), so
            # no client waits forever on a request the dead engine will never run.
            while not self._stop.is_set():
                self._run_commands(block=True)

    def _run_commands(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=SERVE_IDLE_POLL_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            cmd()
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _add(self, seqs: list[Sequence], sub: _Subscriber) -> None:
        if self.error is not None:
            sub.put(EngineDeadError(f"the engine failed: {type(self.error).__name__}: {self.error}"))
            return
        for seq in seqs:
            try:
                self._engine.add_sequence(seq)
            except ValueError as exc:  # validated before; a changed engine state still answers
                sub.put(exc)
                return
            self._subs[seq.request_id] = sub

    def _abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            if self._subs.pop(rid, None) is None:
                continue  # finished (or failed to add) before the abort arrived
            self._engine.abort_request(rid)
            if self._on_forget is not None:
                self._on_forget(rid)

    def _abort_all(self) -> None:
        dead = EngineDeadError("the server is shutting down")
        for sub in self._subs.values():
            sub.put(dead)
        self._abort(list(self._subs))


def _set_result(fut: asyncio.Future[Any], value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
