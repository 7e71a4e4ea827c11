"""`kvtier router`: an OpenAI-compatible front that sends each request to one of several
`kvtier serve` backends (KV-aware, prefix-hash or round-robin), or through a prefill
backend then a decode backend (disaggregated prefill over a shared KV tier)."""

POLICIES = ("kv-aware", "prefix-hash", "round-robin")  # here, import-free, for the CLI's choices
