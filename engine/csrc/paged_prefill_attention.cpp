// Causal prefill attention read in place from a paged KV cache, for CPU (engine/cpu_ops.py
// builds it): FlashAttention's online softmax over key tiles, with register-tiled products.
//
// Prefill s has q_lens[s] new tokens (rows q_starts[s]... of q) at positions ctx_lens[s]...;
// the token at position p attends over keys 0..p of its sequence, whose K/V (its own included)
// are already in kv_cache's blocks named by block_tables[s]. A work item is one query tile
// (kTq positions) of one kv head: its rows are the tile's positions times the G query heads
// sharing that kv head, so each key is read once for all of them (GQA without expanding K/V).
//
// Shared prefixes (`paged_prefix_attention`, engine/cascade_attention.py): the same tiles, not
// causal: every query row of group s (one decode row per sequence of a group whose block
// tables begin alike) attends the group's first prefix_lens[s] keys, read once for the
// group's rows instead of once per sequence; the output comes with its log-sum-exp, which the
// decode kernel merges with each row's own keys.
//
// Layout: the tile's queries are kept transposed, qt[d][row], and its scores too,
// st[key][row]. Scores are then key rows times qt (each key element broadcast against 16 rows
// at a time), and the softmax runs down columns with no horizontal sums: faster than PyTorch's
// flash SDPA with AVX-512, slower on an AVX2-only host (benchmarks/bench_kernels.py).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "vec_math.h"

