"""`POST /kv/lookup` for `vllm serve` with KVTierConnector: what `kvtier router --policy
kv-aware` asks each backend (kvtier serve answers the same question, kvtier/server/server_app.py);
and the cache-control routes `POST /kv/<name>`, one per entry of connector/vllm/control_ops.py's
`CONTROL_OPS` (inspect, pin, unpin, prefetch, move, drop, clear, budget), with kvtier serve's
bodies and answers (docs/serving.md, "Operating the cache"; docs/vllm.md).

Added through vLLM's own option, `--middleware connector.vllm.lookup_route.KvLookupRoute`
(`kvtier-vllm serve` adds it by itself). A pure ASGI middleware: every other request goes
straight on to vLLM. The body takes one of `prompt` (text), `prompt_token_ids` or `messages`
(chat), and `model`; the answer has kvtier serve's shape:

- `num_tokens`: the prompt's tokens as vLLM computes them for the same completion or chat
  request: text and messages go through vLLM's own `/tokenize` route, in process (its
  renderer, chat template and defaults; chat fields such as `add_generation_prompt` or
  `chat_template_kwargs` in the body are honoured as there).
- `tiers`: per tier, how many leading tokens it holds as stored chunks, never the last token
  (vLLM always computes it), asked of the worker process's tiers over the lookup channel
  (connector/vllm/lookup_channel.py, `TierPrefixQuestion`; with tensor parallel, the shortest rank's).
  Stores still queued are not counted.
- `engine_prefix_cache_tokens`: how many leading tokens vLLM's own prefix cache holds (whole
  blocks, never the last token), asked of the connector's scheduler side, which lives in
  vLLM's EngineCore process beside that cache (`EnginePrefixQuestion`; 0 if it does not answer).
- `max_hit_tokens`: the longest of the two, what a request would not compute.
- `cache_salt` (optional, vLLM's rules): only that tenant's chunks count, as a request with
  that salt would load them; without it only unsalted chunks count.
- `num_requests_running` / `num_requests_waiting`: vLLM's own gauges as its `/metrics` shows
  them (the last engine step's); 0 when vLLM keeps no stats (`--disable-log-stats`).
- `explain` (with `"explain": true` in the body): per tier why it holds no more of the prompt,
  as kvtier serve answers it (connector/explain.py), asked of rank 0's worker over the lookup
  channel (`ExplainQuestion`; with tensor parallel, rank 0's KV heads); null when it does not answer.
  Every client shares vLLM's API key, so only the asked tenant's and unsalted entries count.

The control routes are connector/vllm/control_ops.py's CONTROL_OPS, one route `/kv/<name>` per
op: a prompt op's body is tokenized as above and sent with its `cache_salt` and other fields
as a `ControlQuestion` to the worker, which answers it with the same functions as
kvtier serve; ops that change state go to every tensor-parallel rank (each holds its own KV
heads) and their answers are merged (each op's `merge`). What only vLLM's front end
knows is added here (`ENGINE_PARTS`: the model name, vLLM's own prefix cache reset by
`/kv/clear` with `all`).

Guarded by vLLM's `--api-key` (or `VLLM_API_KEY`) like its `/v1` routes: a lookup tells whether
a prompt was seen. Every client shares that key: there is no operator/tenant split as on
kvtier serve, so any client may pin and clear. Bad input is a 400 naming the problem; a worker
that does not answer a 503. This module never imports vllm: it reads vLLM's app state by
attribute, and takes the keyspace from connector/vllm/connector.py, imported when first asked (inside
vLLM's API server, where vllm is loaded anyway).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any

from connector.bearer_auth import bearer_key
from connector.presence import held_tokens
from connector.vllm.control_ops import CONTROL_OPS
from connector.vllm.lookup_channel import LookupClient, lookup_socket_path, scheduler_socket_path
from kvkeys.tenants import validate_cache_salt
from kvstore.deadlines import CONTROL_CHANNEL_S, EXPLAIN_CHANNEL_S, LOOKUP_ROUTE_CHANNEL_S

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

LOOKUP_PATH = "/kv/lookup"
MAX_BODY_BYTES = 16 << 20
MAX_DETAIL = 500  # characters of vLLM's own error message kept in a 400
FORMS = ("prompt", "prompt_token_ids", "messages")
TOKENIZE_FIELDS = ("add_special_tokens", "add_generation_prompt", "continue_final_message", "chat_template",
                   "chat_template_kwargs", "tools")
"""Fields of a lookup body passed on to vLLM's /tokenize: they change the prompt's tokens."""
PROMPT_FIELDS = frozenset(("model", "explain", *FORMS, *TOKENIZE_FIELDS))
"""Fields of a prompt op's body the route consumes (the rest go to the worker's question)."""
CONTROL_PATHS = {f"/kv/{name}": name for name in CONTROL_OPS}
_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")


class Rejected(Exception):
    """A request refused: HTTP `status`, a message naming the problem, the field at fault, and
    a code (default: the status)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code = status if code is None else code

    def body(self) -> dict[str, Any]:
        """Returns the refusal in OpenAI's error shape."""
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def lookup_form(body: Any) -> tuple[str, Any]:
    """Returns (form, value) of a lookup body: ("prompt_token_ids", ids), ("prompt", text) or
    ("messages", list); Rejected (400) unless exactly one well-typed form is given."""
    if not isinstance(body, dict):
        raise Rejected(400, "the body must be a JSON object")
    forms = [f for f in FORMS if body.get(f) is not None]
    if len(forms) != 1:
        raise Rejected(400, "give exactly one of prompt, prompt_token_ids or messages", "prompt")
    form, value = forms[0], body[forms[0]]
    if form == "prompt_token_ids":
        if not isinstance(value, list) or not value or not all(type(t) is int and t >= 0 for t in value):
            raise Rejected(400, "prompt_token_ids must be a non-empty list of non-negative integers", form)
    elif form == "prompt" and not (isinstance(value, str) and value):
        raise Rejected(400, "prompt must be a non-empty string (send token ids as prompt_token_ids)", form)
    elif form == "messages" and not (isinstance(value, list) and value):
        raise Rejected(400, "messages must be a non-empty list of chat messages", form)
    return form, value


