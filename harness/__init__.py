"""What the tests and the benchmarks share: the processes they start (process.py, the one place
that starts any: kvtier's servers, Redis, vLLM, short-lived children) and the material they run
(tiny checkpoints, model families, prompts, lm-eval tasks). Not shipped (pyproject.toml's
packages), not type-checked, as tests/ and benchmarks/; benchmarks import it, never tests/
(tests/test_process_harness.py checks both)."""
