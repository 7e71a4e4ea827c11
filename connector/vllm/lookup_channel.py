"""The scheduler side's existence questions, answered by a worker side in another process.

vLLM runs a connector's two roles in two processes, and what the worker side holds (its `cpu`
tier, the stores its queue still carries) lives only in the worker's. `LookupServer` is a
thread in the worker process that answers from the `LocalHeldKeys` it owns (its tiers and
pending stores); `LookupClient` asks it over a Unix socket, the `HeldKeys` of that worker's
rank in the planner's `Presence` (LMCache's lookup server plays this part). One round trip per
question; no value is read.

Frames, no pickle. A question is a u32 header, its op in the top byte and a count below:
- key ops carry `count` keys, each a u32 length and its UTF-8 bytes: `OP_HELD` (answered with
  one byte, 0 or 1, per key), `OP_TIER_PREFIX` (how many leading keys each tier holds by
  itself, for `vllm serve`'s /kv/lookup: a u32 tier count, then per tier, fastest first, a u32
  name length, the name and a u32 count) and `OP_CLEAR_LOCAL` (no keys: vLLM's `reset_cache`;
  one byte 1 once the server's `clear_local` ran: the process-local tiers, or every tier with
  `reset_clears_shared_tiers`, are empty);
- body ops carry one body, a u32 length and its bytes (count 0):
  - `OP_FIND`, the planner's lookup (`encode_find`: the asker's keyspace identity, salt,
    position, chain and spans, and the tokens they cover), answered by `encode_found`: a
    status byte (1: the worker keys chunks otherwise, a miss), the tier names, per chunk of
    the held run its tier, and the partial chunk stored where the run stops;
  - JSON ops, a JSON object answered by a u32 length and a JSON object: `OP_EXPLAIN`
    (`{"token_ids", "cache_salt", "other_tenants"}`: why the tiers hold no more of a prompt,
    connector/explain.py), `OP_CONTROL` (`{"op": name, ...}`: a cache-control op,
    connector/vllm/control_ops.py, for `vllm serve`'s `/kv/inspect`, `/kv/pin`, ...) and
    `OP_ENGINE_PREFIX` (`{"token_ids", "cache_salt"}`: how many leading tokens the engine's own
    prefix cache holds, `{"tokens": n}`, asked of the scheduler side on its own socket,
    `scheduler_socket_path`); `{}` where the server has no such part.
A malformed or oversized frame closes that connection. An answer that does not come (the
worker is gone or stuck) is a miss.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from connector.presence import Found, HeldKeys
from kvkeys.keyspace import Keyspace, Span
from kvstore.deadlines import LOOKUP_CHANNEL_ANSWER_S, LOOKUP_CHANNEL_CONNECT_S, LOOKUP_CHANNEL_RETRY_S

log = logging.getLogger(__name__)

_T = TypeVar("_T")
_U32 = struct.Struct("<I")
MAX_KEYS = 1 << 16
MAX_KEY_BYTES = 4096
MAX_TIERS = 64
OP_HELD, OP_TIER_PREFIX, OP_CLEAR_LOCAL, OP_EXPLAIN, OP_CONTROL, OP_ENGINE_PREFIX, OP_FIND = 0, 1, 2, 3, 4, 5, 6
KEY_OPS = (OP_HELD, OP_TIER_PREFIX, OP_CLEAR_LOCAL)
BODY_OPS = (OP_EXPLAIN, OP_CONTROL, OP_ENGINE_PREFIX, OP_FIND)
MAX_BODY_BYTES = 16 << 20  # a question's body (an 8k-token prompt's find is about 70 KiB)
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
    """Returns the frame asking key op `op` about `keys`; ValueError past MAX_KEYS or MAX_KEY_BYTES."""
    if len(keys) > MAX_KEYS:
        raise ValueError(f"lookup channel: {len(keys)} keys in one question, at most {MAX_KEYS}")
    parts = [_U32.pack(op << _OP_SHIFT | len(keys))]
    for key in keys:
        raw = key.encode()
        if len(raw) > MAX_KEY_BYTES:
            raise ValueError(f"lookup channel: a key of {len(raw)} bytes, at most {MAX_KEY_BYTES}")
        parts += (_U32.pack(len(raw)), raw)
    return b"".join(parts)


def encode_body_question(body: bytes, op: int) -> bytes:
    """Returns the frame asking body op `op` (BODY_OPS); ValueError past MAX_BODY_BYTES."""
    if len(body) > MAX_BODY_BYTES:
        raise ValueError(f"lookup channel: a question of {len(body)} bytes, at most {MAX_BODY_BYTES}")
    return _U32.pack(op << _OP_SHIFT) + _U32.pack(len(body)) + body


@dataclass(frozen=True)
class Question:
    """One question read off the channel: its op and, per its kind, its keys or its body."""

    op: int
    keys: list[str]
    body: bytes = b""


def read_question(sock: socket.socket) -> Question:
    """Returns the next question on `sock`; ValueError on a malformed frame or an unknown op,
    ConnectionError when the peer closed."""
    (header,) = _U32.unpack(_read_exact(sock, 4))
    op, count = header >> _OP_SHIFT, header & ((1 << _OP_SHIFT) - 1)
    if op in BODY_OPS:
        (n,) = _U32.unpack(_read_exact(sock, 4))
        if count or n > MAX_BODY_BYTES:
            raise ValueError(f"lookup channel: a question body of {n} bytes, at most {MAX_BODY_BYTES}")
        return Question(op, [], _read_exact(sock, n))
    if op not in KEY_OPS:
        raise ValueError(f"lookup channel: unknown op {op}")
    if count > MAX_KEYS:
        raise ValueError(f"lookup channel: {count} keys in one question, at most {MAX_KEYS}")
    return Question(op, [_read_text(sock, "a key") for _ in range(count)])


def _read_tier_count(sock: socket.socket) -> int:
    """Returns the next u32 on `sock`, an answer's tier count; ValueError past MAX_TIERS."""
    (count,) = _U32.unpack(_read_exact(sock, 4))
    if count > MAX_TIERS:
        raise ValueError(f"lookup channel: {count} tiers in one answer, at most {MAX_TIERS}")
    return int(count)


