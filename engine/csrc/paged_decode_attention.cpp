// Decode attention read in place from a paged KV cache, for CPU (engine/cpu_ops.py builds it).
//
// One query token per sequence: out[b, hq] = softmax(s_t) . V[t] with s_t = scale * q[b, hq] . K[t]
// (or, given softcap > 0, Gemma 2's softcap * tanh(s_t / softcap)) over the
// sequence's keys t in [starts[b], lens[b]), where the K/V of token t live at
// kv_cache[{0,1}, block_tables[b, t / block_size], t % block_size, hq / G] (G query heads share
// a kv head). Nothing is gathered: each key row is read in place from its block, once for all
// the query heads that share its kv head (up to 3 at a time for K, 4 for V). Work items are
// (sequence, partition of `partition` keys), so a few long sequences still spread over every
// thread (with at least 4 sequences per thread, whole sequences); partitions are merged with
// their log-sum-exp (the split-K decode of FlashDecoding).
//
// A "sequence" here is one query row: a prefill over cached context passes each of its new
// tokens as a row with the same block table and its own length (causal attention).
//
// A prior result can be merged in: rows whose keys before starts[b] were attended elsewhere
// (a prefix that several rows share, once for all of them: engine/cascade_attention.py) pass
// that output and its log-sum-exp, and get the softmax over both key ranges.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "vec_math.h"
#include <limits>
#include <vector>

namespace {

// A row's prior log-sum-exp when nothing was attended before starts[b].
constexpr float kNoPrior = -std::numeric_limits<float>::infinity();

using kvtier::ivecf;
using kvtier::kLanes;
using kvtier::vecf;

// Lanes [0, kLanes / 2): the sums of a's adjacent lane pairs; the upper half: b's.
template <size_t... I>
constexpr ivecf lane_indices(int32_t first, std::index_sequence<I...>) {
  return ivecf{static_cast<int32_t>(first + 2 * I)...};
}

inline vecf pair_sums(vecf a, vecf b) {
  constexpr ivecf even = lane_indices(0, std::make_index_sequence<kLanes>{});
  constexpr ivecf odd = lane_indices(1, std::make_index_sequence<kLanes>{});
  return __builtin_shuffle(a, b, even) + __builtin_shuffle(a, b, odd);
}

// Query heads scored together against 8 keys (dots8): their 8 sums each must fit in the
// registers (24 of AVX-512's 32; AVX2 has 16).
constexpr int64_t kDotHeads = kLanes == 16 ? 3 : 1;
// Accumulator registers of add_weighted_values (half of AVX-512's; AVX2 keeps half for V rows).
constexpr int64_t kValueRegs = kLanes == 16 ? 16 : 8;

// acc[g] += sum over the n keys t of p_g[t] * V[t], for NG query heads sharing one kv head
// (D floats each), where V[t] = v + offsets[t] and p_g = scores + g * stride. The NG x D sums
// stay in registers over the keys, and each V row is loaded once for every head of the group.
template <int64_t D, int64_t NG>
inline void add_weighted_values(const float* v, const int64_t* offsets, int64_t n, const float* scores,
                                int64_t stride, float* acc) {
  constexpr int64_t C = D / kLanes;
  vecf a[NG][C];
  for (int64_t g = 0; g < NG; ++g)
    for (int64_t c = 0; c < C; ++c) a[g][c] = kvtier::loadv(acc + g * D + c * kLanes);
  for (int64_t t = 0; t < n; ++t) {
    const float* row = v + offsets[t];
    vecf vc[C];
    for (int64_t c = 0; c < C; ++c) vc[c] = kvtier::loadv(row + c * kLanes);
    for (int64_t g = 0; g < NG; ++g) {
      const vecf p = vecf{} + scores[g * stride + t];
      for (int64_t c = 0; c < C; ++c) a[g][c] += p * vc[c];
    }
  }
  for (int64_t g = 0; g < NG; ++g)
    for (int64_t c = 0; c < C; ++c) kvtier::storev(acc + g * D + c * kLanes, a[g][c]);
}

// Scores of NG query heads sharing one kv head against 8 keys: lane j (j < 8) of the result
// for head g is q_g . keys[j][offset : offset + D]. Each key chunk is loaded once for the NG
// heads; each dot's kLanes lane-wise partial sums are then summed across lanes (pair_sums).
template <int64_t D, int64_t NG>
inline void dots8(const float* q, const float* const* keys, int64_t offset, float* scores, int64_t stride) {
  vecf acc[NG][8];
  for (int64_t g = 0; g < NG; ++g)
    for (int64_t j = 0; j < 8; ++j) acc[g][j] = vecf{};
  for (int64_t c = 0; c < D; c += kLanes) {
    vecf qc[NG];
    for (int64_t g = 0; g < NG; ++g) qc[g] = kvtier::loadv(q + g * D + c);
    for (int64_t j = 0; j < 8; ++j) {
      const vecf kc = kvtier::loadv(keys[j] + offset + c);
      for (int64_t g = 0; g < NG; ++g) acc[g][j] += qc[g] * kc;
    }
  }
  for (int64_t g = 0; g < NG; ++g) {
    vecf* a = acc[g];
    for (int64_t width = 8; width > 1; width /= 2) {  // a[0]: kLanes / 8 lanes per key, in key order
      for (int64_t j = 0; j < width / 2; ++j) a[j] = pair_sums(a[2 * j], a[2 * j + 1]);
    }
    vecf sums = a[0];
    for (int64_t lanes = kLanes; lanes > 8; lanes /= 2) sums = pair_sums(sums, sums);  // lanes 0-7: the 8 dots
    std::memcpy(scores + g * stride, &sums, 8 * sizeof(float));
  }
}

// Requests into L2 the rows (row_floats each) of the keys in [from, to) whose `fetch` flag is
// set: faster when each sequence's K/V comes from memory; on rows another sequence just read
// (a shared prefix, in cache) the requests only cost, so those are not flagged
// (docs/results.md).
inline void prefetch_rows(const float* base, const int64_t* offsets, const uint8_t* fetch, int64_t from,
                          int64_t to, int64_t row_floats) {
  for (int64_t j = from; j < to; ++j) {
    if (!fetch[j]) continue;
    const float* row = base + offsets[j];
    for (int64_t f = 0; f < row_floats; f += 64 / sizeof(float)) __builtin_prefetch(row + f, 0, 1);
  }
}

template <typename scalar_t>
inline const float* as_float(const scalar_t* __restrict src, float* __restrict buf, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return src;
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(src[i]);
    return buf;
  }
}

