"""Storage tiers. Each module holds one backend; `kvstore.registry` builds them by URL scheme."""
