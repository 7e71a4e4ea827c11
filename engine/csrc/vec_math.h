// Vectorisable math shared by the engine's CPU kernels: each function takes a float or a
// vector of kLanes floats (`vecf`, GCC's vector extension: one register of the machine).
#pragma once

#include <cstdint>
#include <cstring>

namespace kvtier {

// The machine's widest float register: 16 lanes with AVX-512, else 8 (AVX2). GCC lowers a
// generic vector wider than the target's registers element by element, which ran the
// attention kernels slower than PyTorch's own ops on an AVX2-only host (benchmarks/results/kernels*.md).
#ifdef __AVX512F__
constexpr int64_t kLanes = 16;
#else
constexpr int64_t kLanes = 8;
#endif
typedef float vecf __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t ivecf __attribute__((vector_size(kLanes * sizeof(int32_t))));

inline vecf loadv(const float* p) {
  vecf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void storev(float* p, vecf v) { std::memcpy(p, &v, sizeof v); }

// p * 2^n for integral n in float32's normal exponent range, by adding n to p's exponent bits.
inline float times_pow2(float p, float n) {
  int32_t bits;
  std::memcpy(&bits, &p, sizeof bits);
  bits += static_cast<int32_t>(n) << 23;
  std::memcpy(&p, &bits, sizeof p);
  return p;
}

inline vecf times_pow2(vecf p, vecf n) {
  ivecf bits;
  std::memcpy(&bits, &p, sizeof bits);
  bits += __builtin_convertvector(n, ivecf) << 23;
  std::memcpy(&p, &bits, sizeof p);
  return p;
}

// exp(x) for x <= 0 (scores minus their max): 2^(x log2 e) split into 2^n, built in the
// exponent bits, and 2^f for f in [-0.5, 0.5] by a degree-6 polynomial (relative error ~2e-7,
// the float32 rounding scale). Clamped at -87 (about 1e-38, float32's smallest normal).
template <typename T>
inline T exp_nonpositive(T x) {
  const T lo = T{} - 87.f;
  x = x < lo ? lo : x;
  const T y = x * 1.44269504088896341f;
  const T n = (y + 12582912.f) - 12582912.f;  // round to nearest (|y| < 2^22): 1.5 * 2^23
  const T f = y - n;
  T p = T{} + 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.f;
  return times_pow2(p, n);
}

// tanh(x): Eigen's rational approximation (odd degree-13 over even degree-6 polynomial) on x
// clamped to +-7.9, beyond which tanh is 1 in float32; a few ulp of error.
template <typename T>
inline T tanh_approx(T x) {
  const T hi = T{} + 7.90531110763549805f, lo = T{} - 7.90531110763549805f;
  x = x > hi ? hi : x;
  x = x < lo ? lo : x;
  const T x2 = x * x;
  T p = T{} - 2.76076847742355e-16f;
  p = p * x2 + 2.00018790482477e-13f;
  p = p * x2 - 8.60467152213735e-11f;
  p = p * x2 + 5.12229709037114e-08f;
  p = p * x2 + 1.48572235717979e-05f;
  p = p * x2 + 6.37261928875436e-04f;
  p = p * x2 + 4.89352455891786e-03f;
  T q = T{} + 1.19825839466702e-06f;
  q = q * x2 + 1.18534705686654e-04f;
  q = q * x2 + 2.26843463243900e-03f;
  q = q * x2 + 4.89352518554385e-03f;
  return x * p / q;
}

}  // namespace kvtier
