"""`kvtier serve`: an OpenAI-compatible HTTP server over one engine (FastAPI + uvicorn).

- `protocol.py`: the OpenAI request and response models (pydantic) and the error shape.
- `http_edge.py`: API key, request-body bound and OpenAI-shaped errors (the router's too).
- `engine_loop.py`: the one thread that owns the engine, and the handlers' only way to it
  (submit, stream, abort, lookup, stats, reset the prefix cache, wait for stores).
- `metrics.py`: Prometheus metrics (`kvtier:` names, as vLLM uses `vllm:`).
- `serving.py`: completions and chat: sampling parameters, streaming, usage.
- `app.py`: the FastAPI application (routes).
"""
