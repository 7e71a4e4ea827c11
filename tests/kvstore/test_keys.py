"""Chunk keys: chained, deterministic across processes and PYTHONHASHSEED, complete identity."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstore.keys import ROOT_HASH, ChunkKey, chain_hash, model_fingerprint, partial_chunk_keys, process_tokens

REPO = Path(__file__).resolve().parents[2]

_SCRIPT = """
import json, sys
from kvstore.keys import process_tokens
tokens = list(range(1000, 1700)) + [49151, 0, 7]
print(json.dumps([[s, e, k.to_str()] for s, e, k in process_tokens(tokens, 256, model="m0", kv_dtype="float16")]))
"""


def test_keys_identical_across_pythonhashseed() -> None:
    outs = []
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(REPO)}
        res = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, check=True)
        outs.append(json.loads(res.stdout))
    assert outs[0] == outs[1]
    assert [(s, e) for s, e, _ in outs[0]] == [(0, 256), (256, 512), (512, 703)]
    # and identical to this process
    here = [[s, e, k.to_str()] for s, e, k in
            process_tokens(list(range(1000, 1700)) + [49151, 0, 7], 256, model="m0", kv_dtype="float16")]
    assert here == outs[0]


def test_chained_over_prefix() -> None:
    a = list(range(600))
    b = a.copy()
    b[10] = 99999  # change in the first chunk changes every later key
    ka = [k for _, _, k in process_tokens(a, 256)]
    kb = [k for _, _, k in process_tokens(b, 256)]
    assert all(x != y for x, y in zip(ka, kb))
    c = a.copy()
    c[300] = 5  # change in the second chunk leaves the first key alone
    kc = [k for _, _, k in process_tokens(c, 256)]
    assert kc[0] == ka[0] and kc[1] != ka[1] and kc[2] != ka[2]
    assert ka[1].chunk_hash == chain_hash(ka[0].chunk_hash, a[256:512])


def test_token_container_types_agree() -> None:
    toks = list(range(300))
    want = [k for _, _, k in process_tokens(toks, 128)]
    for form in (np.array(toks, dtype=np.int32), np.array(toks, dtype=np.int64), torch.tensor(toks)):
        assert [k for _, _, k in process_tokens(form, 128)] == want


def test_partial_chunk_optional_and_parent_hash() -> None:
    toks = list(range(300))
    assert [(s, e) for s, e, _ in process_tokens(toks, 256)] == [(0, 256), (256, 300)]
    assert [(s, e) for s, e, _ in process_tokens(toks, 256, save_unfull_chunk=False)] == [(0, 256)]
    # a segment keyed without its prefix (CacheBlend) gets the same key wherever it appears
    seg = list(range(500, 520))
    k1 = next(process_tokens(seg, 256, parent_hash=ROOT_HASH))[2]
    k2 = next(process_tokens(seg, 256))[2]
    assert k1 == k2
    other_parent = chain_hash(ROOT_HASH, [1, 2, 3])
    assert next(process_tokens(seg, 256, parent_hash=other_parent))[2] != k1


def test_partial_chunk_keys_are_the_keys_of_every_shorter_partial_chunk() -> None:
    toks = list(range(1000, 1100))
    parent = next(process_tokens(toks[:64], 64, model="m", kv_dtype="float16"))[2].chunk_hash
    probe = partial_chunk_keys(toks[64:], 64, parent_hash=parent, model="m", kv_dtype="float16")
    assert len(probe) == 35  # tokens[64:64+m] for m = 1..35 (m = 36 is the chunk itself)
    for m in (1, 17, 35):
        assert probe[m - 1] == list(process_tokens(toks[:64 + m], 64, model="m", kv_dtype="float16"))[-1][2]
    assert partial_chunk_keys([5], 64, parent_hash=ROOT_HASH) == []


def test_key_names_everything_that_makes_kv_incompatible() -> None:
    toks = list(range(256))
    base = next(process_tokens(toks, 256, model="a", kv_dtype=torch.float16))[2]
    assert base.kv_dtype == "float16"
    variants = [
        next(process_tokens(toks, 256, model="b", kv_dtype=torch.float16))[2],
        next(process_tokens(toks, 256, model="a", kv_dtype=torch.bfloat16))[2],
        next(process_tokens(toks, 256, model="a", kv_dtype=torch.float16, layout_version=2))[2],
        next(process_tokens(toks, 128, model="a", kv_dtype=torch.float16))[2],
    ]
    assert all(v.to_str() != base.to_str() for v in variants)
    assert ChunkKey.from_str(base.to_str()) == base
    fp1 = model_fingerprint({"hidden_size": 576, "num_hidden_layers": 30}, "w1")
    assert fp1 == model_fingerprint({"num_hidden_layers": 30, "hidden_size": 576}, "w1")
    assert fp1 != model_fingerprint({"hidden_size": 576, "num_hidden_layers": 30}, "w2")


def test_bad_input_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="chunk_size"):
        list(process_tokens([1, 2], 0))
    with pytest.raises(ValueError, match="integers"):
        list(process_tokens(np.array([1.5, 2.0]), 256))
    with pytest.raises(ValueError, match="one-dimensional"):
        list(process_tokens(np.zeros((2, 2), dtype=np.int64), 256))
    with pytest.raises(ValueError, match="not a kvtier chunk key"):
        ChunkKey.from_str("nope")
    with pytest.raises(ValueError, match="model"):
        list(process_tokens([1], 256, model="org/name:rev"))
