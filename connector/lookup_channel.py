"""The scheduler side's existence query, answered by a worker side in another process.

vLLM runs a connector's two roles in two processes, and what the worker side holds (its `cpu`
tier, the stores its queue still carries) lives only in the worker's. `LookupServer` is a
thread in the worker process that answers "which of these keys are held?" from its
`Presence`; `RemotePresence` is the planner's `ChunkPresence` that asks it over a Unix socket
(LMCache's lookup server plays this part). One round trip per question; no value is read.

Frames, no pickle: a question is a u32 header (its op in the top byte, the key count in the
rest), then per key a u32 length and its UTF-8 bytes. `OP_HELD` is answered with one byte (0 or
1) per key; `OP_TIER_PREFIX` (how many leading keys each tier holds by itself, for `vllm
serve`'s /kv/lookup, connector/vllm_lookup_route.py) with a u32 tier count, then per tier,
fastest first, a u32 name length, the name's UTF-8 bytes and a u32 count; `OP_CLEAR_LOCAL`
(no keys: vLLM's `reset_cache`) with one byte 1 once the process-local tiers (with the
server's `clear_shared`, every tier) are empty. Two ops carry a JSON question (ASCII JSON cut
into keys of at most MAX_KEY_BYTES) and are answered with a u32 length and a JSON object:
`OP_EXPLAIN` (`{"token_ids", "cache_salt", "other_tenants"}`: why the tiers hold no more of a
prompt, connector/explain.py; `{}`: this worker has no explain), `OP_CONTROL` (`{"op": name,
...}`: a cache-control op, connector/control_ops.py's CONTROL_OPS, for `vllm serve`'s
`/kv/inspect`, `/kv/pin`, ...; `{}`: this worker has no controller) and `OP_ENGINE_PREFIX`
(`{"token_ids", "cache_salt"}`: how many leading tokens the engine's own prefix cache holds,
`{"tokens": n}`; asked of the scheduler side, which serves the same frames on its own socket,
`scheduler_socket_path`; `{}`: no engine here). A malformed or oversized frame closes that
connection. An answer that does not come (the worker is gone or stuck) is a miss.
"""

from __future__ import annotations

import json
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

from connector.presence import KeyPresence, Presence
from kvstore.deadlines import LOOKUP_CHANNEL_ANSWER_S, LOOKUP_CHANNEL_CONNECT_S

log = logging.getLogger(__name__)

_T = TypeVar("_T")
_U32 = struct.Struct("<I")
MAX_KEYS = 1 << 16
MAX_KEY_BYTES = 4096
MAX_TIERS = 64
OP_HELD, OP_TIER_PREFIX, OP_CLEAR_LOCAL, OP_EXPLAIN, OP_CONTROL, OP_ENGINE_PREFIX = 0, 1, 2, 3, 4, 5
JSON_OPS = (OP_EXPLAIN, OP_CONTROL, OP_ENGINE_PREFIX)
OPS = (OP_HELD, OP_TIER_PREFIX, OP_CLEAR_LOCAL, OP_EXPLAIN, OP_CONTROL, OP_ENGINE_PREFIX)
MAX_ANSWER_BYTES = 16 << 20
Explainer = Callable[[list[int], "str | None", bool], dict[str, Any]]
"""Answers OP_EXPLAIN: (token ids, cache_salt, other_tenants) -> connector/explain.py's answer."""
Controller = Callable[[dict[str, Any]], dict[str, Any]]
"""Answers OP_CONTROL: a JSON question `{"op": name, ...}` -> its JSON answer (never raises)."""
EnginePrefix = Callable[[list[int], "str | None"], int]
"""Answers OP_ENGINE_PREFIX: (token ids, cache_salt) -> leading tokens in the engine's own prefix cache."""
_OP_SHIFT = 24  # the op's place in a question's header; MAX_KEYS fits below it


