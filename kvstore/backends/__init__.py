"""Storage tiers. Each module holds one backend (the disk tier: the package disk/, one owner per
piece of its state); `kvstore.registry` builds them by URL scheme."""
