// y = x @ W.T + b in float32 over W packed once into panels of 16 output columns
// ([ceil(N/16), K, 16]: panel p holds W[16p .. 16p+15, k] at [p, k, :]; engine/linear_backend.py
// packs them). Each panel is one contiguous stream, so a decode step (a few rows) reads the
// weights faster than oneDNN's GEMV reads its blocked layout; the same
// micro-kernel, 6 rows x 64 columns of accumulators, runs prefill GEMMs at oneDNN's rate
// (benchmarks/bench_kernels.py, `bench_linear`).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#include "vec_math.h"

namespace {

constexpr int64_t kPanel = 16;  // a panel's columns

// The micro-kernel's vector is the machine's widest register (vec_math.h): a panel's row is
// 16 / kVec of them.
using vreg = kvtier::vecf;
constexpr int kVec = static_cast<int>(kvtier::kLanes);
constexpr int kPerPanel = kPanel / kVec;

// Rows of x x panels per micro-kernel call: as many accumulators as the registers hold beside a
// panel's row and a broadcast of x (24 of AVX-512's 32 registers, 12 of AVX2's 16).
constexpr int kMaxRows = 6;
constexpr int kMaxPanels = kVec == 16 ? 4 : 1;
// A long input (a prefill) is cut in blocks of rows, each kept in L2 while panels stream past
// it from L3, in slices of the weight of up to kSliceBytes: all of a slice's row blocks, then
// the next slice. A thread's items then write whole rows of y near each other (rows apart by
// the full width, in panel order, cost a TLB miss per row, which was slower at 4k rows).
constexpr int64_t kRowBlock = 16 * kMaxRows;
constexpr int64_t kSliceBytes = 8 << 20;
// Up to this many rows every thread takes all rows over its share of the panels: a decode
// step streams each weight once, and a 1k prefill's rows stream from L2/L3 past panels held
// in L1 (at oneDNN's rate or above there, where row blocks were at best level with it).
constexpr int64_t kAllRows = 1024;

using kvtier::loadv;
using kvtier::storev;

// y[0..R) x [0..NP*16) = x[0..R) @ panels (+ bias); last_cols: the valid columns of the last
// panel (16 elsewhere).
template <int R, int NP>
void micro(const float* __restrict x, int64_t K, const float* __restrict w, const float* __restrict bias,
           float* __restrict y, int64_t ldy, int64_t last_cols) {
  constexpr int V = NP * kPerPanel;
  vreg acc[R][V];
  for (int v = 0; v < V; ++v) {
    const vreg b = bias != nullptr ? loadv(bias + kVec * v) : vreg{};
    for (int r = 0; r < R; ++r) acc[r][v] = b;
  }
  const int64_t panel_stride = K * kPanel;
  for (int64_t k = 0; k < K; ++k) {
    vreg wk[V];
    for (int v = 0; v < V; ++v) {
      wk[v] = loadv(w + (v / kPerPanel) * panel_stride + k * kPanel + (v % kPerPanel) * kVec);
    }
    for (int r = 0; r < R; ++r) {
      const float a = x[r * K + k];
      for (int v = 0; v < V; ++v) acc[r][v] += wk[v] * a;
    }
  }
  const int64_t cols = (NP - 1) * kPanel + last_cols;
  for (int r = 0; r < R; ++r) {
    float* yr = y + r * ldy;
    for (int v = 0; v < V; ++v) {
      if ((v + 1) * kVec <= cols) {
        storev(yr + kVec * v, acc[r][v]);
      } else if (v * kVec < cols) {
        float tmp[kVec];
        storev(tmp, acc[r][v]);
        std::memcpy(yr + kVec * v, tmp, sizeof(float) * (cols - v * kVec));
      }
    }
  }
}

template <int NP>
void rows_over_panels(const float* x, int64_t rows, int64_t K, const float* w, const float* bias, float* y,
                      int64_t ldy, int64_t last_cols) {
  int64_t r = 0;
  for (; r + kMaxRows <= rows; r += kMaxRows) micro<kMaxRows, NP>(x + r * K, K, w, bias, y + r * ldy, ldy, last_cols);
  const float* xr = x + r * K;
  float* yr = y + r * ldy;
  switch (rows - r) {
    case 5: micro<5, NP>(xr, K, w, bias, yr, ldy, last_cols); break;
    case 4: micro<4, NP>(xr, K, w, bias, yr, ldy, last_cols); break;
    case 3: micro<3, NP>(xr, K, w, bias, yr, ldy, last_cols); break;
    case 2: micro<2, NP>(xr, K, w, bias, yr, ldy, last_cols); break;
    case 1: micro<1, NP>(xr, K, w, bias, yr, ldy, last_cols); break;
    default: break;
  }
}

// Rows [r0, r1) x panels [p0, p1), in calls of up to kMaxPanels panels.
void run_block(const float* x, const float* w, const float* bias, float* y, int64_t K, int64_t N, int64_t r0,
               int64_t r1, int64_t p0, int64_t p1) {
  for (int64_t p = p0; p < p1; p += kMaxPanels) {
    const int64_t np = std::min<int64_t>(kMaxPanels, p1 - p);
    const int64_t last_cols = std::min<int64_t>(kPanel, N - (p + np - 1) * kPanel);
    const float* xr = x + r0 * K;
    const float* wp = w + p * K * kPanel;
    const float* bp = bias != nullptr ? bias + p * kPanel : nullptr;
    float* yp = y + r0 * N + p * kPanel;
    switch (np) {
      case 4: rows_over_panels<4>(xr, r1 - r0, K, wp, bp, yp, N, last_cols); break;
      case 3: rows_over_panels<3>(xr, r1 - r0, K, wp, bp, yp, N, last_cols); break;
      case 2: rows_over_panels<2>(xr, r1 - r0, K, wp, bp, yp, N, last_cols); break;
      default: rows_over_panels<1>(xr, r1 - r0, K, wp, bp, yp, N, last_cols); break;
    }
  }
}

}  // namespace