def lookup_socket_path(instance_id: str, rank: int = 0) -> Path:
    """Returns the socket path of tensor-parallel rank `rank`'s worker side of connector
    instance `instance_id` (vLLM's `engine_id`, the same in all its processes); ValueError if
    the id cannot be a file name."""
    if not instance_id or not all(c.isalnum() or c in "-_." for c in instance_id):
        raise ValueError(f"lookup channel: instance id {instance_id!r} must be letters, digits, '-', '_' or '.'")
    return Path(tempfile.gettempdir()) / f"kvtier-lookup-{instance_id}-rank{rank}.sock"


def scheduler_socket_path(instance_id: str) -> Path:
    """Returns the socket path of connector instance `instance_id`'s scheduler side (it answers
    OP_ENGINE_PREFIX); ValueError as `lookup_socket_path`."""
    return lookup_socket_path(instance_id).with_name(f"kvtier-lookup-{instance_id}-scheduler.sock")


def _read_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise ConnectionError("lookup channel closed mid-frame")
        buf += part
    return bytes(buf)


def encode_question(keys: Sequence[str], op: int = OP_HELD) -> bytes:
    """Returns the frame asking `op` about `keys`; ValueError past MAX_KEYS or MAX_KEY_BYTES."""
    if len(keys) > MAX_KEYS:
        raise ValueError(f"lookup channel: {len(keys)} keys in one question, at most {MAX_KEYS}")
    parts = [_U32.pack(op << _OP_SHIFT | len(keys))]
    for key in keys:
        raw = key.encode()
        if len(raw) > MAX_KEY_BYTES:
            raise ValueError(f"lookup channel: a key of {len(raw)} bytes, at most {MAX_KEY_BYTES}")
        parts += (_U32.pack(len(raw)), raw)
    return b"".join(parts)


def read_question(sock: socket.socket) -> tuple[int, list[str]]:
    """Returns the op and keys of the next question on `sock`; ValueError on a malformed
    frame or an unknown op, ConnectionError when the peer closed."""
    (header,) = _U32.unpack(_read_exact(sock, 4))
    op, count = header >> _OP_SHIFT, header & ((1 << _OP_SHIFT) - 1)
    if op not in OPS:
        raise ValueError(f"lookup channel: unknown op {op}")
    if count > MAX_KEYS:
        raise ValueError(f"lookup channel: {count} keys in one question, at most {MAX_KEYS}")
    keys = []
    for _ in range(count):
        (n,) = _U32.unpack(_read_exact(sock, 4))
        if n > MAX_KEY_BYTES:
            raise ValueError(f"lookup channel: a key of {n} bytes, at most {MAX_KEY_BYTES}")
        keys.append(_read_exact(sock, n).decode())
    return op, keys


def encode_tier_hits(hits: dict[str, int]) -> bytes:
    """Returns the frame answering OP_TIER_PREFIX with `hits` (tier name -> leading keys held)."""
    parts = [_U32.pack(len(hits))]
    for name, n in hits.items():
        raw = name.encode()
        parts += (_U32.pack(len(raw)), raw, _U32.pack(n))
    return b"".join(parts)


def read_tier_hits(sock: socket.socket, num_keys: int) -> dict[str, int]:
    """Returns the OP_TIER_PREFIX answer to a question of `num_keys` keys; ValueError on a
    malformed frame (past MAX_TIERS tiers or MAX_KEY_BYTES a name, a count over `num_keys`)."""
    (count,) = _U32.unpack(_read_exact(sock, 4))
    if count > MAX_TIERS:
        raise ValueError(f"lookup channel: {count} tiers in one answer, at most {MAX_TIERS}")
    hits: dict[str, int] = {}
    for _ in range(count):
        (n,) = _U32.unpack(_read_exact(sock, 4))
        if n > MAX_KEY_BYTES:
            raise ValueError(f"lookup channel: a tier name of {n} bytes, at most {MAX_KEY_BYTES}")
        name = _read_exact(sock, n).decode()
        (held,) = _U32.unpack(_read_exact(sock, 4))
        if held > num_keys:
            raise ValueError(f"lookup channel: tier {name!r} holds {held} of {num_keys} keys")
        hits[name] = held
    return hits


