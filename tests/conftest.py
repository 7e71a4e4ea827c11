"""Shared fixtures live in tests/fixtures/ (one module per real part they start)."""

pytest_plugins = [
    "tests.fixtures.model",
    "tests.fixtures.redis_server",
    "tests.fixtures.cache_server",
]
