"""The scheduler side's existence questions, answered by a worker side in another process.

vLLM runs a connector's two roles in two processes, and what the worker side holds (its `cpu`
tier, the stores its queue still carries) lives only in the worker's. `LookupServer` is a
thread in the worker process that answers from the `LocalHeldKeys` it owns (its tiers and
pending stores); `LookupClient` asks it over a Unix socket, the `HeldKeys` of that worker's
rank in the planner's `Presence` (LMCache's lookup server plays this part). One round trip per
question; no value is read.

Each operation is one typed question with a typed answer (connector/vllm/lookup_ops.py). A
question's frame is its op code (u8) and its body's length (u32), then the body; an answer's is
its body's length (u32), then the body. A malformed or oversized frame, or an unknown op, closes
that connection. An answer that does not come (the worker is gone or stuck) is a miss.
"""

from __future__ import annotations

import logging
import os
import socket
import socketserver
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from connector.presence import Found, HeldKeys
from connector.vllm.lookup_ops import (
    MAX_BODY_BYTES,
    QUESTIONS,
    ClearQuestion,
    ControlQuestion,
    EnginePrefixQuestion,
    ExplainQuestion,
    FindQuestion,
    FoundRun,
    HeldQuestion,
    Question,
    Reader,
    TierPrefixQuestion,
)
from kvkeys.keyspace import Keyspace, Span
from kvstore.deadlines import LOOKUP_CHANNEL_ANSWER_S, LOOKUP_CHANNEL_CONNECT_S, LOOKUP_CHANNEL_RETRY_S

log = logging.getLogger(__name__)

A = TypeVar("A")
_QUESTION = struct.Struct("<BI")  # op code, body length
_U32 = struct.Struct("<I")
Explainer = Callable[[list[int], "str | None", bool], dict[str, Any]]
"""Answers an `ExplainQuestion`: (token ids, cache_salt, other_tenants) -> connector/explain.py's answer."""
Controller = Callable[[dict[str, Any]], dict[str, Any]]
"""Answers a `ControlQuestion`: `{"op": name, ...}` -> its JSON answer (never raises)."""
EnginePrefix = Callable[[list[int], "str | None"], int]
"""Answers an `EnginePrefixQuestion`: (token ids, cache_salt) -> leading tokens in the engine's own prefix cache."""


def lookup_socket_path(instance_id: str, rank: int = 0) -> Path:
    """Returns the socket path of tensor-parallel rank `rank`'s worker side of connector
    instance `instance_id` (vLLM's `engine_id`, the same in all its processes); ValueError if
    the id cannot be a file name."""
    if not instance_id or not all(c.isalnum() or c in "-_." for c in instance_id):
        raise ValueError(f"lookup channel: instance id {instance_id!r} must be letters, digits, '-', '_' or '.'")
    return Path(tempfile.gettempdir()) / f"kvtier-lookup-{instance_id}-rank{rank}.sock"


def scheduler_socket_path(instance_id: str) -> Path:
    """Returns the socket path of connector instance `instance_id`'s scheduler side (it answers
    `EnginePrefixQuestion`); ValueError as `lookup_socket_path`."""
    return lookup_socket_path(instance_id).with_name(f"kvtier-lookup-{instance_id}-scheduler.sock")


def _read_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise ConnectionError("lookup channel closed mid-frame")
        buf += part
    return bytes(buf)


def _read_body(sock: socket.socket, length: int) -> Reader:
    """Returns a reader over the next `length` bytes on `sock`; ValueError past MAX_BODY_BYTES."""
    if length > MAX_BODY_BYTES:
        raise ValueError(f"lookup channel: a body of {length} bytes, at most {MAX_BODY_BYTES}")
    return Reader(_read_exact(sock, length))


def question_frame(q: Question[Any]) -> bytes:
    """Returns the frame asking `q`; ValueError past a bound (MAX_BODY_BYTES, or a count's)."""
    body = q.encode()
    if len(body) > MAX_BODY_BYTES:
        raise ValueError(f"lookup channel: a question of {len(body)} bytes, at most {MAX_BODY_BYTES}")
    return _QUESTION.pack(q.op, len(body)) + body


def read_question(sock: socket.socket) -> Question[Any]:
    """Returns the next question on `sock`; ValueError on a malformed frame or an unknown op,
    ConnectionError when the peer closed."""
    op, length = _QUESTION.unpack(_read_exact(sock, _QUESTION.size))
    kind = QUESTIONS.get(op)
    if kind is None:
        raise ValueError(f"lookup channel: unknown op {op}")
    body = _read_body(sock, length)
    q = kind.decode(body)
    body.end()
    return q