def encode_json_question(question: dict[str, Any], op: int) -> bytes:
    """Returns the frame asking JSON op `op` (JSON_OPS) `question`; ValueError past MAX_KEYS
    pieces of MAX_KEY_BYTES."""
    raw = json.dumps(question)  # ASCII (non-ASCII escaped): one byte per character
    step = MAX_KEY_BYTES
    return encode_question([raw[i:i + step] for i in range(0, len(raw), step)], op)


def decode_json_question(keys: Sequence[str]) -> dict[str, Any]:
    """Returns the JSON object a JSON op's keys carry; ValueError unless it is one."""
    question = json.loads("".join(keys))
    if not isinstance(question, dict):
        raise ValueError("lookup channel: a JSON question is a JSON object")
    return question


def encode_explain_question(token_ids: Sequence[int], cache_salt: str | None, other_tenants: bool) -> bytes:
    """Returns the OP_EXPLAIN frame for a prompt."""
    return encode_json_question({"token_ids": list(token_ids), "cache_salt": cache_salt,
                                 "other_tenants": other_tenants}, OP_EXPLAIN)


def _prompt_question(q: dict[str, Any]) -> tuple[list[int], str | None]:
    """Returns a prompt question's (token ids, cache_salt); ValueError if malformed."""
    ids, salt = q.get("token_ids"), q.get("cache_salt")
    if not isinstance(ids, list) or not all(type(t) is int for t in ids) or not isinstance(salt, (str, type(None))):
        raise ValueError("lookup channel: a prompt question needs token_ids and cache_salt")
    return ids, salt


def encode_json(answer: dict[str, Any]) -> bytes:
    """Returns a JSON answer's frame: a u32 length, then the UTF-8 JSON."""
    raw = json.dumps(answer).encode()
    return _U32.pack(len(raw)) + raw


def read_json(sock: socket.socket) -> dict[str, Any]:
    """Returns a JSON answer; ValueError past MAX_ANSWER_BYTES or for anything but an object."""
    (n,) = _U32.unpack(_read_exact(sock, 4))
    if n > MAX_ANSWER_BYTES:
        raise ValueError(f"lookup channel: an answer of {n} bytes, at most {MAX_ANSWER_BYTES}")
    answer = json.loads(_read_exact(sock, n))
    if not isinstance(answer, dict):
        raise ValueError("lookup channel: a JSON answer is a JSON object")
    return answer


class LookupServer:
    """Answers existence questions about `presence` on a Unix socket, from daemon threads
    (without `presence`, as the scheduler side serves, only OP_ENGINE_PREFIX).

    Guarantees: the socket file is created owner-only and removed by `close()`, which also
    ends open connections; a bad question ends only its own connection.
    """

    def __init__(self, presence: Presence | None, path: Path, clear_shared: bool = False,
                 explainer: Explainer | None = None, controller: Controller | None = None,
                 engine_prefix: EnginePrefix | None = None) -> None:
        self.presence = presence
        self.explainer = explainer
        self.controller = controller
        self.engine_prefix = engine_prefix
        self.path = path
        self.clear_shared = clear_shared  # OP_CLEAR_LOCAL clears the shared tiers too
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
                op, keys = read_question(sock)
                if op == OP_ENGINE_PREFIX:
                    ids, salt = _prompt_question(decode_json_question(keys))
                    sock.sendall(encode_json({} if self.engine_prefix is None
                                             else {"tokens": self.engine_prefix(ids, salt)}))
                    continue
                if self.presence is None:
                    raise ValueError(f"lookup channel: op {op} asked of a server without tiers")
                if op == OP_TIER_PREFIX:
                    sock.sendall(encode_tier_hits(self.presence.storage.tier_prefix_hits(keys)))
                elif op == OP_EXPLAIN:
                    sock.sendall(encode_json(self._explain(decode_json_question(keys))))
                elif op == OP_CONTROL:
                    question = decode_json_question(keys)
                    sock.sendall(encode_json({} if self.controller is None else self.controller(question)))
                elif op == OP_CLEAR_LOCAL:
                    self.presence.storage.clear(local_only=not self.clear_shared)
                    sock.sendall(b"\x01")
                else:
                    sock.sendall(bytes(self.presence.held(keys)) if keys else b"")
        except ConnectionError:
            return
        except (ValueError, UnicodeDecodeError, OSError) as e:
            log.warning("lookup channel: dropping a connection: %s", e)
        finally:
            with self._lock:
                self._open.discard(sock)

    def _explain(self, q: dict[str, Any]) -> dict[str, Any]:
        """Returns the explainer's answer to an OP_EXPLAIN question; ValueError if malformed."""
        ids, salt = _prompt_question(q)
        return {} if self.explainer is None else self.explainer(ids, salt, bool(q.get("other_tenants")))

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


