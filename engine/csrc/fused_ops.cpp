// Fused elementwise ops of a decoder layer, float32 on CPU (engine/cpu_ops.py builds them with
// paged_decode_attention.cpp): each replaces several PyTorch ops, i.e. several passes over the
// activations and several Python-level calls per layer per step.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

#include "vec_math.h"

namespace {

// Rows per work item, for rows of n values: about 32k values, so a decode step's few rows
// stay on the calling thread (waking the pool costs more than the work).
inline int64_t row_grain(int64_t n) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(n, 1)); }

void check_rows(const torch::Tensor& x, const char* what) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), what,
              " must be a contiguous float32 [rows, n] tensor");
}

void norm_rows(const float* __restrict src, const float* __restrict w, float* __restrict dst, int64_t n, float eps) {
  float sq = 0.f;
#pragma omp simd reduction(+ : sq)
  for (int64_t i = 0; i < n; ++i) sq += src[i] * src[i];
  const float inv = 1.f / std::sqrt(sq / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = w[i] * (src[i] * inv);
}

}  // namespace

// Returns weight * x / sqrt(mean(x^2) + eps) per row of x [T, n].
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.scalar_type() == torch::kFloat &&
              weight.is_contiguous(), "weight must be contiguous float32 [n]");
  auto out = torch::empty_like(x);
  const int64_t n = x.size(1);
  const float* xs = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, x.size(0), row_grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_rows(xs + r * n, w, o + r * n, n, static_cast<float>(eps));
  });
  return out;
}

// residual += x in place; returns rms_norm(residual, weight, eps).
torch::Tensor add_rms_norm(const torch::Tensor& x, torch::Tensor& residual, const torch::Tensor& weight,
                           double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(x.sizes() == residual.sizes(), "x and residual differ in shape");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.scalar_type() == torch::kFloat &&
              weight.is_contiguous(), "weight must be contiguous float32 [n]");
  auto out = torch::empty_like(x);
  const int64_t n = x.size(1);
  const float* xs = x.data_ptr<float>();
  float* res = residual.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, x.size(0), row_grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* __restrict rr = res + r * n;
      const float* __restrict xr = xs + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) rr[i] += xr[i];
      norm_rows(rr, w, o + r * n, n, static_cast<float>(eps));
    }
  });
  return out;
}

// gate_up [T, 2I] (gate, then up) -> silu(gate) * up [T, I].
torch::Tensor silu_and_mul(const torch::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must have an even number of columns");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  auto out = torch::empty({rows, n}, gate_up.options());
  const float* g = gate_up.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, rows, row_grain(2 * n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* __restrict gr = g + r * 2 * n;
      const float* __restrict ur = gr + n;
      float* __restrict orow = o + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) {
        const float x = gr[i];
        const float e = kvtier::exp_nonpositive(-std::fabs(x));  // exp(-|x|): never overflows
        const float sig = x >= 0.f ? 1.f / (1.f + e) : e / (1.f + e);
        orow[i] = x * sig * ur[i];
      }
    }
  });
  return out;
}

// Rotates, in place, the first `num_heads` heads of each row of x [T, >= num_heads * D] (row
// stride given by x, heads of D values) to positions [T], neox layout: with halves (a, b) of a
// head and (cos, sin) the halves of cos_sin[position] [D], (a, b) <- (a cos - b sin, b cos + a sin).
void rotary_(torch::Tensor& x, const torch::Tensor& positions, const torch::Tensor& cos_sin, int64_t num_heads) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.stride(1) == 1,
              "x must be float32 [T, n] with contiguous rows");
  TORCH_CHECK(cos_sin.dim() == 2 && cos_sin.scalar_type() == torch::kFloat && cos_sin.is_contiguous(),
              "cos_sin must be contiguous float32 [max_positions, D]");
  TORCH_CHECK(positions.dim() == 1 && positions.scalar_type() == torch::kLong && positions.is_contiguous() &&
              positions.size(0) == x.size(0), "positions must be contiguous int64 [T]");
  const int64_t d = cos_sin.size(1), half = d / 2, rows = x.size(0), stride = x.stride(0);
  TORCH_CHECK(d % 2 == 0 && num_heads * d <= x.size(1), "x has fewer than num_heads heads of cos_sin's width");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t max_pos = cos_sin.size(0);
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(pos[r] >= 0 && pos[r] < max_pos, "position ", pos[r], " outside the rotary table (", max_pos, ")");
  }
  float* base = x.data_ptr<float>();
  const float* table = cos_sin.data_ptr<float>();
  at::parallel_for(0, rows, row_grain(num_heads * d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* __restrict c = table + pos[r] * d;
      const float* __restrict s = c + half;
      for (int64_t h = 0; h < num_heads; ++h) {
        float* __restrict a = base + r * stride + h * d;
        float* __restrict b = a + half;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float ai = a[i], bi = b[i];
          a[i] = ai * c[i] - bi * s[i];
          b[i] = bi * c[i] + ai * s[i];
        }
      }
    }
  });
}