// HEAD > 0 fixes the head size at compile time (the inner loops then unroll fully); 0 reads it
// from `head_size`.
template <typename scalar_t, int64_t HEAD>
void decode(const float* q, const scalar_t* kv, const int64_t* tables, const int64_t* starts,
            const int64_t* lens, const float* prior_out, const float* prior_lse, float* out, int64_t num_seqs,
            int64_t num_q_heads, int64_t num_kv_heads, int64_t head_size, int64_t block_size, int64_t num_blocks,
            int64_t max_blocks, float scale, float softcap, int64_t partition) {
  const int64_t H = num_q_heads, G = num_q_heads / num_kv_heads, D = HEAD > 0 ? HEAD : head_size;
  const int64_t token_stride = num_kv_heads * D;  // one token's row: every kv head, contiguous
  const int64_t block_stride = block_size * token_stride;
  const int64_t v_offset = num_blocks * block_stride;
  // Splitting sequences spreads few of them over the threads; with enough of them it only adds
  // merging, so whole sequences are faster then (docs/results.md).
  int64_t longest = 1;
  for (int64_t b = 0; b < num_seqs; ++b) longest = std::max(longest, lens[b] - starts[b]);
  if (num_seqs >= 4 * at::get_num_threads()) partition = longest;
  partition = std::min(partition, longest);
  std::vector<int64_t> first(num_seqs + 1, 0);  // first partition of each sequence
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t n = lens[b] - starts[b];
    first[b + 1] = first[b] + std::max<int64_t>(1, (n + partition - 1) / partition);
  }
  const int64_t parts = first[num_seqs];
  // Per partition and query head: max score, sum of exp, unnormalised output.
  std::vector<float> part_max(parts * H), part_sum(parts * H), part_acc(parts * H * D);

  // A work item is one partition of one sequence, all heads: its keys' rows are read in
  // order, each block's K (then V) one contiguous run of block_size * Hkv * D values.
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> score_buf(H * partition), q_buf(H * D), row_buf(token_stride);
    std::vector<int64_t> offset_buf(partition);
    std::vector<uint8_t> fetch_buf(partition);
    float* __restrict scores = score_buf.data();
    float* __restrict qs = q_buf.data();
    float* __restrict row = row_buf.data();
    for (int64_t part = begin; part < end; ++part) {
      const int64_t b = std::upper_bound(first.begin(), first.end(), part) - first.begin() - 1;
      const int64_t t0 = starts[b] + (part - first[b]) * partition;
      const int64_t n = std::min(lens[b], t0 + partition) - t0;
      const int64_t* table = tables + b * max_blocks;
      // The queries, pre-scaled: scores need one multiply less per key.
      const float* qb = q + b * H * D;
      for (int64_t i = 0; i < H * D; ++i) qs[i] = qb[i] * scale;
      // Each key's row offset in the K cache (V's is v_offset more), stepping through the
      // block table: no division per key.
      // And whether to prefetch it: not if the sequence before this one has the same block
      // there (parallel_for hands each thread a run of consecutive sequences).
      int64_t* __restrict offsets = offset_buf.data();
      uint8_t* __restrict fetch = fetch_buf.data();
      const int64_t* prev = b > 0 ? tables + (b - 1) * max_blocks : nullptr;
      const int64_t prev_len = b > 0 ? lens[b - 1] : 0;
      for (int64_t t = 0, blk = t0 / block_size, in = t0 % block_size; t < n; ++t) {
        offsets[t] = table[blk] * block_stride + in * token_stride;
        fetch[t] = !(prev != nullptr && t0 + t < prev_len && prev[blk] == table[blk]);
        if (++in == block_size) in = 0, ++blk;
      }
      int64_t t = 0;
      if constexpr (std::is_same_v<scalar_t, float> && HEAD > 0 && HEAD % kLanes == 0) {
        // 8 keys at a time, the query heads of one kv head together (up to kDotHeads).
        const float* keys[8];
        for (; t + 8 <= n; t += 8) {
          prefetch_rows(kv, offsets, fetch, t + 64, std::min(n, t + 72), token_stride);
          for (int64_t j = 0; j < 8; ++j) keys[j] = kv + offsets[t + j];
          for (int64_t hq = 0; hq < H;) {
            const int64_t step = std::min<int64_t>(kDotHeads, G - hq % G);
            const float* qh = qs + hq * D;
            float* s = scores + hq * partition + t;
            const int64_t off = (hq / G) * D;
            switch (step) {
              case 3: dots8<HEAD, 3>(qh, keys, off, s, partition); break;
              case 2: dots8<HEAD, 2>(qh, keys, off, s, partition); break;
              default: dots8<HEAD, 1>(qh, keys, off, s, partition);
            }
            hq += step;
          }
        }
      }
      for (; t < n; ++t) {
        const float* __restrict k = as_float(kv + offsets[t], row, token_stride);
        for (int64_t hq = 0; hq < H; ++hq) {
          const float* __restrict qh = qs + hq * D;
          const float* __restrict kh = k + (hq / G) * D;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < D; ++d) s += qh[d] * kh[d];
          scores[hq * partition + t] = s;
        }
      }
      float* __restrict m = part_max.data() + part * H;
      float* __restrict l = part_sum.data() + part * H;
      float* __restrict acc = part_acc.data() + part * H * D;
      for (int64_t hq = 0; hq < H; ++hq) {
        float* __restrict sh = scores + hq * partition;
        if (softcap > 0.f) {
          const float inv_cap = 1.f / softcap;
#pragma omp simd
          for (int64_t t = 0; t < n; ++t) sh[t] = softcap * kvtier::tanh_approx(sh[t] * inv_cap);
        }
        float top = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : top)
        for (int64_t t = 0; t < n; ++t) top = std::max(top, sh[t]);
        float total = 0.f;
