"""kvstore: chunk keys, codecs, storage tiers, the storage manager and the cache server.

Imports only torch/numpy/redis/lz4 and the standard library; never `engine` or `connector`.
"""