def _read_text(sock: socket.socket, what: str) -> str:
    """Returns the next u32-length-prefixed UTF-8 string on `sock`; ValueError past MAX_KEY_BYTES."""
    (n,) = _U32.unpack(_read_exact(sock, 4))
    if n > MAX_KEY_BYTES:
        raise ValueError(f"lookup channel: {what} of {n} bytes, at most {MAX_KEY_BYTES}")
    return _read_exact(sock, n).decode()


class _Body:
    """Reads a body's fields in order; ValueError when one runs past its end."""

    def __init__(self, raw: bytes) -> None:
        self.raw = raw
        self.at = 0

    def take(self, n: int) -> bytes:
        if n < 0 or self.at + n > len(self.raw):
            raise ValueError("lookup channel: a truncated frame")
        out = self.raw[self.at:self.at + n]
        self.at += n
        return out

    def unpack(self, fmt: struct.Struct) -> tuple[Any, ...]:
        return fmt.unpack(self.take(fmt.size))

    def text(self) -> str | None:
        (n,) = self.unpack(_U32)
        return None if n == _NONE else self.take(n).decode()


_NONE = 0xFFFFFFFF  # a text field's length when it is None
_I64 = struct.Struct("<q")
_SPAN = struct.Struct("<qq16s")
_PARTIAL = struct.Struct("<q16sB")


def _text(value: str | None) -> bytes:
    if value is None:
        return _U32.pack(_NONE)
    raw = value.encode()
    return _U32.pack(len(raw)) + raw


@dataclass(frozen=True)
class FindQuestion:
    """`HeldKeys.find`'s arguments on the wire: spans as (start, end, chain), keyed again by
    the worker in its own keyspace, which must have the asker's `identity`."""

    identity: str
    cache_salt: str | None
    after: int
    base: int
    parent: bytes
    spans: list[tuple[int, int, bytes]]
    tokens: list[int]


