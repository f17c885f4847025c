// Shared by the CPU kernels: element loads/stores in float32 for each storage type (bfloat16 by
// its bits, so loops vectorize; stores round to nearest even as torch does), and exp approximations
// the compiler can vectorize (libm's expf stays scalar without -ffast-math).
#pragma once
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace cascade {

template <typename T> struct Val;
template <> struct Val<float> {
  using raw = float;
  static inline float ld(float v) { return v; }
  static inline float st(float v) { return v; }
};
template <> struct Val<c10::BFloat16> {
  using raw = uint16_t;
  static inline float ld(uint16_t v) {
    const uint32_t u = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  static inline uint16_t st(float f) {  // c10::BFloat16's round_to_nearest_even
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
};
template <> struct Val<c10::Half> {
  using raw = c10::Half;
  static inline float ld(c10::Half v) { return static_cast<float>(v); }
  static inline c10::Half st(float v) { return c10::Half(v); }
};
template <> struct Val<int8_t> {
  using raw = int8_t;
  static inline float ld(int8_t v) { return static_cast<float>(v); }
};

// float32 rounded to T's precision and back: where torch stores an intermediate in T
template <typename T> inline float round_to(float v) { return Val<T>::ld(Val<T>::st(v)); }

// 2^f for f in [-0.5, 0.5], a degree-6 polynomial, on one float or a vector of them
template <typename F> inline F exp2_fraction(F f) {
  F p = F{} + 1.5353362e-4f;
  p = p * f + 1.3398874e-3f;
  p = p * f + 9.6180390e-3f;
  p = p * f + 5.5504109e-2f;
  p = p * f + 2.4022650e-1f;
  p = p * f + 6.9314718e-1f;
  return p * f + 1.0f;
}

// 2^(x log2 e) split into an integer power (the float's exponent bits) and a degree-6 polynomial
// of the fraction; relative error ~2e-7. Valid for x in [-87, 88] (the caller clamps).
inline float exp_core(float x) {
  const float y = x * 1.44269504088896341f;
  // y rounded to an integer by the 1.5 * 2^23 trick (std::floor does not vectorize without
  // -fno-trapping-math); exact for |y| < 2^22, and |y| <= 127 here
  const float n = (y + 12582912.0f) - 12582912.0f;
  const float p = exp2_fraction(y - n);  // the fraction in [-0.5, 0.5]
  int32_t bits;
  std::memcpy(&bits, &p, 4);
  bits += static_cast<int32_t>(n) << 23;
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

// exp(x) for x <= 0 (softmax after max subtraction): exactly 0 below -87, where expf underflows anyway
inline float exp_neg(float x) {
  const float e = exp_core(std::max(x, -87.0f));
  return x <= -87.0f ? 0.0f : e;
}

// exp(x) for any x: 0 below -87, +inf above 88
inline float exp_any(float x) {
  const float e = exp_core(std::min(std::max(x, -87.0f), 88.0f));
  return x <= -87.0f ? 0.0f : (x >= 88.0f ? INFINITY : e);
}

// Sixteen floats at a time in GCC's generic vectors (one AVX-512 register, two AVX2 ones): the
// element-wise kernels' loads, stores and math written once for both ISAs, in the same rounding as
// Val (stores round to nearest even, NaN to 0x7fc0) and exp_core (the same polynomial), where GCC's
// auto-vectorizer leaves the scalar loops (the bfloat16 stores, the argmax) one element at a time.
namespace vec {
constexpr int64_t W = 16;
typedef float fv __attribute__((vector_size(64)));
typedef int32_t iv __attribute__((vector_size(64)));
typedef uint32_t uv __attribute__((vector_size(64)));
typedef uint16_t hv __attribute__((vector_size(32)));

// the storage types with a vector path: float32 and bfloat16
template <typename T> constexpr bool has = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>;

inline fv splat(float x) { return fv{} + x; }
inline fv load(const float* p) {
  fv v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline fv load(const uint16_t* p) {  // bfloat16: the bits into the high half
  hv h;
  std::memcpy(&h, p, sizeof h);
  const uv u = __builtin_convertvector(h, uv) << 16;
  fv v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}
inline void store(float* p, fv v) { std::memcpy(p, &v, sizeof v); }
inline uv bf16_bits(fv v) {  // the rounded bfloat16 in the low half of each lane (Val's rule)
  uv u;
  std::memcpy(&u, &v, sizeof u);
  const uv r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return (v != v) ? uv{} + 0x7fc0u : r;
}
inline void store(uint16_t* p, fv v) {
  const hv h = __builtin_convertvector(bf16_bits(v), hv);
  std::memcpy(p, &h, sizeof h);
}
// v rounded to T's precision and back (round_to, sixteen at a time)
template <typename T> inline fv round(fv v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    const uv u = bf16_bits(v) << 16;
    fv r;
    std::memcpy(&r, &u, sizeof r);
    return r;
  }
}
inline float sum(fv v) {
  float s = 0.f;
  for (int64_t j = 0; j < W; ++j) s += v[j];
  return s;
}
inline fv min(fv a, fv b) { return a < b ? a : b; }
inline fv max(fv a, fv b) { return a > b ? a : b; }
inline fv exp_any(fv x) {  // exp_any's rule and polynomial
  const fv c = max(min(x, splat(88.0f)), splat(-87.0f));
  const fv y = c * 1.44269504088896341f;
  const fv n = (y + 12582912.0f) - 12582912.0f;
  const fv p = exp2_fraction(y - n);
  iv bits;
  std::memcpy(&bits, &p, sizeof bits);
  bits += __builtin_convertvector(n, iv) << 23;
  fv e;
  std::memcpy(&e, &bits, sizeof e);
  e = (x <= -87.0f) ? fv{} : e;
  return (x >= 88.0f) ? splat(INFINITY) : e;
}
}  // namespace vec

}  // namespace cascade