class RemotePresence(KeyPresence):
    """The planner's presence in a process without the tiers: asks the worker's LookupServer.

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
                time.sleep(0.05)  # the worker side starts its server while loading the model

    def held(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        answer = self._ask(encode_question(keys), lambda sock: _read_exact(sock, len(keys)))
        return [False] * len(keys) if answer is None else [b == 1 for b in answer]

    def tier_prefix_hits(self, keys: Sequence[str]) -> dict[str, int]:
        """Returns, per tier name (fastest first), how many of `keys` from the start that tier
        holds by itself (pending stores not counted); {} when the channel fails."""
        answer = self._ask(encode_question(keys, OP_TIER_PREFIX), lambda sock: read_tier_hits(sock, len(keys)))
        return {} if answer is None else answer

    def clear_local(self) -> bool:
        """Has the worker clear its process-local tiers (vLLM's `reset_cache`); returns True once
        it did, False when the channel fails."""
        return self._ask(encode_question((), OP_CLEAR_LOCAL), lambda sock: _read_exact(sock, 1)) == b"\x01"

    def explain(self, token_ids: Sequence[int], cache_salt: str | None = None,
                other_tenants: bool = True) -> dict[str, Any] | None:
        """Returns the worker's explain of a prompt (connector/explain.py); None when the
        channel fails or the worker has no explain."""
        answer = self._ask(encode_explain_question(token_ids, cache_salt, other_tenants), read_json)
        return answer or None

    def control(self, question: dict[str, Any]) -> dict[str, Any] | None:
        """Returns the worker's answer to a cache-control question (`{"op": name, ...}`,
        connector/cache_control.py; a refusal as `{"error": ...}`); None when the channel fails
        or the worker has no controller."""
        answer = self._ask(encode_json_question(question, OP_CONTROL), read_json)
        return answer or None

    def engine_prefix(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int | None:
        """Returns how many leading tokens of the prompt the engine's own prefix cache holds
        for requests of `cache_salt` (asked of the scheduler side); None when the channel fails
        or the server has no engine."""
        question = encode_json_question({"token_ids": list(token_ids), "cache_salt": cache_salt}, OP_ENGINE_PREFIX)
        answer = self._ask(question, read_json)
        tokens = None if answer is None else answer.get("tokens")
        return tokens if type(tokens) is int and 0 <= tokens <= len(token_ids) else None

    def _ask(self, question: bytes, read: Callable[[socket.socket], _T]) -> _T | None:
        """Returns the worker's answer to `question` as `read` decodes it; None (logged, the
        connection dropped) when none comes or it is malformed."""
        with self._lock:
            try:
                if self._sock is None:
                    self._sock = self._connect()
                self._sock.sendall(question)
                return read(self._sock)
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