class _Tiers:
    """The worker's tiers as this server's connector keys them, asked over the lookup channel
    (every tensor-parallel rank's), and vLLM's own prefix cache, asked of the scheduler side."""

    def __init__(self, vllm_config: Any) -> None:
        from connector.vllm.setup import vllm_setup
        from connector.vllm.vllm_api import (  # imports vllm: only inside vLLM's server
            attention_backend,
            cpu_attention_isa,
        )

        setup = vllm_setup(vllm_config, None, attention_backend(), cpu_attention_isa)
        self.keyspace = setup.keyspace()
        engine_id = vllm_config.kv_transfer_config.engine_id
        self.presence = setup.worker_presence(engine_id, timeout=LOOKUP_ROUTE_CHANNEL_S,
                                              connect_timeout=LOOKUP_ROUTE_CHANNEL_S)
        self.explainer = LookupClient(lookup_socket_path(engine_id, 0), timeout=EXPLAIN_CHANNEL_S,
                                        connect_timeout=LOOKUP_ROUTE_CHANNEL_S)
        self.scheduler = LookupClient(scheduler_socket_path(engine_id), timeout=LOOKUP_ROUTE_CHANNEL_S,
                                        connect_timeout=LOOKUP_ROUTE_CHANNEL_S)
        # the control ops' own connections: a slow clear never holds up a lookup
        self.controls = [LookupClient(lookup_socket_path(engine_id, r), timeout=CONTROL_CHANNEL_S,
                                        connect_timeout=LOOKUP_ROUTE_CHANNEL_S) for r in range(setup.tp_size)]

    def held(self, token_ids: Sequence[int], cache_salt: str | None = None) -> dict[str, int]:
        """Returns per tier (fastest first) the leading tokens held for requests of
        `cache_salt`; {} if a worker does not answer."""
        ks = self.keyspace.for_salt(cache_salt)
        spans = ks.spans(token_ids)
        return held_tokens(spans, self.presence.tier_prefix_chunks(ks, spans), len(token_ids))

    def engine_prefix(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """Returns how many leading tokens vLLM's own prefix cache holds for requests of
        `cache_salt`; 0 if the scheduler side does not answer."""
        return self.scheduler.engine_prefix(token_ids, cache_salt) or 0

    def explain(self, token_ids: Sequence[int], cache_salt: str | None = None) -> dict[str, Any] | None:
        """Returns rank 0's worker's explain of the prompt for requests of `cache_salt`
        (connector/explain.py); None if it does not answer."""
        return self.explainer.explain(token_ids, cache_salt, other_tenants=False)

    def control(self, question: dict[str, Any]) -> dict[str, Any]:
        """Returns the answer to a control question (`{"op": name, ...}`): every rank's merged
        (rank 0's alone for an op that is not `every_rank`). Rejected with the worker's status
        for a refusal, 503 for a worker that does not answer; both name the rank and, for an op
        some ranks already ran, which."""
        op = CONTROL_OPS[question["op"]]
        ranks = self.controls if op.every_rank else self.controls[:1]
        answers: list[dict[str, Any]] = []
        for r, rank in enumerate(ranks):
            answer = rank.control(question)
            where = f"rank {r}'s worker" if len(self.controls) > 1 else "the worker"
            done = f" (ranks {', '.join(map(str, range(r)))} did it)" if r else ""
            if answer is None:
                raise Rejected(503, f"{where} did not answer {question['op']} within {CONTROL_CHANNEL_S:g} s "
                                    f"(see vLLM's log){done}")
            error = answer.get("error")
            if isinstance(error, dict):
                message = str(error.get("message"))
                raise Rejected(int(error.get("status") or 500),
                               message if len(self.controls) == 1 else f"{where}: {message}{done}",
                               error.get("param"), error.get("code"))
            answers.append(answer)
        return op.merge(answers)


EnginePart = Callable[[Any, _Tiers, dict[str, Any], dict[str, Any]], Awaitable[dict[str, Any]]]
"""(vLLM's app state, the channels, the question the workers answered, their answer) -> the answer."""


async def _inspect_engine(state: Any, tiers: _Tiers, question: dict[str, Any],
                          answer: dict[str, Any]) -> dict[str, Any]:
    """Inspect's model and how much of the prompt vLLM's own prefix cache holds."""
    engine = await asyncio.to_thread(tiers.engine_prefix, question["token_ids"], question["cache_salt"])
    return {"model": _model_names(state)[0], "engine_prefix_cache_tokens": engine, **answer}


async def _clear_engine(state: Any, tiers: _Tiers, question: dict[str, Any],
                        answer: dict[str, Any]) -> dict[str, Any]:
    """Clear's engine part: with `all`, vLLM's own prefix cache is reset (`engine_reset`, false
    while requests hold blocks); a tenant's blocks cannot be dropped from it alone (null)."""
    if answer.get("cleared") == "all":
        reset = await state.engine_client.reset_prefix_cache()
        return {"cleared": "all", "engine_reset": bool(reset), "tiers": answer.get("tiers", {})}
    if answer.get("cleared") == "tenant":
        return {"cleared": "tenant", "engine_blocks": None, **answer}
    return answer


ENGINE_PARTS: dict[str, EnginePart] = {"inspect": _inspect_engine, "clear": _clear_engine}
"""What a control op's answer gets from vLLM's front end after the workers answered (by op)."""


def _model_names(state: Any) -> list[str]:
    return [p.name for p in state.openai_serving_models.base_model_paths]


class KvLookupRoute:
    """ASGI middleware answering `POST /kv/lookup` and the control routes `/kv/<op>` (module
    docstring); all else passes through."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._tiers: _Tiers | None = None
        self._setup_lock = asyncio.Lock()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"].removeprefix(scope.get("root_path", "")) if scope["type"] == "http" else None
        if path != LOOKUP_PATH and path not in CONTROL_PATHS:
            await self.app(scope, receive, send)
            return
        try:
            body = await _request(scope, receive, path)
            if path == LOOKUP_PATH:
                status, answer = 200, await self._lookup(scope, body)
            else:
                status, answer = 200, await self._control(scope, body, CONTROL_PATHS[path])
        except Rejected as exc:
            status, answer = exc.status, exc.body()
        await _send_json(send, status, answer)

    async def _prompt(self, scope: Scope, body: Any) -> tuple[list[int], str | None]:
        """Returns the body's prompt as vLLM would tokenize it, and its cache_salt; Rejected
        (400 naming the field, 404 for another model) otherwise."""
        form, value = lookup_form(body)
        try:
            salt = validate_cache_salt(body.get("cache_salt"))
        except ValueError as exc:
            raise Rejected(400, str(exc), "cache_salt") from None
        state = scope["app"].state
        names = _model_names(state)
        model = body.get("model")
        if model is not None and model not in names:
            raise Rejected(404, f"The model `{model}` does not exist (this server serves {', '.join(names)}).",
                           "model")
        mc = state.vllm_config.model_config
        if form == "prompt_token_ids":
            ids = value
            vocab = mc.get_vocab_size()
            if max(ids) >= vocab:
                raise Rejected(400, f"prompt_token_ids holds {max(ids)}, past the vocabulary ({vocab} tokens)", form)
        else:
            ids = await self._tokenize(scope, form, body)
        if len(ids) > mc.max_model_len:
            raise Rejected(400, f"the prompt has {len(ids)} tokens, more than this server's max_model_len "
                                f"({mc.max_model_len})", form)
        return ids, salt

    async def _lookup(self, scope: Scope, body: Any) -> dict[str, Any]:
        ids, salt = await self._prompt(scope, body)
        state = scope["app"].state
        worker = await self._tiers_of(state)
        tiers, engine = await asyncio.gather(asyncio.to_thread(worker.held, ids, salt),
                                             asyncio.to_thread(worker.engine_prefix, ids, salt))
        running, waiting = _load()
        answer = {"model": _model_names(state)[0], "num_tokens": len(ids), "engine_prefix_cache_tokens": engine,
                  "tiers": tiers, "max_hit_tokens": max([engine, *tiers.values()]), "num_requests_running": running,
                  "num_requests_waiting": waiting}
        if body.get("explain") is True:  # every client shares vLLM's key: no other tenant's entries
            answer["explain"] = await asyncio.to_thread(worker.explain, ids, salt)
        return answer

    async def _control(self, scope: Scope, body: Any, name: str) -> dict[str, Any]:
        """Returns control op `name`'s answer to `body` (CONTROL_OPS), asked of the workers."""
        if not isinstance(body, dict):
            raise Rejected(400, "the body must be a JSON object")
        question = dict(body)
        if CONTROL_OPS[name].prompt:
            ids, salt = await self._prompt(scope, body)
            question = {k: v for k, v in body.items() if k not in PROMPT_FIELDS}
            question |= {"token_ids": ids, "cache_salt": salt}
        question["op"] = name
        state = scope["app"].state
        worker = await self._tiers_of(state)
        ran = None
        if name == "prefetch" and question.pop("compute", False) is True:
            ran = await self._run_prompt(scope, state, question["token_ids"], question["cache_salt"])
        answer = await asyncio.to_thread(worker.control, question)
        if ran is not None and "error" not in answer:
            answer["ran_request"] = ran
        part = ENGINE_PARTS.get(name)
        return answer if part is None else await part(state, worker, question, answer)

    async def _tiers_of(self, state: Any) -> _Tiers:
        async with self._setup_lock:
            if self._tiers is None:
                kvt = state.vllm_config.kv_transfer_config
                if kvt is None or kvt.kv_connector != "KVTierConnector":
                    raise Rejected(501, "kvtier's /kv routes need --kv-transfer-config with KVTierConnector")
                self._tiers = await asyncio.to_thread(_Tiers, state.vllm_config)
            return self._tiers

    async def _run_prompt(self, scope: Scope, state: Any, ids: list[int], salt: str | None) -> dict[str, Any]:
        """Runs the prompt through vLLM as a one-token completion (prefetch's `compute`: what no
        tier holds is computed, and kvtier's connector stores it); returns its prompt and cached
        tokens as vLLM counted them. Rejected with vLLM's message if it refused."""
        payload: dict[str, Any] = {"model": _model_names(state)[0], "prompt": ids, "max_tokens": 1}
        if salt is not None:
            payload["cache_salt"] = salt
        status, raw = await _call(self.app, scope, _sibling(scope, "/v1/completions"), payload)
        try:
            usage = json.loads(raw)["usage"] if status == 200 else None
        except (ValueError, KeyError, TypeError):
            usage = None
        if not isinstance(usage, dict):
            raise Rejected(400 if 400 <= status < 500 else 500,
                           f"vLLM could not run the prompt: {raw.decode(errors='replace')[:MAX_DETAIL]}", "compute")
        details = usage.get("prompt_tokens_details") or {}
        return {"prompt_tokens": usage.get("prompt_tokens"), "cached_tokens": details.get("cached_tokens", 0)}

    async def _tokenize(self, scope: Scope, form: str, body: dict[str, Any]) -> list[int]:
        """Returns the prompt's token ids as vLLM's own /tokenize computes them."""
        payload = {k: body[k] for k in ("model", form, *TOKENIZE_FIELDS) if k in body}
        status, raw = await _call(self.app, scope, _sibling(scope, "/tokenize"), payload)
        try:
            answer = json.loads(raw)
        except ValueError:
            answer = None
        if status == 200 and isinstance(answer, dict) and isinstance(answer.get("tokens"), list):
            if not answer["tokens"]:
                raise Rejected(400, f"the {form} has no tokens", form)
            return list(answer["tokens"])
        error = answer.get("error") if isinstance(answer, dict) else None
        detail = str(error.get("message")) if isinstance(error, dict) else raw.decode(errors="replace")
        raise Rejected(400 if 400 <= status < 500 else 500,
                       f"vLLM could not tokenize the {form}: {detail[:MAX_DETAIL]}", form)


def _sibling(scope: Scope, route: str) -> str:
    """Returns the path of vLLM's `route` under the same root path as this request's."""
    own = scope["path"].removeprefix(scope.get("root_path", ""))
    return scope["path"][: -len(own)] + route


async def _request(scope: Scope, receive: Receive, path: str) -> Any:
    """Returns the JSON body of a POST to one of this module's routes, after vLLM's API key
    check; Rejected (405, 401, 413, 400) otherwise."""
    if scope.get("method") != "POST":
        raise Rejected(405, f"{path} takes POST")
    _authorize(scope["app"].state, scope)
    try:
        return json.loads(await _read_body(scope, receive))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise Rejected(400, f"the body is not JSON: {exc}") from None


def _authorize(state: Any, scope: Scope) -> None:
    """Raises Rejected (401) unless the request carries one of vLLM's API keys (if it has any)."""
    keys = [k for k in (state.args.api_key or [os.environ.get("VLLM_API_KEY")]) if k]
    if not keys:
        return
    headers = dict(scope.get("headers") or [])
    scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
    # The scheme in any case, as vLLM's own check of its /v1 routes takes it.
    if scheme.lower() != "bearer" or bearer_key(f"Bearer {token}", keys) is None:
        raise Rejected(401, "Unauthorized: give Authorization: Bearer <one of vLLM's --api-key>")


def _load() -> tuple[int, int]:
    """Returns vLLM's running and waiting request counts from its gauges (0, 0 without them)."""
    from prometheus_client import REGISTRY

    totals = dict.fromkeys(_GAUGES, 0.0)
    for family in REGISTRY.restricted_registry(_GAUGES).collect():
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return int(totals[_GAUGES[0]]), int(totals[_GAUGES[1]])


async def _read_body(scope: Scope, receive: Receive) -> bytes:
    """Returns the request body; Rejected (413) past MAX_BODY_BYTES."""
    length = dict(scope.get("headers") or []).get(b"content-length", b"0")
    if length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise Rejected(413, f"the body has {int(length)} bytes, at most {MAX_BODY_BYTES}")
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise Rejected(400, "the client left before sending the whole body")
        parts.append(message.get("body", b""))
        size += len(parts[-1])
        if size > MAX_BODY_BYTES:
            raise Rejected(413, f"the body has more than {MAX_BODY_BYTES} bytes")
        if not message.get("more_body", False):
            return b"".join(parts)


async def _call(app: ASGIApp, scope: Scope, path: str, payload: dict[str, Any]) -> tuple[int, bytes]:
    """Returns (status, body) of `payload` POSTed as JSON to `path` of `app`, in process, with
    `scope`'s connection details (vLLM's handlers read their app from the scope) and its
    Authorization header (vLLM's `/v1` routes check the key again)."""
    data = json.dumps(payload).encode()
    auth = [(k, v) for k, v in scope.get("headers", []) if k.lower() == b"authorization"]  # the caller's, checked
    sub = {**scope, "path": path, "raw_path": path.encode(), "method": "POST", "query_string": b"",
           "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()), *auth]}
    done = asyncio.Event()
    status, chunks, sent = 500, list[bytes](), False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": data, "more_body": False}
        await done.wait()  # a handler watching for a disconnect sees one only once it answered
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                done.set()

    try:
        await app(sub, receive, send)
    finally:
        done.set()
    return status, b"".join(chunks)


async def _send_json(send: Send, status: int, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})