def answer_frame(body: bytes) -> bytes:
    """Returns the frame carrying an answer's `body`."""
    return _U32.pack(len(body)) + body


def read_answer(sock: socket.socket, q: Question[A]) -> A:
    """Returns the answer to `q` on `sock`; ValueError if malformed or not an answer to `q`."""
    body = _read_body(sock, _U32.unpack(_read_exact(sock, 4))[0])
    answer = q.decode_answer(body)
    body.end()
    return answer


class LookupServer:
    """Answers existence questions about `held_keys` (its chunks keyed in `keyspace`) on a Unix
    socket, from daemon threads (without `held_keys`, as the scheduler side serves, only
    `EnginePrefixQuestion`).

    Guarantees: the socket file is created owner-only and removed by `close()`, which also
    ends open connections; a bad question ends only its own connection; a find from a
    keyspace of another identity is refused (a miss), never answered with other keys.
    """

    def __init__(self, held_keys: HeldKeys | None, path: Path, keyspace: Keyspace | None = None,
                 clear_local: Callable[[], None] | None = None, explainer: Explainer | None = None,
                 controller: Controller | None = None, engine_prefix: EnginePrefix | None = None) -> None:
        self.held_keys = held_keys
        self.keyspace = keyspace
        self.clear_local = clear_local  # ClearQuestion (vLLM's reset_cache)
        self.explainer = explainer
        self.controller = controller
        self.engine_prefix = engine_prefix
        self.path = path
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        path.unlink(missing_ok=True)  # left by a process that died
        outer = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                outer._serve(self.request)

        old = os.umask(0o177)
        try:
            self._server = socketserver.ThreadingUnixStreamServer(str(path), Handler)
        finally:
            os.umask(old)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="kvtier-lookup", daemon=True)
        self._thread.start()

    def _serve(self, sock: socket.socket) -> None:
        with self._lock:
            self._open.add(sock)
        try:
            while True:
                q = read_question(sock)
                sock.sendall(answer_frame(self._answer(q)))
        except ConnectionError:
            return
        except (ValueError, UnicodeDecodeError, OSError) as e:
            log.warning("lookup channel: dropping a connection: %s", e)
        finally:
            with self._lock:
                self._open.discard(sock)

    def _answer(self, q: Question[Any]) -> bytes:
        """Returns the body answering `q`; ValueError for a question this server cannot answer
        (a tier question asked of the scheduler side, a clear of a server that cannot)."""
        if isinstance(q, EnginePrefixQuestion):
            engine = self.engine_prefix
            return q.encode_answer(None if engine is None else engine(q.token_ids, q.cache_salt))
        held = self.held_keys
        if held is None:
            raise ValueError(f"lookup channel: a {type(q).__name__} asked of a server without tiers")
        if isinstance(q, FindQuestion):
            found = self._find(held, q)
            return q.encode_answer(None if found is None else FoundRun.of(found))
        if isinstance(q, HeldQuestion):
            return q.encode_answer(held.held(q.keys) if q.keys else [])
        if isinstance(q, TierPrefixQuestion):
            return q.encode_answer(held.tier_prefix_hits(q.keys))
        if isinstance(q, ExplainQuestion):
            explainer = self.explainer
            return q.encode_answer(None if explainer is None else explainer(q.token_ids, q.cache_salt,
                                                                            q.other_tenants))
        if isinstance(q, ControlQuestion):
            return q.encode_answer(None if self.controller is None else self.controller(q.request))
        if isinstance(q, ClearQuestion):
            if self.clear_local is None:
                raise ValueError("lookup channel: a clear asked of a server that cannot")
            self.clear_local()
            return q.encode_answer(True)
        raise ValueError(f"lookup channel: no answer for a {type(q).__name__}")

    def _find(self, held: HeldKeys, q: FindQuestion) -> Found | None:
        """Returns the held keys' `find` for question `q`, its spans keyed in this server's
        keyspace; None (refused) when that keyspace's identity is not the asker's."""
        if self.keyspace is None or q.identity != self.keyspace.identity:
            log.warning("lookup channel: a find from keyspace %r, this worker keys %r: refused (a miss)",
                        q.identity, None if self.keyspace is None else self.keyspace.identity)
            return None
        ks = self.keyspace.for_salt(q.cache_salt)
        spans = [Span(start, end, ks.key(chain), chain) for start, end, chain in q.spans]
        return held.find(ks, q.tokens, q.base, spans, q.parent, q.after)

    def close(self) -> None:
        """Stops serving, ends open connections and removes the socket file."""
        self._server.shutdown()
        self._server.server_close()
        with self._lock:
            for sock in self._open:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        self.path.unlink(missing_ok=True)


