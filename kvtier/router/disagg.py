"""Disaggregated prefill: a prefill backend (`kvtier serve --kv-role producer`) computes the
prompt's K/V and stores it in the shared tier before answering its one token; a decode
backend (`--kv-role consumer`) then loads that prefix and generates the answer the client
sees. If no prefill backend serves the request, the decode backend prefills it itself."""

from __future__ import annotations

import logging
from typing import Any

from fastapi.responses import Response

from kvtier.router.proxy import Proxy

logger = logging.getLogger("kvtier.router")


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """Returns `body` as a producer call: one token, not streamed."""
    out = {k: v for k, v in body.items() if k != "stream_options"}
    out.update(stream=False, max_tokens=1)
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


async def prefill_then_decode(proxy: Proxy, path: str, body: dict[str, Any], headers: dict[str, str]) -> Response:
    """Returns the decode backend's response to `body`, after a prefill backend has stored the
    prompt's K/V (or failed to: then decode prefills, counted as a fallback). A request the
    prefill backend rejects as invalid (4xx other than 429) is answered with that error."""
    first = await proxy.forward(path, prefill_body(body), headers, role="prefill")
    if 400 <= first.status_code < 500 and first.status_code != 429:
        return first
    if first.status_code != 200:
        proxy.metrics.prefill_fallbacks.inc()
        logger.warning("prefill failed (HTTP %d); the decode backend prefills this request", first.status_code)
    return await proxy.forward(path, body, headers, role="decode")