def encode_find(q: FindQuestion) -> bytes:
    """Returns the OP_FIND frame of `q`; ValueError past MAX_BODY_BYTES."""
    parts = [_text(q.identity), _text(q.cache_salt), _I64.pack(q.after), _I64.pack(q.base), q.parent,
             _U32.pack(len(q.spans)), *(_SPAN.pack(*sp) for sp in q.spans),
             _U32.pack(len(q.tokens)), struct.pack(f"<{len(q.tokens)}q", *q.tokens)]
    return encode_body_question(b"".join(parts), OP_FIND)


def decode_find(raw: bytes) -> FindQuestion:
    """Returns the OP_FIND question in body `raw`; ValueError if malformed."""
    body = _Body(raw)
    identity, salt = body.text(), body.text()
    (after,), (base,) = body.unpack(_I64), body.unpack(_I64)
    parent = body.take(16)
    (n,) = body.unpack(_U32)
    if n > MAX_KEYS:
        raise ValueError(f"lookup channel: {n} spans in one question, at most {MAX_KEYS}")
    spans = [body.unpack(_SPAN) for _ in range(n)]
    (m,) = body.unpack(_U32)
    tokens = list(struct.unpack(f"<{m}q", body.take(8 * m)))
    if identity is None or body.at != len(raw):
        raise ValueError("lookup channel: a malformed find question")
    if any(not base <= s < e <= base + m for s, e, _ in spans):
        raise ValueError("lookup channel: a find question's spans run past its tokens")
    return FindQuestion(identity, salt, after, base, parent, [(s, e, c) for s, e, c in spans], tokens)


def encode_found(found: Found | None) -> bytes:
    """Returns the OP_FIND answer: `found`, or status 1 (None: the worker keys chunks otherwise)."""
    if found is None:
        return b"\x01"
    names = [_text(name) for name in found.tier_names]
    partial = found.partial
    tail = _PARTIAL.pack(partial.end, partial.chain, found.partial_tier) if partial is not None else \
        _PARTIAL.pack(0, bytes(16), 0)
    return b"".join([b"\x00", _U32.pack(len(names)), *names, _U32.pack(len(found.tiers)), bytes(found.tiers), tail])


def read_found(sock: socket.socket, keyspace: Keyspace, spans: Sequence[Span]) -> Found | None:
    """Returns the OP_FIND answer to a question about `spans` (None: the worker refused it: its
    keyspace differs); ValueError when it is malformed (a run past `spans`, an unknown tier, a
    partial chunk outside the span it starts)."""
    if _read_exact(sock, 1) == b"\x01":
        return None
    count = _read_tier_count(sock)
    names = [_read_text(sock, "a tier name") for _ in range(count)]
    (run,) = _U32.unpack(_read_exact(sock, 4))
    if run > len(spans):
        raise ValueError(f"lookup channel: a run of {run} chunks in an answer about {len(spans)}")
    tiers = list(_read_exact(sock, run))
    end, chain, tier = _PARTIAL.unpack(_read_exact(sock, _PARTIAL.size))
    if any(t >= count for t in tiers) or (end and tier >= count):
        raise ValueError("lookup channel: an answer names a tier it did not list")
    if not end:
        return Found(tiers, tuple(names))
    if run == len(spans) or not spans[run].start < end < spans[run].end:
        raise ValueError("lookup channel: a partial chunk outside the span it starts")
    return Found(tiers, tuple(names), Span(spans[run].start, end, keyspace.key(chain), chain), tier)


def encode_tier_hits(hits: dict[str, int]) -> bytes:
    """Returns the frame answering OP_TIER_PREFIX with `hits` (tier name -> leading keys held)."""
    parts = [_U32.pack(len(hits))]
    for name, n in hits.items():
        parts += (_text(name), _U32.pack(n))
    return b"".join(parts)


def read_tier_hits(sock: socket.socket, num_keys: int) -> dict[str, int]:
    """Returns the OP_TIER_PREFIX answer to a question of `num_keys` keys; ValueError on a
    malformed frame (past MAX_TIERS tiers or MAX_KEY_BYTES a name, a count over `num_keys`)."""
    hits: dict[str, int] = {}
    for _ in range(_read_tier_count(sock)):
        name = _read_text(sock, "a tier name")
        (held,) = _U32.unpack(_read_exact(sock, 4))
        if held > num_keys:
            raise ValueError(f"lookup channel: tier {name!r} holds {held} of {num_keys} keys")
        hits[name] = held
    return hits


