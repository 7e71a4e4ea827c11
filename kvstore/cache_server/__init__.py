"""The standalone cache server (`kvtier cache-server`): its own package, so it runs where torch
is not installed (tests/test_import_rules.py). It never decodes the values it stores; its client
is the `kvtier://` tier's (kvstore/backends/server_client.py), which checks them as they arrive.
"""