#pragma omp simd reduction(+ : total)
        for (int64_t t = 0; t < n; ++t) {
          sh[t] = kvtier::exp_nonpositive(sh[t] - top);
          total += sh[t];
        }
        m[hq] = top;
        l[hq] = total;
      }
      if constexpr (std::is_same_v<scalar_t, float> && HEAD > 0 && HEAD % kLanes == 0) {
        // Query heads of one kv head in groups whose sums fit in kValueRegs registers, over
        // tiles of 16 keys, so the tile's V rows stay in L1 while each group reads its head's
        // part of them (one group passing over all n keys, then the next, was slower when the
        // rows came from memory).
        constexpr int64_t kGroup = std::min<int64_t>(4, std::max<int64_t>(1, kValueRegs / (HEAD / kLanes)));
        constexpr int64_t kTile = 16;
        std::fill(acc, acc + H * D, 0.f);
        for (int64_t t = 0; t < n; t += kTile) {
          const int64_t len = std::min(kTile, n - t);
          prefetch_rows(kv + v_offset, offsets, fetch, t + 64, std::min(n, t + 64 + kTile), token_stride);
          for (int64_t hq = 0; hq < H;) {
            const int64_t step = std::min(kGroup, G - hq % G);
            const float* v = kv + v_offset + (hq / G) * D;
            const float* s = scores + hq * partition + t;
            float* a = acc + hq * D;
            switch (step) {
              case 4: add_weighted_values<HEAD, 4>(v, offsets + t, len, s, partition, a); break;
              case 3: add_weighted_values<HEAD, 3>(v, offsets + t, len, s, partition, a); break;
              case 2: add_weighted_values<HEAD, 2>(v, offsets + t, len, s, partition, a); break;
              default: add_weighted_values<HEAD, 1>(v, offsets + t, len, s, partition, a);
            }
            hq += step;
          }
        }
      } else {
        std::fill(acc, acc + H * D, 0.f);
        for (int64_t t = 0; t < n; ++t) {
          const float* __restrict v = as_float(kv + v_offset + offsets[t], row, token_stride);
          for (int64_t hq = 0; hq < H; ++hq) {
            const float p = scores[hq * partition + t];
            const float* __restrict vh = v + (hq / G) * D;
            float* __restrict a = acc + hq * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] += p * vh[d];
          }
        }
      }
      if (first[b + 1] - first[b] == 1) {  // the whole sequence: normalise into out now
        for (int64_t hq = 0; hq < H; ++hq) {
          float* __restrict o = out + (b * H + hq) * D;
          const float* __restrict a = acc + hq * D;
          const float pl = prior_lse != nullptr ? prior_lse[b * H + hq] : kNoPrior;
          if (pl == kNoPrior) {
            const float inv = 1.f / l[hq];
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) o[d] = a[d] * inv;
            continue;
          }
          const float top = std::max(m[hq], pl);
          const float w = std::exp(m[hq] - top), wp = std::exp(pl - top);
          const float inv = 1.f / (l[hq] * w + wp);
          const float* __restrict po = prior_out + (b * H + hq) * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) o[d] = (a[d] * w + po[d] * wp) * inv;
        }
      }
    }
  });
  if (parts == num_seqs) return;  // no sequence was split: nothing to merge

  at::parallel_for(0, num_seqs * H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, hq = bh % H;
      if (first[b + 1] - first[b] == 1) continue;  // written by its only partition
      const float pl = prior_lse != nullptr ? prior_lse[bh] : kNoPrior;
      float top = pl;
      for (int64_t p = first[b]; p < first[b + 1]; ++p) top = std::max(top, part_max[p * H + hq]);
      float* __restrict o = out + bh * D;
      std::fill(o, o + D, 0.f);
      float total = 0.f;
      if (pl != kNoPrior) {  // the prior result as one more partition: max pl, sum 1
        const float wp = std::exp(pl - top);
        total = wp;
        const float* __restrict po = prior_out + bh * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) o[d] = wp * po[d];
      }
      for (int64_t p = first[b]; p < first[b + 1]; ++p) {
        const float w = std::exp(part_max[p * H + hq] - top);
        total += part_sum[p * H + hq] * w;
        const float* __restrict a = part_acc.data() + (p * H + hq) * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) o[d] += w * a[d];
      }
      const float inv = 1.f / total;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    }
  });
}

}  // namespace