def encode_json_question(question: dict[str, Any], op: int) -> bytes:
    """Returns the frame asking JSON op `op` `question`; ValueError past MAX_BODY_BYTES."""
    return encode_body_question(json.dumps(question).encode(), op)


def decode_json_question(body: bytes) -> dict[str, Any]:
    """Returns the JSON object a JSON op's body carries; ValueError unless it is one."""
    question = json.loads(body)
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
    """Answers existence questions about `held_keys` (its chunks keyed in `keyspace`) on a Unix
    socket, from daemon threads (without `held_keys`, as the scheduler side serves, only
    OP_ENGINE_PREFIX).

    Guarantees: the socket file is created owner-only and removed by `close()`, which also
    ends open connections; a bad question ends only its own connection; a find from a
    keyspace of another identity is refused (a miss), never answered with other keys.
    """

    def __init__(self, held_keys: HeldKeys | None, path: Path, keyspace: Keyspace | None = None,
                 clear_local: Callable[[], None] | None = None, explainer: Explainer | None = None,
                 controller: Controller | None = None, engine_prefix: EnginePrefix | None = None) -> None:
        self.held_keys = held_keys
        self.keyspace = keyspace
        self.clear_local = clear_local  # OP_CLEAR_LOCAL (vLLM's reset_cache)
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
                if q.op == OP_ENGINE_PREFIX:
                    ids, salt = _prompt_question(decode_json_question(q.body))
                    sock.sendall(encode_json({} if self.engine_prefix is None
                                             else {"tokens": self.engine_prefix(ids, salt)}))
                    continue
                if self.held_keys is None:
                    raise ValueError(f"lookup channel: op {q.op} asked of a server without tiers")
                if q.op == OP_FIND:
                    sock.sendall(encode_found(self._find(decode_find(q.body))))
                elif q.op == OP_HELD:
                    sock.sendall(bytes(self.held_keys.held(q.keys)) if q.keys else b"")
                elif q.op == OP_TIER_PREFIX:
                    sock.sendall(encode_tier_hits(self.held_keys.tier_prefix_hits(q.keys)))
                elif q.op == OP_EXPLAIN:
                    sock.sendall(encode_json(self._explain(decode_json_question(q.body))))
                elif q.op == OP_CONTROL:
                    question = decode_json_question(q.body)
                    sock.sendall(encode_json({} if self.controller is None else self.controller(question)))
                elif q.op == OP_CLEAR_LOCAL:
                    if self.clear_local is None:
                        raise ValueError("lookup channel: a clear asked of a server that cannot")
                    self.clear_local()
                    sock.sendall(b"\x01")
        except ConnectionError:
            return
        except (ValueError, UnicodeDecodeError, OSError) as e:
            log.warning("lookup channel: dropping a connection: %s", e)
        finally:
            with self._lock:
                self._open.discard(sock)

    def _find(self, q: FindQuestion) -> Found | None:
        """Returns the held keys' `find` for question `q`, its spans keyed in this server's
        keyspace; None (refused) when that keyspace's identity is not the asker's."""
        if self.held_keys is None or self.keyspace is None or q.identity != self.keyspace.identity:
            log.warning("lookup channel: a find from keyspace %r, this worker keys %r: refused (a miss)",
                        q.identity, None if self.keyspace is None else self.keyspace.identity)
            return None
        ks = self.keyspace.for_salt(q.cache_salt)
        spans = [Span(start, end, ks.key(chain), chain) for start, end, chain in q.spans]
        return self.held_keys.find(ks, q.tokens, q.base, spans, q.parent, q.after)

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
        question = FindQuestion(keyspace.identity, keyspace.cache_salt, after, base, parent,
                                [(sp.start, sp.end, sp.chain) for sp in spans], list(tokens))
        answer = self._ask(encode_find(question), lambda sock: read_found(sock, keyspace, spans))
        return answer or Found()

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
            self.questions += 1
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
