"""`kvtier serve`: an OpenAI-compatible HTTP server over one engine (FastAPI + uvicorn).

- `openai_protocol.py`: the request models (pydantic: OpenAI's, `/tokenize`'s, the `/kv/*`
  routes') and `APIError`, OpenAI's error shape.
- `http_edge.py`: API key, request-body bound and OpenAI-shaped errors (the router's too).
- `tenant_auth.py`: which `cache_salt` a request runs under (`--tenants`: bound to its API key).
- `engine_loop.py`: the one thread that owns the engine, and the handlers' only way to it
  (submit, stream, abort, lookup, stats, reset the prefix cache, wait for stores).
- `server_metrics.py`: Prometheus metrics (`kvtier:` names, as vLLM uses `vllm:`).
- `engine_requests.py`: OpenAI requests to engine requests (sampling fields, n, logprobs).
- `serving.py`: completions and chat: streaming, usage, echo, best_of.
- `logprobs_format.py`: logprobs in the completions and chat wire shapes.
- `server_app.py`: the FastAPI application (routes).
- `cache_routes.py`: operating the cache: `/kv/inspect`, `/kv/pin`, `/kv/unpin`, `/kv/prefetch`,
  `/kv/move`, `/kv/drop`, `/kv/clear`, `/kv/budget`.
"""
