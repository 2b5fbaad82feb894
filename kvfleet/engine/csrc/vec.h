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

// A 16-float vector as ISA registers. GCC compiles a select (?:) or comparison on a vector
// wider than the ISA's registers to a scalar compare and blend per lane: on AVX2 (two ymm per
// Vec) that made vexp 9x slower (a SiLU over 1,536 floats took 5.1 us instead of 1.1), and with
// it every softmax and SiLU in the engine. Such code works on the registers instead.
struct Regs {
  Reg r[kLanes / kRegLanes];
};

inline Regs split(Vec v) {
  Regs parts;
  std::memcpy(parts.r, &v, sizeof(v));
  return parts;
}

inline Vec join(const Regs& parts) {
  Vec v;
  std::memcpy(&v, parts.r, sizeof(v));
  return v;
}

// exp of one register's lanes: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by a degree-6
// polynomial (relative error ~2e-7, like expf), 2^n put into the exponent bits. Inputs below
// -87.3 (including -inf, the causal mask) give exactly 0; above 88.7 they give exp(88.7). A
// scalar std::exp per score was most of the prefill attention kernel's time.
inline Reg vexp_reg(Reg x) {
  const Reg lo = Reg{} - 87.3f, hi = Reg{} + 88.7f;
  const Reg zero = Reg{};
  const Reg clamped = x < lo ? lo : (x > hi ? hi : x);
  const Reg n = __builtin_convertvector(
      __builtin_convertvector(
          clamped * 1.44269504088896341f + (clamped < zero ? zero - 0.5f : zero + 0.5f), IReg),
      Reg);
  const Reg r = clamped - n * 0.693359375f + n * 2.12194440e-4f;
  Reg p = zero + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const IReg bits = (__builtin_convertvector(n, IReg) + 127) << 23;
  Reg scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < lo ? zero : p * scale;
}

// exp of 16 floats (see vexp_reg).
inline Vec vexp(Vec x) {
  Regs parts = split(x);
  for (Reg& p : parts.r) p = vexp_reg(p);
  return join(parts);
}

// The lane-wise maximum of a and b.
inline Vec vmax(Vec a, Vec b) {
  Regs pa = split(a);
  const Regs pb = split(b);
  for (int64_t i = 0; i < kLanes / kRegLanes; ++i) pa.r[i] = pa.r[i] > pb.r[i] ? pa.r[i] : pb.r[i];
  return join(pa);
}

}  // namespace kvfleet