namespace {

using kvtier::kLanes;
using kvtier::loadv;
using kvtier::storev;
using kvtier::vecf;

constexpr int64_t kTq = 32;  // query positions per work item
constexpr int64_t kTk = 32;  // keys per tile
// Scores of 8 keys x 3 row vectors (24 sums in registers) per step: faster than 4 x 4, whose
// queries the key rows re-read from L2 twice as often (docs/results.md). AVX2's
// 16 registers hold 4 x 3.
constexpr int64_t kKeyStep = kLanes == 16 ? 8 : 4;
constexpr int64_t kRowVecs = 3;
// The V product's vectors of columns per row (4 rows at a time): 16 sums, or AVX2's 8.
constexpr int64_t kValueVecs = kLanes == 16 ? 4 : 2;

// st[j][16 v + i] = sum over d < D of keys[j][d] * qt[d][16 v + i], for NJ keys and NV vectors
// of 16 rows; qt and st have row stride `rpad`.
template <int64_t NJ, int64_t NV>
inline void tile_scores(const float* const* keys, const float* qt, int64_t D, int64_t rpad, float* st) {
  vecf acc[NJ][NV];
  for (int64_t j = 0; j < NJ; ++j)
    for (int64_t v = 0; v < NV; ++v) acc[j][v] = vecf{};
  for (int64_t d = 0; d < D; ++d) {
    vecf qv[NV];
    for (int64_t v = 0; v < NV; ++v) qv[v] = loadv(qt + d * rpad + v * kLanes);
    for (int64_t j = 0; j < NJ; ++j) {
      const vecf k = vecf{} + keys[j][d];
      for (int64_t v = 0; v < NV; ++v) acc[j][v] += k * qv[v];
    }
  }
  for (int64_t j = 0; j < NJ; ++j)
    for (int64_t v = 0; v < NV; ++v) storev(st + j * rpad + v * kLanes, acc[j][v]);
}

// For NR rows r and C vectors of columns from `col`: o[r][:] = o[r][:] * alpha[r]
// + sum over keys j < n of pt[j][r] * vals[j][:] (pt with row stride `rpad`, o with `D`).
template <int64_t C, int64_t NR>
inline void add_values(const float* const* vals, int64_t n, int64_t col, const float* pt, int64_t rpad,
                       const float* alpha, float* o, int64_t D) {
  vecf acc[NR][C];
  for (int64_t r = 0; r < NR; ++r) {
    const vecf a = vecf{} + alpha[r];
    for (int64_t c = 0; c < C; ++c) acc[r][c] = loadv(o + r * D + col + c * kLanes) * a;
  }
  for (int64_t j = 0; j < n; ++j) {
    vecf vv[C];
    for (int64_t c = 0; c < C; ++c) vv[c] = loadv(vals[j] + col + c * kLanes);
    for (int64_t r = 0; r < NR; ++r) {
      const vecf p = vecf{} + pt[j * rpad + r];
      for (int64_t c = 0; c < C; ++c) acc[r][c] += p * vv[c];
    }
  }
  for (int64_t r = 0; r < NR; ++r)
    for (int64_t c = 0; c < C; ++c) storev(o + r * D + col + c * kLanes, acc[r][c]);
}

// The V product for `rows` rows: 4 rows x kValueVecs vectors of columns at a time, then what
// is left of the columns (fewer vectors, then single lanes).
inline void tile_values(const float* const* vals, int64_t n, const float* pt, int64_t rpad, const float* alpha,
                        float* o, int64_t rows, int64_t D) {
  constexpr int64_t NR = 4;
  int64_t col = 0;
  for (; col + kLanes <= D;) {
    const int64_t c = std::min<int64_t>(kValueVecs, (D - col) / kLanes);
    int64_t r = 0;
    for (; r + NR <= rows; r += NR) {
      switch (c) {
        case 4: add_values<4, NR>(vals, n, col, pt + r, rpad, alpha + r, o + r * D, D); break;
        case 3: add_values<3, NR>(vals, n, col, pt + r, rpad, alpha + r, o + r * D, D); break;
        case 2: add_values<2, NR>(vals, n, col, pt + r, rpad, alpha + r, o + r * D, D); break;
        default: add_values<1, NR>(vals, n, col, pt + r, rpad, alpha + r, o + r * D, D);
      }
    }
    for (; r < rows; ++r) {
      switch (c) {
        case 4: add_values<4, 1>(vals, n, col, pt + r, rpad, alpha + r, o + r * D, D); break;
        case 3: add_values<3, 1>(vals, n, col, pt + r, rpad, alpha + r, o + r * D, D); break;
        case 2: add_values<2, 1>(vals, n, col, pt + r, rpad, alpha + r, o + r * D, D); break;
        default: add_values<1, 1>(vals, n, col, pt + r, rpad, alpha + r, o + r * D, D);
      }
    }
    col += c * kLanes;
  }
  if (col == D) return;
  for (int64_t r = 0; r < rows; ++r) {  // head sizes off a multiple of kLanes: the last lanes
    float* orow = o + r * D;
    for (int64_t d = col; d < D; ++d) orow[d] *= alpha[r];
    for (int64_t j = 0; j < n; ++j) {
      const float p = pt[j * rpad + r];
      for (int64_t d = col; d < D; ++d) orow[d] += p * vals[j][d];
    }
  }
}

struct Shape {
  int64_t num_q_heads, num_kv_heads, head_size, block_size, num_blocks, max_blocks, q_row_stride, q_rows;
};

// causal: the prefill's rows are positions ctx_lens[s]... (see the top); else every row sees
// keys [0, ctx_lens[s]), in `splits` key ranges attended by separate work items and merged by
// their log-sum-exp (few rows still spread over every thread). lse: when given, each row's
// log-sum-exp of scores, [T, Hq].
void prefill(const float* q, const float* kv, const int64_t* tables, const int64_t* q_starts, const int64_t* q_lens,
             const int64_t* ctx_lens, int64_t num_seqs, const Shape& shape, float scale, float softcap, bool causal,
             int64_t splits, float* out, float* lse) {
  const int64_t Hq = shape.num_q_heads, G = Hq / shape.num_kv_heads, D = shape.head_size;
  const int64_t token_stride = shape.num_kv_heads * D, block_stride = shape.block_size * token_stride;
  const int64_t v_offset = shape.num_blocks * block_stride;
  const int64_t rpad = (G * kTq + kLanes - 1) / kLanes * kLanes;  // rows per tile, padded to vectors
  // Work items, the costliest (latest positions) first, handed out one at a time: a causal
  // prompt's tiles cost from 1 to its length in key tiles.
  struct Item {
    int64_t seq, kv_head, first;  // first: the tile's first query, from the prefill's first
    int64_t split;                // not causal: which of the `splits` key ranges
  };
  std::vector<Item> items;
  for (int64_t s = 0; s < num_seqs; ++s)
    for (int64_t i = 0; i < q_lens[s]; i += kTq)
      for (int64_t h = 0; h < shape.num_kv_heads; ++h)
        for (int64_t k = 0; k < splits; ++k) items.push_back({s, h, i, k});
  auto cost = [&](const Item& a) {
    return causal ? std::min(kTq, q_lens[a.seq] - a.first) + ctx_lens[a.seq] + a.first : ctx_lens[a.seq] / splits;
  };
  // Split key ranges: each item's normalised output and log-sum-exp, merged at the end.
  const int64_t T = shape.q_rows;
  std::vector<float> part_out(splits > 1 ? splits * T * Hq * D : 0), part_lse(splits > 1 ? splits * T * Hq : 0);
  std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) { return cost(a) > cost(b); });
  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), num_items);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    std::vector<float> qt_buf(D * rpad), st_buf(kTk * rpad), o_buf(rpad * D), stats(4 * rpad), zero(D, 0.f);
    float* __restrict qt = qt_buf.data();
    float* __restrict st = st_buf.data();
    float* __restrict o = o_buf.data();
    float* __restrict m = stats.data();              // running max score per row
    float* __restrict l = m + rpad;                  // running sum of exp per row
    float* __restrict alpha = l + rpad;              // this tile's rescale of the row's sums
    float* __restrict pos = alpha + rpad;            // the row's position (last keys it sees)
    const float* keys[kTk];
    const float* vals[kTk];
    const vecf ninf = vecf{} - std::numeric_limits<float>::infinity();
    for (int64_t it; (it = next.fetch_add(1)) < num_items;) {
      const Item item = items[it];
      // Not causal: keys [k_begin, k_end), every row at the last one's position. Ranges start
      // on key tiles.
      const int64_t n_ctx = ctx_lens[item.seq];
      const int64_t k_begin = causal ? 0 : (n_ctx / kTk * item.split / splits) * kTk;
      const int64_t k_end = causal || item.split + 1 == splits ? n_ctx : (n_ctx / kTk * (item.split + 1) / splits) * kTk;
      const int64_t first_pos = causal ? n_ctx + item.first : k_end - 1;
      const int64_t tq = std::min(kTq, q_lens[item.seq] - item.first);
      const int64_t rows = G * tq, rvecs = (rows + kLanes - 1) / kLanes;
      const int64_t* table = tables + item.seq * shape.max_blocks;
      const int64_t first_row = q_starts[item.seq] + item.first;
      // Row r = i * G + g: query i of the tile, head g of the kv head's group. Pre-scaled.
      std::fill(qt, qt + D * rpad, 0.f);
      for (int64_t i = 0; i < tq; ++i) {
        const float* qrow = q + (first_row + i) * shape.q_row_stride + item.kv_head * G * D;
        for (int64_t g = 0; g < G; ++g)
          for (int64_t d = 0; d < D; ++d) qt[d * rpad + i * G + g] = qrow[g * D + d] * scale;
      }
      for (int64_t r = 0; r < rpad; ++r)
        pos[r] = static_cast<float>(causal ? first_pos + std::min(r, rows - 1) / G : first_pos);
      std::fill(o, o + rows * D, 0.f);
      std::fill(m, m + rpad, -std::numeric_limits<float>::infinity());
      std::fill(l, l + rpad, 0.f);
      const int64_t num_keys = causal ? first_pos + tq : k_end;
      for (int64_t k0 = k_begin; k0 < num_keys; k0 += kTk) {
        const int64_t nk = std::min(kTk, num_keys - k0);
        for (int64_t j = 0, blk = k0 / shape.block_size, in = k0 % shape.block_size; j < kTk; ++j) {
          keys[j] = j < nk ? kv + table[blk] * block_stride + in * token_stride + item.kv_head * D
                           : zero.data();  // past the last key: scored, then masked
          vals[j] = keys[j] + (j < nk ? v_offset : 0);
          if (++in == shape.block_size) in = 0, ++blk;
        }
        for (int64_t j = 0; j < kTk; j += kKeyStep) {
          for (int64_t v = 0; v < rvecs;) {
            const int64_t nv = std::min(kRowVecs, rvecs - v);
            const float* qv = qt + v * kLanes;
            float* sv = st + j * rpad + v * kLanes;
            switch (nv) {
              case 3: tile_scores<kKeyStep, 3>(keys + j, qv, D, rpad, sv); break;
              case 2: tile_scores<kKeyStep, 2>(keys + j, qv, D, rpad, sv); break;
              default: tile_scores<kKeyStep, 1>(keys + j, qv, D, rpad, sv);
            }
            v += nv;
          }
        }
        // Online softmax down each column: keys after a row's position (only in tiles past
        // the tile's first position) get probability 0.
        const bool masked = k0 + kTk - 1 > first_pos;
        for (int64_t v = 0; v < rvecs; ++v) {
          const vecf prev = loadv(m + v * kLanes), posv = loadv(pos + v * kLanes);
          vecf top = prev;
          for (int64_t j = 0; j < kTk; ++j) {
            vecf x = loadv(st + j * rpad + v * kLanes);
            if (softcap > 0.f) x = softcap * kvtier::tanh_approx(x * (1.f / softcap));
            if (masked) x = vecf{} + static_cast<float>(k0 + j) <= posv ? x : ninf;
            storev(st + j * rpad + v * kLanes, x);
            top = x > top ? x : top;
          }
          const vecf a = kvtier::exp_nonpositive(prev - top);
          vecf sum = vecf{};
          for (int64_t j = 0; j < kTk; ++j) {
            const vecf x = loadv(st + j * rpad + v * kLanes);
            const vecf p = x == ninf ? vecf{} : kvtier::exp_nonpositive(x - top);
            storev(st + j * rpad + v * kLanes, p);
            sum += p;
          }
          storev(alpha + v * kLanes, a);
          storev(m + v * kLanes, top);
          storev(l + v * kLanes, loadv(l + v * kLanes) * a + sum);
        }
        tile_values(vals, nk, st, rpad, alpha, o, rows, D);
      }
      float* dst_out = splits > 1 ? part_out.data() + item.split * T * Hq * D : out;
      float* dst_lse = splits > 1 ? part_lse.data() + item.split * T * Hq : lse;
      for (int64_t i = 0; i < tq; ++i) {
        float* orow = dst_out + (first_row + i) * Hq * D + item.kv_head * G * D;
        for (int64_t g = 0; g < G; ++g) {
          const float inv = 1.f / l[i * G + g];
          const float* src = o + (i * G + g) * D;
          for (int64_t d = 0; d < D; ++d) orow[g * D + d] = src[d] * inv;
          if (dst_lse != nullptr) {
            dst_lse[(first_row + i) * Hq + item.kv_head * G + g] = m[i * G + g] + std::log(l[i * G + g]);
          }
        }
      }
    }
  });
  if (splits == 1) return;
  // Each row's split results, weighted by exp(lse_k - max) (FlashDecoding's merge).
  std::vector<int64_t> rows;
  for (int64_t s = 0; s < num_seqs; ++s)
    for (int64_t i = 0; i < q_lens[s]; ++i) rows.push_back(q_starts[s] + i);
  at::parallel_for(0, static_cast<int64_t>(rows.size()) * Hq, 1, [&](int64_t begin, int64_t end) {
    for (int64_t rh = begin; rh < end; ++rh) {
      const int64_t at = rows[rh / Hq] * Hq + rh % Hq;
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t k = 0; k < splits; ++k) top = std::max(top, part_lse[k * T * Hq + at]);
      float* o = out + at * D;
      std::fill(o, o + D, 0.f);
      float total = 0.f;
      for (int64_t k = 0; k < splits; ++k) {
        const float w = std::exp(part_lse[k * T * Hq + at] - top);
        total += w;
        const float* src = part_out.data() + (k * T * Hq + at) * D;
        for (int64_t d = 0; d < D; ++d) o[d] += w * src[d];
      }
      for (int64_t d = 0; d < D; ++d) o[d] /= total;
      if (lse != nullptr) lse[at] = top + std::log(total);
    }
  });
}

}  // namespace

