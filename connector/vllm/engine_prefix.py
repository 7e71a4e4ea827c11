"""How much of a prompt vLLM's own prefix cache holds, answered from the scheduler process
(where that cache lives) on its own socket, for `vllm serve`'s /kv/lookup
(connector/vllm/lookup_route.py asks it: `EnginePrefixQuestion` on `scheduler_socket_path`)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from connector.vllm.lookup_channel import LookupServer, scheduler_socket_path
from connector.vllm.vllm_api import LOGGER, prefix_cache_tokens

log = logging.getLogger(LOGGER)


class EnginePrefixServer:
    """Answers `EnginePrefixQuestion` from vLLM's cache manager `manager` until `close()`.

    Guarantees: a question is answered from a read of the block pool only (nothing touched or
    counted); one it cannot answer is 0 (logged), never an error."""

    def __init__(self, manager: Any, hash_algo: str, instance_id: str) -> None:
        self.manager = manager
        self.hash_algo = hash_algo
        self._server = LookupServer(None, scheduler_socket_path(instance_id), engine_prefix=self.tokens)

    def tokens(self, token_ids: Sequence[int], cache_salt: str | None) -> int:
        """Returns how many leading tokens of the prompt vLLM's prefix cache holds for requests
        of `cache_salt`; 0 if it cannot tell (logged)."""
        try:
            return prefix_cache_tokens(self.manager, self.hash_algo, token_ids, cache_salt)
        except Exception:  # a read racing vLLM's own step, or a vLLM whose internals moved: a miss
            log.warning("KVTierConnector: could not read vLLM's prefix cache for a lookup", exc_info=True)
            return 0

    def close(self) -> None:
        """Stops answering and removes the socket."""
        self._server.close()