// q [B, Hq, D] float32; kv_cache [2, num_blocks, block_size, Hkv, D] (float32, bfloat16 or
// float16); block_tables [B, max_blocks], starts [B], lens [B] int64; softcap <= 0: no cap;
// prior_out [B, Hq, D] and prior_lse [B, Hq] float32:
// a result over other keys to merge in (lse -inf where there is none), or None for both.
// Returns [B, Hq, D].
torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& kv_cache,
                                     const torch::Tensor& block_tables, const torch::Tensor& starts,
                                     const torch::Tensor& lens, double scale, int64_t partition,
                                     double softcap, const c10::optional<torch::Tensor>& prior_out,
                                     const c10::optional<torch::Tensor>& prior_lse) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat && q.is_contiguous(), "q must be contiguous float32 [B, Hq, D]");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache must be contiguous [2, num_blocks, block_size, Hkv, D]");
  TORCH_CHECK(kv_cache.size(4) == q.size(2) && q.size(1) % kv_cache.size(3) == 0, "q and kv_cache heads disagree");
  for (const auto* t : {&block_tables, &starts, &lens}) {
    TORCH_CHECK(t->scalar_type() == torch::kLong && t->is_contiguous() && t->size(0) == q.size(0),
                "block_tables, starts and lens must be contiguous int64 with one row per query");
  }
  TORCH_CHECK(partition > 0, "partition must be positive");
  TORCH_CHECK(prior_out.has_value() == prior_lse.has_value(), "prior_out and prior_lse go together");
  const float* p_out = nullptr;
  const float* p_lse = nullptr;
  if (prior_out.has_value()) {
    TORCH_CHECK(prior_out->sizes() == q.sizes() && prior_out->is_contiguous() &&
                    prior_out->scalar_type() == torch::kFloat,
                "prior_out must be contiguous float32 shaped like q");
    TORCH_CHECK(prior_lse->dim() == 2 && prior_lse->size(0) == q.size(0) && prior_lse->size(1) == q.size(1) &&
                    prior_lse->is_contiguous() && prior_lse->scalar_type() == torch::kFloat,
                "prior_lse must be contiguous float32 [B, Hq]");
    p_out = prior_out->data_ptr<float>();
    p_lse = prior_lse->data_ptr<float>();
  }
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, kv_cache.scalar_type(), "paged_decode_attention", [&] {
    auto run = [&](auto head) {
      decode<scalar_t, decltype(head)::value>(
          q.data_ptr<float>(), kv_cache.data_ptr<scalar_t>(), block_tables.data_ptr<int64_t>(),
          starts.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), p_out, p_lse, out.data_ptr<float>(), q.size(0),
          q.size(1),
          kv_cache.size(3), q.size(2), kv_cache.size(2), kv_cache.size(1), block_tables.size(1),
          static_cast<float>(scale), static_cast<float>(softcap), partition);
    };
    switch (q.size(2)) {  // the common head sizes, unrolled
      case 64: run(std::integral_constant<int64_t, 64>{}); break;
      case 128: run(std::integral_constant<int64_t, 128>{}); break;
      default: run(std::integral_constant<int64_t, 0>{});
    }
  });
  return out;
}