namespace {

// Checks the arguments both entry points share; returns the kernel's shape.
Shape checked_shape(const torch::Tensor& q, const torch::Tensor& kv_cache, const torch::Tensor& block_tables,
                    const torch::Tensor& q_starts, const torch::Tensor& q_lens, const torch::Tensor& ctx_lens,
                    const torch::Tensor& out, bool causal) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "q must be float32 [T, Hq, D] with each row's heads contiguous");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous() &&
                  kv_cache.scalar_type() == torch::kFloat,
              "kv_cache must be contiguous float32 [2, num_blocks, block_size, Hkv, D]");
  TORCH_CHECK(kv_cache.size(4) == q.size(2) && q.size(1) % kv_cache.size(3) == 0, "q and kv_cache heads disagree");
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous() && out.scalar_type() == torch::kFloat,
              "out must be contiguous float32 shaped like q");
  const int64_t num_seqs = q_starts.size(0);
  for (const auto* t : {&block_tables, &q_starts, &q_lens, &ctx_lens}) {
    TORCH_CHECK(t->scalar_type() == torch::kLong && t->is_contiguous() && t->size(0) == num_seqs,
                "block_tables, q_starts, q_lens and ctx_lens must be contiguous int64 with one row per prefill");
  }
  const int64_t* starts = q_starts.data_ptr<int64_t>();
  const int64_t* lens = q_lens.data_ptr<int64_t>();
  const int64_t* ctx = ctx_lens.data_ptr<int64_t>();
  const int64_t bs = kv_cache.size(2);
  for (int64_t s = 0; s < num_seqs; ++s) {
    TORCH_CHECK(lens[s] > 0 && ctx[s] >= (causal ? 0 : 1) && starts[s] >= 0 && starts[s] + lens[s] <= q.size(0),
                "prefill ", s, "'s rows are outside q, or it has no keys");
    const int64_t keys = causal ? ctx[s] + lens[s] : ctx[s];
    TORCH_CHECK((keys + bs - 1) / bs <= block_tables.size(1), "prefill ", s, " has more keys than its block table holds");
  }
  return Shape{q.size(1), kv_cache.size(3), q.size(2), bs, kv_cache.size(1), block_tables.size(1), q.stride(0),
               q.size(0)};
}

}  // namespace

