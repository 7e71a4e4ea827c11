"""The standalone cache server (`kvtier cache-server`) and its byte-level client.

Stdlib only: the server never imports torch and never decodes the values it stores.
"""
