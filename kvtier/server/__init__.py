"""`kvtier serve`: an OpenAI-compatible HTTP server over one engine (FastAPI + uvicorn).

- `protocol.py`: the OpenAI request and response models (pydantic) and the error shape.
- `engine_loop.py`: the one thread that owns the engine; handlers submit and stream from it.
- `metrics.py`: Prometheus metrics (`kvtier:` names, as vLLM uses `vllm:`).
- `serving.py`: completions and chat: sampling parameters, streaming, usage.
- `app.py`: the FastAPI application (routes, API key, errors).
"""
