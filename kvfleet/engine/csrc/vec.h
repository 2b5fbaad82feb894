// 16-float vectors for the engine's kernels, written with GCC/Clang vector extensions so one
// source compiles to AVX-512, AVX2 or plain SSE as the build target has (see `native`).
#pragma once

#include <cstdint>
#include <cstring>

namespace kvfleet {

constexpr int64_t kLanes = 16;
// aligned(4) so loads from any float address are allowed.
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float)), aligned(4)));
typedef int32_t IVec __attribute__((vector_size(kLanes * sizeof(int32_t)), aligned(4)));
typedef float Vec8 __attribute__((vector_size(8 * sizeof(float))));
typedef float Vec4 __attribute__((vector_size(4 * sizeof(float))));

// The ISA's own vector register. Accumulators that live across a loop must be of this type:
// GCC keeps an array of 16-float Vecs in registers on AVX-512, but on AVX2 (two ymm per Vec)
// it moved every one through the stack and general registers on each use, which made the
// 4-bit matmul 3-15x slower than MKL there.
#if defined(__AVX512F__)
constexpr int64_t kRegLanes = 16;
#elif defined(__AVX2__)
constexpr int64_t kRegLanes = 8;
#else
constexpr int64_t kRegLanes = 4;
#endif
typedef float Reg __attribute__((vector_size(kRegLanes * sizeof(float)), aligned(4)));
typedef int32_t IReg __attribute__((vector_size(kRegLanes * sizeof(int32_t)), aligned(4)));

inline Reg load_reg(const float* p) { return *reinterpret_cast<const Reg*>(p); }
inline void store_reg(float* p, Reg v) { *reinterpret_cast<Reg*>(p) = v; }

inline Vec load(const float* p) { return *reinterpret_cast<const Vec*>(p); }
inline void store(float* p, Vec v) { *reinterpret_cast<Vec*>(p) = v; }
inline Vec splat(float x) { return Vec{} + x; }

// A fixed tree of halvings (4 dependent adds), not 16 serial ones: the serial sum was most of
// the decode attention kernel's time, since every cached position needs one per query head.
// Fixed, so a row's result does not depend on what else is computed.
inline float horizontal_sum(Vec v) {
  const Vec8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                 __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const Vec4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) +
                 __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// exp of 16 floats: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by a degree-6 polynomial
// (relative error ~2e-7, like expf), 2^n put into the exponent bits. Inputs below -87.3
// (including -inf, the causal mask) give exactly 0; above 88.7 they give exp(88.7). A scalar
// std::exp per score was most of the prefill attention kernel's time.
inline Vec vexp(Vec x) {
  const Vec lo = splat(-87.3f), hi = splat(88.7f);
  const Vec zero = splat(0.f);
  const Vec clamped = x < lo ? lo : (x > hi ? hi : x);
  const Vec n = __builtin_convertvector(
      __builtin_convertvector(clamped * 1.44269504088896341f + (clamped < zero ? -0.5f : 0.5f),
                              IVec), Vec);
  const Vec r = clamped - n * 0.693359375f + n * 2.12194440e-4f;
  Vec p = splat(1.f / 720.f);
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const IVec bits = (__builtin_convertvector(n, IVec) + 127) << 23;
  Vec scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < lo ? zero : p * scale;
}

}  // namespace kvfleet
