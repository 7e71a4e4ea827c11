"""The keyspace: chained, deterministic across processes and PYTHONHASHSEED, complete identity,
and byte-identical to the keys earlier releases stored (so stored caches stay valid)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from harness import process
from kvkeys.chain import chain_hash
from kvkeys.keyspace import LAYOUT_VERSION, ROOT_HASH, Keyspace, chunk_key, head_key, layer_key
from kvkeys.stored_keys import key_family_label

REPO = Path(__file__).resolve().parents[2]
TOKENS = list(range(1000, 1700)) + [49151, 0, 7]

_SCRIPT = """
import json
from kvkeys.keyspace import Keyspace
tokens = list(range(1000, 1700)) + [49151, 0, 7]
print(json.dumps([[s.start, s.end, s.key] for s in Keyspace("m0", "float16", 256, 30).spans(tokens)]))
"""


def test_keys_are_pinned_to_what_earlier_releases_stored() -> None:
    ks = Keyspace("m0", "float16", 256, num_layers=30)
    assert [sp.key for sp in ks.spans(TOKENS)] == [
        "kvtier:m0:float16:v1:c256:59a4b1c5c30abd0313bb74f70393df25",
        "kvtier:m0:float16:v1:c256:cbfa61ba06846b1ade5dff26659d8e5c",
        "kvtier:m0:float16:v1:c256:c037d5becb86c2ad56611bad8071d504",
    ]
    first = ks.spans(TOKENS)[0]
    partial = ks.partial_spans(TOKENS[256:300], 256, first.chain)[9]
    assert (partial.start, partial.end) == (256, 266)
    assert partial.key == "kvtier:m0:float16:v1:c256:9b571d885dd5455fd211686a90f9ee8e"


def test_keys_identical_across_pythonhashseed() -> None:
    outs = []
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(REPO)}
        res = process.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, check=True,
                          timeout=120)
        outs.append(json.loads(res.stdout))
    assert outs[0] == outs[1]
    assert [(s, e) for s, e, _ in outs[0]] == [(0, 256), (256, 512), (512, 703)]
    here = [[sp.start, sp.end, sp.key] for sp in Keyspace("m0", "float16", 256, 30).spans(TOKENS)]
    assert here == outs[0]


def test_chained_over_prefix() -> None:
    ks = Keyspace("", "", 256, num_layers=1)
    a = list(range(600))
    b = a.copy()
    b[10] = 99999  # change in the first chunk changes every later key
    ka, kb = ks.spans(a), ks.spans(b)
    assert all(x.key != y.key for x, y in zip(ka, kb))
    c = a.copy()
    c[300] = 5  # change in the second chunk leaves the first key alone
    kc = ks.spans(c)
    assert kc[0].key == ka[0].key and kc[1].key != ka[1].key and kc[2].key != ka[2].key
    assert ka[1].chain == chain_hash(ka[0].chain, a[256:512]) and ka[1].key == ks.key(ka[1].chain)


def test_token_container_types_agree() -> None:
    ks = Keyspace("", "", 128, num_layers=1)
    toks = list(range(300))
    want = ks.spans(toks)
    for form in (np.array(toks, dtype=np.int32), np.array(toks, dtype=np.int64), torch.tensor(toks)):
        assert ks.spans(form) == want


def test_partial_chunk_optional_and_parent_hash() -> None:
    ks = Keyspace("", "", 256, num_layers=1)
    toks = list(range(300))
    assert [(sp.start, sp.end) for sp in ks.spans(toks)] == [(0, 256), (256, 300)]
    assert [(sp.start, sp.end) for sp in ks.spans(toks, unfull=False)] == [(0, 256)]
    seg = list(range(500, 520))
    assert ks.spans(seg, parent=ROOT_HASH)[0] == ks.spans(seg)[0]
    assert ks.spans(seg, parent=chain_hash(ROOT_HASH, [1, 2, 3]))[0].key != ks.spans(seg)[0].key


def test_partial_spans_are_the_spans_of_every_shorter_partial_chunk() -> None:
    ks = Keyspace("m", "float16", 64, num_layers=1)
    toks = list(range(1000, 1100))
    parent = ks.spans(toks[:64])[0].chain
    probe = ks.partial_spans(toks[64:], 64, parent)
    assert len(probe) == 35  # tokens[64:64+m] for m = 1..35 (m = 36 is the chunk itself)
    for m in (1, 17, 35):
        assert probe[m - 1] == ks.spans(toks[:64 + m])[-1]
    assert ks.partial_spans([5], 0, ROOT_HASH) == []


def test_key_names_everything_that_makes_kv_incompatible() -> None:
    toks = list(range(256))
    base = Keyspace("a", torch.float16, 256, num_layers=2).spans(toks)[0]
    assert ":float16:" in base.key
    variants = [
        Keyspace("b", torch.float16, 256, num_layers=2).spans(toks)[0].key,
        Keyspace("a", torch.bfloat16, 256, num_layers=2).spans(toks)[0].key,
        chunk_key("a", "float16", 256, base.chain, layout_version=LAYOUT_VERSION + 1),
        Keyspace("a", torch.float16, 128, num_layers=2).spans(toks)[0].key,
    ]
    assert all(v != base.key for v in variants)


def test_layerwise_values_are_one_per_layer_in_chunk_order() -> None:
    spans = Keyspace("m", "float32", 4, num_layers=3).spans(list(range(8)))
    whole = Keyspace("m", "float32", 4, num_layers=3)
    layered = Keyspace("m", "float32", 4, num_layers=3, layerwise=True)
    assert whole.stored_keys(spans) == [sp.key for sp in spans] and whole.values_per_chunk == 1
    assert layered.stored_keys(spans) == [layer_key(sp.key, i) for sp in spans for i in range(3)]
    assert layered.probe_keys(spans) == [layer_key(sp.key, 2) for sp in spans]
    assert layered.chunks_held([True, True, True, True, False, True]) == [True, False]


def test_bad_input_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="chunk_size"):
        Keyspace("m", "float16", 0, num_layers=1)
    ks = Keyspace("m", "float16", 256, num_layers=1)
    with pytest.raises(ValueError, match="integers"):
        ks.spans(np.array([1.5, 2.0]))
    with pytest.raises(ValueError, match="one-dimensional"):
        ks.spans(np.zeros((2, 2), dtype=np.int64))
    with pytest.raises(ValueError, match="model"):
        Keyspace("org/name:rev", "float16", 256, num_layers=1)


def test_a_keys_family_label_is_everything_but_its_tenant_and_hash() -> None:
    ks = Keyspace("m-1+vllm-cpu", torch.bfloat16, 256, num_layers=2)
    key = ks.spans(list(range(256)))[0].key
    label = f"m-1+vllm-cpu:bfloat16:v{LAYOUT_VERSION}:c256"
    salted = ks.for_salt("tenant-a").spans(list(range(256)))[0].key
    assert [key_family_label(k) for k in (key, layer_key(key, 1), head_key(key, 3), salted)] == [label] * 4
    assert key_family_label("kvtier:index:families") is None and key_family_label("other:m:f:v1:c2:ab") is None