// q [T, Hq, D] float32 (heads contiguous within a row; rows may be strided); kv_cache
// [2, num_blocks, block_size, Hkv, D] float32; block_tables [S, max_blocks], q_starts, q_lens,
// ctx_lens [S] int64; out [T, Hq, D] float32 contiguous, of which each prefill's rows are
// written; softcap <= 0: no cap.
void paged_prefill_attention(const torch::Tensor& q, const torch::Tensor& kv_cache, const torch::Tensor& block_tables,
                             const torch::Tensor& q_starts, const torch::Tensor& q_lens,
                             const torch::Tensor& ctx_lens, double scale, double softcap, torch::Tensor& out) {
  const Shape shape = checked_shape(q, kv_cache, block_tables, q_starts, q_lens, ctx_lens, out, true);
  prefill(q.data_ptr<float>(), kv_cache.data_ptr<float>(), block_tables.data_ptr<int64_t>(),
          q_starts.data_ptr<int64_t>(), q_lens.data_ptr<int64_t>(), ctx_lens.data_ptr<int64_t>(), q_starts.size(0),
          shape, static_cast<float>(scale), static_cast<float>(softcap), true, 1, out.data_ptr<float>(), nullptr);
}

// Shared prefixes: group s's q_lens[s] rows from q_starts[s] each attend keys
// [0, prefix_lens[s]) of block_tables[s], not causally; writes their rows of out and of lse
// [T, Hq] (float32 contiguous: each row's log-sum-exp of scores).
void paged_prefix_attention(const torch::Tensor& q, const torch::Tensor& kv_cache, const torch::Tensor& block_tables,
                            const torch::Tensor& q_starts, const torch::Tensor& q_lens,
                            const torch::Tensor& prefix_lens, double scale, double softcap, torch::Tensor& out,
                            torch::Tensor& lse) {
  const Shape shape = checked_shape(q, kv_cache, block_tables, q_starts, q_lens, prefix_lens, out, false);
  TORCH_CHECK(lse.dim() == 2 && lse.size(0) == q.size(0) && lse.size(1) == q.size(1) && lse.is_contiguous() &&
                  lse.scalar_type() == torch::kFloat,
              "lse must be contiguous float32 [T, Hq]");
  // Key ranges enough for 4 work items per thread (a group of 16 rows over 3 kv heads would
  // otherwise be 3 items on 2 threads), each of at least 512 keys.
  const int64_t* lens = q_lens.data_ptr<int64_t>();
  const int64_t* prefix = prefix_lens.data_ptr<int64_t>();
  int64_t items = 0, shortest = std::numeric_limits<int64_t>::max();
  for (int64_t s = 0; s < q_starts.size(0); ++s) {
    items += (lens[s] + kTq - 1) / kTq * shape.num_kv_heads;
    shortest = std::min(shortest, prefix[s]);
  }
  const int64_t want = 4 * at::get_num_threads();
  const int64_t splits = std::clamp<int64_t>((want + items - 1) / std::max<int64_t>(1, items), 1,
                                             std::max<int64_t>(1, shortest / 512));
  prefill(q.data_ptr<float>(), kv_cache.data_ptr<float>(), block_tables.data_ptr<int64_t>(),
          q_starts.data_ptr<int64_t>(), q_lens.data_ptr<int64_t>(), prefix_lens.data_ptr<int64_t>(),
          q_starts.size(0), shape, static_cast<float>(scale), static_cast<float>(softcap), false, splits,
          out.data_ptr<float>(), lse.data_ptr<float>());
}