// Returns x [M, K] @ W.T + bias as [M, N], W given as `panels` [ceil(N/16), K, 16] and bias
// (or None) padded to the panels' 16 * ceil(N/16) columns.
torch::Tensor panel_linear(const torch::Tensor& x, const torch::Tensor& panels, const c10::optional<torch::Tensor>& bias,
                           int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [rows, in_features] tensor");
  TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == torch::kFloat && panels.is_contiguous() &&
              panels.size(2) == kPanel, "panels must be contiguous float32 [ceil(N/16), K, 16]");
  const int64_t M = x.size(0), K = x.size(1), N = out_features, P = panels.size(0);
  TORCH_CHECK(panels.size(1) == K, "x has ", K, " features, the weight ", panels.size(1));
  TORCH_CHECK(N > (P - 1) * kPanel && N <= P * kPanel, out_features, " outputs do not fill ", P, " panels of 16");
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->scalar_type() == torch::kFloat && bias->is_contiguous() &&
                bias->size(0) == P * kPanel, "bias must be contiguous float32 [16 * panels]");
    bp = bias->data_ptr<float>();
  }
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (M <= kAllRows) {
    at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) { run_block(xp, wp, bp, yp, K, N, 0, M, p0, p1); });
  } else {
    // Row blocks of equal size (a multiple of the micro-kernel's rows): items of equal work.
    const int64_t row_blocks = (M + kRowBlock - 1) / kRowBlock;
    const int64_t block = ((M + row_blocks - 1) / row_blocks + kMaxRows - 1) / kMaxRows * kMaxRows;
    // Items of (a row block, kMaxPanels panels): slice, then row block, then panels.
    const int64_t groups = (P + kMaxPanels - 1) / kMaxPanels;
    const int64_t group_bytes = K * kPanel * kMaxPanels * static_cast<int64_t>(sizeof(float));
    const int64_t per_slice = std::clamp<int64_t>(kSliceBytes / group_bytes, 1, groups);
    const int64_t slices = (groups + per_slice - 1) / per_slice;
    at::parallel_for(0, slices * row_blocks * per_slice, 1, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t slice = i / (row_blocks * per_slice), in_slice = i % (row_blocks * per_slice);
        const int64_t rb = in_slice / per_slice, g = slice * per_slice + in_slice % per_slice;
        if (g >= groups || rb * block >= M) continue;  // the last slice's or block's missing ones
        run_block(xp, wp, bp, yp, K, N, rb * block, std::min(M, (rb + 1) * block), g * kMaxPanels,
                  std::min(P, (g + 1) * kMaxPanels));
      }
    });
  }
  return y;
}