class LookupClient(HeldKeys):
    """Asks a LookupServer in another process: the held keys of a worker's tiers (for a
    `Presence` in a process without them), and its explain, control ops, engine prefix and
    clear.

    Guarantees: never raises for a channel failure; a question that gets no answer within
    `timeout` seconds (or no connection within `connect_timeout`) is answered "not held",
    logged, and the next question reconnects.
    """

    def __init__(self, path: Path, timeout: float = LOOKUP_CHANNEL_ANSWER_S,
                 connect_timeout: float = LOOKUP_CHANNEL_CONNECT_S) -> None:
        self.path = path
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self.questions = 0  # round trips asked
        self.failures = 0  # questions answered "not held" because the channel failed

    def _connect(self) -> socket.socket:
        deadline = time.monotonic() + self.connect_timeout
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout)
            try:
                sock.connect(str(self.path))
                return sock
            except (FileNotFoundError, ConnectionRefusedError):
                sock.close()
                if time.monotonic() >= deadline:
                    raise
                time.sleep(LOOKUP_CHANNEL_RETRY_S)

    def find(self, keyspace: Keyspace, tokens: Sequence[int], base: int, spans: Sequence[Span], parent: bytes,
             after: int) -> Found:
        """The worker's `find`, in one round trip; an empty `Found` when the channel fails or
        the worker refuses the question (it keys chunks otherwise: logged there)."""
        if not spans:
            return Found()
        run = self._ask(FindQuestion(keyspace.identity, keyspace.cache_salt, after, base, parent,
                                     [(sp.start, sp.end, sp.chain) for sp in spans], list(tokens)))
        return Found() if run is None else run.found(keyspace, spans)

    def held(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        answer = self._ask(HeldQuestion(list(keys)))
        return [False] * len(keys) if answer is None else answer

    def tier_prefix_hits(self, keys: Sequence[str]) -> dict[str, int]:
        """Returns, per tier name (fastest first), how many of `keys` from the start that tier
        holds by itself (pending stores not counted); {} when the channel fails."""
        answer = self._ask(TierPrefixQuestion(list(keys)))
        return {} if answer is None else answer

    def clear_local(self) -> bool:
        """Has the worker clear its process-local tiers (vLLM's `reset_cache`); returns True once
        it did, False when the channel fails."""
        return self._ask(ClearQuestion()) is True

    def explain(self, token_ids: Sequence[int], cache_salt: str | None = None,
                other_tenants: bool = True) -> dict[str, Any] | None:
        """Returns the worker's explain of a prompt (connector/explain.py); None when the
        channel fails or the worker has no explain."""
        return self._ask(ExplainQuestion(list(token_ids), cache_salt, other_tenants))

    def control(self, question: dict[str, Any]) -> dict[str, Any] | None:
        """Returns the worker's answer to a cache-control question (`{"op": name, ...}`,
        connector/cache_control.py; a refusal as `{"error": ...}`); None when the channel fails
        or the worker has no controller."""
        return self._ask(ControlQuestion(question))

    def engine_prefix(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int | None:
        """Returns how many leading tokens of the prompt the engine's own prefix cache holds
        for requests of `cache_salt` (asked of the scheduler side); None when the channel fails
        or the server has no engine."""
        return self._ask(EnginePrefixQuestion(list(token_ids), cache_salt))

    def _ask(self, q: Question[A]) -> A | None:
        """Returns the worker's answer to `q`; None (logged, the connection dropped) when none
        comes or it is malformed. ValueError (raised) when `q` itself is past a bound."""
        frame = question_frame(q)
        with self._lock:
            self.questions += 1
            try:
                if self._sock is None:
                    self._sock = self._connect()
                self._sock.sendall(frame)
                return read_answer(self._sock, q)
            except (OSError, ValueError, UnicodeDecodeError) as e:  # timeouts, a closed channel
                self.failures += 1
                log.warning("lookup channel %s: no answer (%s); treated as a miss", self.path, e)
                self.close()
                return None

    def close(self) -> None:
        """Closes the connection (the next question opens a new one)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
