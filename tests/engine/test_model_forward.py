"""Our paged Llama-family model against transformers (same weights) as the oracle."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine.attention_metadata import AttentionMetadata
from engine.model_loader import load_model
from engine.paged_attention import build_plan
from engine.rotary import apply_rotary, build_cos_sin_cache, compute_inv_freq, rerotate
from harness.model import make_tiny_checkpoint
from harness.paged import BLOCK, PagedDriver, hf_logits, load_tiny_pair

pytestmark = pytest.mark.slow  # the real default model against transformers


def _prompt_ids(path: Path, n: int, seed: int = 0) -> list[int]:
    """A real-text prompt of exactly `n` tokens (tokenised English, repeated as needed)."""
    from engine.model_loader import load_tokenizer
    text = ("The paged KV cache stores keys and values in fixed-size blocks; a block table "
            "maps each sequence's logical blocks to physical ones, so memory is shared and "
            "reused. Prefix caching lets requests with a common system prompt skip work. ")
    ids = load_tokenizer(path).encode(text)
    rng = random.Random(seed)
    out: list[int] = []
    while len(out) < n:
        out.extend(ids[rng.randrange(len(ids)):])
    return out[:n]


# ---------------------------------------------------------------- default model (real weights)

@pytest.mark.parametrize("n", [1, 7, 130, 1100])
def test_prefill_logits_match_transformers(default_model, hf_default_model,
                                           default_model_path: Path, n: int) -> None:
    model, _ = default_model
    ids = _prompt_ids(default_model_path, n, seed=n)
    ours = PagedDriver(model, num_blocks=160).step([(0, ids)])[0]
    torch.testing.assert_close(ours, hf_logits(hf_default_model, ids), atol=1e-3, rtol=0)


# (prompt length, first step's length): the second step attends over cached context through
# an explicit mask (few new tokens) or through front-padded queries (1k+ new, short context).
@pytest.mark.parametrize("n,cut", [(300, 117), (1300, 150)])
def test_two_step_prefill_equals_one_step(default_model, default_model_path: Path,
                                          n: int, cut: int) -> None:
    model, _ = default_model
    ids = _prompt_ids(default_model_path, n, seed=3)
    whole = PagedDriver(model, seed=1, num_blocks=100).step([(0, ids)])[0]
    split = PagedDriver(model, seed=2, num_blocks=100)  # different shuffled block ids
    first = split.step([(0, ids[:cut])])[0]  # not block aligned
    second = split.step([(0, ids[cut:])])[0]
    # Float rounding only: oneDNN's GEMMs block a 1300-row step and 150 + 1150-row steps
    # differently (measured: 1.1e-4 on logits up to ~30; 5.9e-5 on PyTorch's own ops).
    torch.testing.assert_close(torch.cat([first, second]), whole, atol=1e-4, rtol=1e-5)
    meta = AttentionMetadata(slot_mapping=torch.zeros(n - cut, dtype=torch.long),
                             block_tables=torch.zeros(1, 100, dtype=torch.long),
                             query_start_loc=[0, n - cut], seq_lens=[n], block_size=16)
    padded = build_plan(meta, torch.device("cpu")).prefills[0].pad
    assert padded == (cut if n - cut >= 1024 else 0)  # both attention paths are exercised


def test_batched_decode_equals_per_sequence(default_model, default_model_path: Path) -> None:
    model, _ = default_model
    prompts = [_prompt_ids(default_model_path, n, seed=n) for n in (5, 16, 41, 97)]
    steps = 4
    # Reference: each sequence alone, prefill then decode its own greedy tokens.
    alone = []
    for i, p in enumerate(prompts):
        d = PagedDriver(model, seed=10 + i)
        logits = [d.step([(0, p)])[0][-1]]
        for _ in range(steps):
            logits.append(d.step([(0, [int(logits[-1].argmax())])])[0][-1])
        alone.append(torch.stack(logits))
    # Batched: all prefills in one step, then every decode step for all sequences at once.
    d = PagedDriver(model, seed=99)
    batched = [[lg[-1]] for lg in d.step(list(enumerate(prompts)))]
    for _ in range(steps):
        out = d.step([(i, [int(b[-1].argmax())]) for i, b in enumerate(batched)])
        for b, lg in zip(batched, out):
            b.append(lg[-1])
    for ref, got in zip(alone, batched):
        torch.testing.assert_close(torch.stack(got), ref, atol=1e-4, rtol=0)


def test_mixed_batch_fresh_cached_and_decode(default_model, default_model_path: Path) -> None:
    """One step holding a fresh prefill, a prefill with cached context and two decodes, in
    scrambled order, equals running each alone."""
    model, _ = default_model
    a, b, c, e = (_prompt_ids(default_model_path, n, seed=n) for n in (50, 70, 33, 20))
    mixed = PagedDriver(model, seed=5)
    mixed.step([(1, b[:40]), (2, c), (3, e)])
    out = mixed.step([(2, [7]), (0, a), (3, [9]), (1, b[40:])])
    refs = []
    for sid, first, rest in ((2, c, [7]), (0, a[:0], a), (3, e, [9]), (1, b[:40], b[40:])):
        d = PagedDriver(model, seed=sid + 20)
        if first:
            d.step([(0, first)])
        refs.append(d.step([(0, rest)])[0])
    for got, ref in zip(out, refs):
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("last_of", [[0, 1, 3], [2], []])
def test_last_rows_only_equal_the_full_step(default_model, default_model_path: Path, last_of: list[int]) -> None:
    """`last_of` (the runner's sampling rows): those sequences' last-row logits are the full
    step's, and every row's K/V is written as the full step writes it, in every layer."""
    model, _ = default_model
    a, b, c, e = (_prompt_ids(default_model_path, n, seed=n) for n in (50, 70, 33, 20))
    full, pruned = PagedDriver(model, seed=5), PagedDriver(model, seed=5)  # the same block ids
    for d in (full, pruned):
        d.step([(1, b[:40]), (2, c), (3, e)])
    batch = [(2, [7]), (0, a), (3, [9]), (1, b[40:])]
    want = full.step(batch)
    got = pruned.step(batch, last_of=last_of)
    assert len(got) == len(last_of)
    for i, row in zip(last_of, got):
        torch.testing.assert_close(row[0], want[i][-1], atol=1e-4, rtol=0)
    for kv_full, kv_pruned in zip(full.kv_caches, pruned.kv_caches):
        torch.testing.assert_close(kv_pruned, kv_full, atol=0, rtol=0, equal_nan=True)


def test_greedy_chat_matches_generate(default_model, hf_default_model,
                                      default_model_path: Path) -> None:
    from engine.model_loader import load_tokenizer
    model, cfg = default_model
    tok = load_tokenizer(default_model_path)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Name three primary colours."}],
                                     add_generation_prompt=True, tokenize=False)
    ids = tok.encode(prompt)
    with torch.inference_mode():
        ref = hf_default_model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=24,
                                        pad_token_id=cfg.eos_token_ids[0])[0, len(ids):].tolist()
    ref = ref[:ref.index(cfg.eos_token_ids[0]) + 1] if cfg.eos_token_ids[0] in ref else ref
    got = PagedDriver(model).greedy(0, ids, len(ref))
    assert got == ref and len(ref) > 3


def test_bfloat16_matches_transformers_bfloat16(default_model_path: Path) -> None:
    from transformers import AutoModelForCausalLM
    ours, _ = load_model(default_model_path, torch.device("cpu"), torch.bfloat16)
    assert ours.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
    hf = AutoModelForCausalLM.from_pretrained(str(default_model_path), dtype=torch.bfloat16).eval()
    ids = _prompt_ids(default_model_path, 150, seed=4)
    d = PagedDriver(ours)
    got = d.step([(0, ids)])[0]
    assert d.kv_caches[0].dtype == torch.bfloat16 and got.dtype == torch.float32
    ref = hf_logits(hf, ids)
    # Same op order as transformers in bf16; allow a few bf16 ulps at logit scale.
    torch.testing.assert_close(got, ref, atol=0.1, rtol=0)
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.97


class RecordingConnector:
    """A real (minimal) worker-side connector that records the hook calls it receives."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self.saved_ok: list[bool] = []

    def wait_for_layer_load(self, layer_idx: int) -> None:
        self.calls.append(("wait", layer_idx))

    def save_kv_layer(self, layer_idx: int, kv_cache: torch.Tensor, attn_metadata) -> None:
        self.calls.append(("save", layer_idx))
        # The step's new K/V must already be in the cache when it is handed over.
        flat = kv_cache.view(2, -1, *kv_cache.shape[-2:])
        self.saved_ok.append(bool(flat[:, attn_metadata.slot_mapping].isfinite().all()))


def test_connector_hooks_order_and_content(default_model, default_model_path: Path) -> None:
    model, cfg = default_model
    d = PagedDriver(model)
    conn = RecordingConnector()
    ids = _prompt_ids(default_model_path, 20)
    with_conn = d.step([(0, ids)], connector=conn)[0]
    expected = [(kind, i) for i in range(cfg.num_layers) for kind in ("wait", "save")]
    assert conn.calls == expected and all(conn.saved_ok)
    torch.testing.assert_close(with_conn, PagedDriver(model).step([(0, ids)])[0])


def test_inconsistent_metadata_is_value_error(default_model) -> None:
    model, cfg = default_model
    kv = [torch.zeros(2, 4, BLOCK, cfg.num_kv_heads, cfg.head_size) for _ in range(cfg.num_layers)]
    meta = AttentionMetadata(slot_mapping=torch.arange(3), block_tables=torch.zeros(1, 1, dtype=torch.long),
                             query_start_loc=[0, 3], seq_lens=[2], block_size=BLOCK)
    with pytest.raises(ValueError, match="inconsistent"):
        model(torch.tensor([1, 2, 3]), torch.arange(3), kv, meta)
    with pytest.raises(ValueError, match="kv caches"):
        model(torch.tensor([1, 2, 3]), torch.arange(3), kv[:2], meta)
    short_table = AttentionMetadata(slot_mapping=torch.arange(20), block_tables=torch.zeros(1, 1, dtype=torch.long),
                                    query_start_loc=[0, 20], seq_lens=[20], block_size=BLOCK)
    with pytest.raises(ValueError, match="block_tables"):
        model(torch.arange(20), torch.arange(20), kv, short_table)
    ok = AttentionMetadata(slot_mapping=torch.arange(3), block_tables=torch.zeros(1, 1, dtype=torch.long),
                           query_start_loc=[0, 3], seq_lens=[3], block_size=BLOCK)
    with pytest.raises(ValueError, match="positions"):
        model(torch.tensor([1, 2, 3]), torch.arange(2), kv, ok)
    with pytest.raises(ValueError, match="slot_mapping"):
        model(torch.tensor([1, 2]), torch.arange(2), kv,
              AttentionMetadata(slot_mapping=torch.arange(3), block_tables=ok.block_tables,
                                query_start_loc=[0, 2], seq_lens=[2], block_size=BLOCK))
    assert all(bool((c == 0).all()) for c in kv)  # rejected before anything was written


# ---------------------------------------------------------------- tiny random architectures

TINY_VARIANTS = {
    "qwen2": dict(model_type="qwen2"),  # qkv bias, o_proj without bias
    "mistral": dict(model_type="mistral", sliding_window=None),
    "llama-untied": dict(model_type="llama", tie_word_embeddings=False, attention_bias=True,
                         mlp_bias=True, head_dim=24,
                         rope_parameters={"rope_type": "llama3", "rope_theta": 5e5,
                                          "factor": 4.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 64}),
}


@pytest.fixture(scope="module", params=sorted(TINY_VARIANTS))
def tiny_pair(request, tmp_path_factory, default_model_path: Path):
    ours, hf, cfg, _ckpt = load_tiny_pair(tmp_path_factory.mktemp(request.param), default_model_path,
                                          **TINY_VARIANTS[request.param])
    return ours, hf, cfg


def test_tiny_logits_match_transformers(tiny_pair) -> None:
    ours, hf, cfg = tiny_pair
    if cfg.model_type == "qwen2":
        assert cfg.attention_bias and ours.model.layers[0].self_attn.qkv_proj.bias is not None
    ids = random.Random(0).choices(range(cfg.vocab_size), k=300)
    got = PagedDriver(ours).step([(0, ids)])[0]
    torch.testing.assert_close(got, hf_logits(hf, ids), atol=1e-4, rtol=0)


def test_tiny_greedy_decode_matches_generate(tiny_pair) -> None:
    ours, hf, cfg = tiny_pair
    prompt = random.Random(1).choices(range(cfg.vocab_size), k=23)
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          do_sample=False, max_new_tokens=20, min_new_tokens=20,
                          pad_token_id=0)[0, len(prompt):].tolist()
    assert PagedDriver(ours).greedy(0, prompt, 20) == ref