// paged_prefill_attention.cpp
void paged_prefill_attention(const torch::Tensor& q, const torch::Tensor& kv_cache, const torch::Tensor& block_tables,
                             const torch::Tensor& q_starts, const torch::Tensor& q_lens,
                             const torch::Tensor& ctx_lens, double scale, double softcap, torch::Tensor& out);
void paged_prefix_attention(const torch::Tensor& q, const torch::Tensor& kv_cache, const torch::Tensor& block_tables,
                            const torch::Tensor& q_starts, const torch::Tensor& q_lens,
                            const torch::Tensor& prefix_lens, double scale, double softcap, torch::Tensor& out,
                            torch::Tensor& lse);
// fused_ops.cpp
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);
torch::Tensor add_rms_norm(const torch::Tensor& x, torch::Tensor& residual, const torch::Tensor& weight,
                           double eps);
torch::Tensor silu_and_mul(const torch::Tensor& gate_up);
void rotary_(torch::Tensor& x, const torch::Tensor& positions, const torch::Tensor& cos_sin, int64_t num_heads);
// panel_linear.cpp
torch::Tensor panel_linear(const torch::Tensor& x, const torch::Tensor& panels, const c10::optional<torch::Tensor>& bias,
                           int64_t out_features);
// kv_pages.cpp
void copy_kv_pages(const std::vector<torch::Tensor>& caches, torch::Tensor& chunk, const torch::Tensor& slots,
                   bool to_pages, bool k_transposed);
