// Vectorisable math shared by the engine's CPU kernels.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace kvtier {

// exp(x) for x <= 0 (scores minus their max), vectorisable: 2^(x log2 e) split into 2^n, built in
// the exponent bits, and 2^f for f in [-0.5, 0.5] by a degree-6 polynomial (relative error
// ~2e-7, the float32 rounding scale). Clamped at -87 (about 1e-38, float32's smallest normal).
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.f);
  const float y = x * 1.44269504088896341f;
  const float n = std::nearbyint(y);
  const float f = y - n;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.f;
  int32_t bits;
  std::memcpy(&bits, &p, sizeof bits);
  bits += static_cast<int32_t>(n) << 23;
  std::memcpy(&p, &bits, sizeof p);
  return p;
}

}  // namespace kvtier