def test_sharded_checkpoint_loads_like_single_file(tmp_path: Path,
                                                   default_model_path: Path) -> None:
    from transformers import AutoModelForCausalLM
    ckpt = make_tiny_checkpoint(tmp_path, "mistral", tokenizer_dir=default_model_path,
                                sliding_window=None)
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(str(ckpt)).save_pretrained(sharded, max_shard_size="2MB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    a, _ = load_model(ckpt, torch.device("cpu"), torch.float32)
    b, _ = load_model(sharded, torch.device("cpu"), torch.float32)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb)


def test_incomplete_or_misshapen_checkpoint_is_value_error(tmp_path: Path,
                                                          default_model_path: Path) -> None:
    from safetensors.torch import load_file, save_file
    ckpt = make_tiny_checkpoint(tmp_path, "qwen2", tokenizer_dir=default_model_path)
    f = ckpt / "model.safetensors"
    tensors = load_file(f)
    save_file({k: v for k, v in tensors.items() if k != "model.layers.1.self_attn.k_proj.bias"}, f)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.qkv_proj\.bias"):
        load_model(ckpt, torch.device("cpu"), torch.float32)
    save_file({**tensors, "model.layers.0.mlp.up_proj.weight": torch.zeros(3, 3)}, f)
    with pytest.raises(ValueError, match="up_proj.weight.*shape"):
        load_model(ckpt, torch.device("cpu"), torch.float32)


# ---------------------------------------------------------------- rotary

def test_rerotate_moves_keys_between_positions() -> None:
    inv = compute_inv_freq(64, 1e5)
    cache = build_cos_sin_cache(inv, 4096, torch.float32, "cpu")
    g = torch.Generator().manual_seed(0)
    k = torch.randn(50, 3, 64, generator=g)
    old = torch.randint(0, 2000, (50,), generator=g)
    new = torch.randint(0, 4000, (50,), generator=g)  # both directions
    moved = rerotate(apply_rotary(k, old, cache), old, new, inv)
    # float32 angles near position 4000 carry ~5e-4 rad of rounding either way.
    torch.testing.assert_close(moved, apply_rotary(k, new, cache), atol=2e-3, rtol=0)
    assert not torch.allclose(moved, apply_rotary(k, old, cache), atol=1e-1)