void copy_amx_blocks(const std::vector<torch::Tensor>& caches, const std::vector<torch::Tensor>& rows,
                     const torch::Tensor& blocks, bool to_pages);

// Every op releases the GIL while it runs (RELEASED): it touches no Python object, and the
// connector's loads scatter on a background thread while the serving thread runs the model.
#define RELEASED py::call_guard<py::gil_scoped_release>()
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, RELEASED,
        "decode attention over a paged KV cache, in place", py::arg("q"), py::arg("kv_cache"),
        py::arg("block_tables"), py::arg("starts"), py::arg("lens"), py::arg("scale"), py::arg("partition"),
        py::arg("softcap") = 0.0, py::arg("prior_out") = py::none(), py::arg("prior_lse") = py::none());
  m.def("paged_prefill_attention", &paged_prefill_attention, RELEASED,
        "causal prefill attention over a paged KV cache, in place, into out's prefill rows", py::arg("q"),
        py::arg("kv_cache"), py::arg("block_tables"), py::arg("q_starts"), py::arg("q_lens"), py::arg("ctx_lens"),
        py::arg("scale"), py::arg("softcap"), py::arg("out"));
  m.def("paged_prefix_attention", &paged_prefix_attention, RELEASED,
        "attention of groups of rows over a prefix of keys they share, with each row's log-sum-exp", py::arg("q"),
        py::arg("kv_cache"), py::arg("block_tables"), py::arg("q_starts"), py::arg("q_lens"), py::arg("prefix_lens"),
        py::arg("scale"), py::arg("softcap"), py::arg("out"), py::arg("lse"));
  m.def("rms_norm", &rms_norm, RELEASED, "weight * x / sqrt(mean(x^2) + eps) per row");
  m.def("add_rms_norm", &add_rms_norm, RELEASED, "residual += x in place; returns rms_norm(residual)");
  m.def("silu_and_mul", &silu_and_mul, RELEASED, "silu(gate) * up of [gate | up] rows");
  m.def("rotary_", &rotary_, RELEASED, "rotates the first num_heads heads of each row in place (neox layout)");
  m.def("panel_linear", &panel_linear, RELEASED, "x @ W.T + bias over W packed in panels of 16 output columns",
        py::arg("x"), py::arg("panels"), py::arg("bias"), py::arg("out_features"));
  m.def("copy_kv_pages", &copy_kv_pages, RELEASED, "moves slots' K/V between a chunk and vLLM CPU attention pages",
        py::arg("caches"), py::arg("chunk"), py::arg("slots"), py::arg("to_pages"), py::arg("k_transposed") = true);
  m.def("copy_amx_blocks", &copy_amx_blocks, RELEASED, "moves whole blocks' K/V between chunk rows and vLLM amx pages",
        py::arg("caches"), py::arg("rows"), py::arg("blocks"), py::arg("to_pages"));
}
