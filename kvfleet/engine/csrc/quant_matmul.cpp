// Weight matmuls straight from GGUF's 4- and 8-bit blocks (Q4_1, Q8_0), dequantized next to
// the FMAs; and two opt-in paths that round the rows to 8 or 16 bits and multiply the codes by
// them in integers (at the end of the file).
//
// A step's weight matmuls stream every layer's weights; as float32 that is ~420 MB for
// SmolLM2-135M, so a decode step waits on memory, not arithmetic. Q4_1 keeps 32 weights in 20
// bytes (a float16 scale d and minimum m, 32 4-bit codes q), the weight being d * q + m; Q8_0
// keeps them in 34 (d and 32 signed 8-bit codes, the weight d * q). Here the weights stay in
// that form (re-laid out at load, the same 0.625 / 1.0625 bytes a weight) and each thread
// dequantizes a panel of 32 output features into a float32 buffer in its L2, which then feeds
// every row of the step: the memory traffic of a step falls ~6x (Q4_1) or ~3.8x (Q8_0), the
// arithmetic is unchanged.
//
// Exactness: the panel holds the very float32 values the loader's dequantization gives. d * q
// is exact in float32 (an 11-bit float16 significand times a 4-bit or 8-bit code), so
// computed with or without an FMA the one rounding is Q4_1's add, as in the loader. Only the
// order in which a row's products are summed differs from another GEMM, as between any two
// BLAS libraries; that order is fixed per row, so a row's result does not depend on the other
// rows. The 1-2 row path (`narrow_rows`) applies each block's scale after summing its codes'
// products: the same sum in another float32 rounding.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "vec.h"

#ifndef KVFLEET_FEW_ROWS_CHUNK  // rows a register pass below AVX-512 (see kFewRowsChunk)
#if defined(__AVX2__)
#define KVFLEET_FEW_ROWS_CHUNK 12
#else
#define KVFLEET_FEW_ROWS_CHUNK 8
#endif
#endif
#ifndef KVFLEET_FEW_ROWS
#define KVFLEET_FEW_ROWS 16
#endif

namespace {

using namespace kvfleet;
constexpr int64_t kBlock = 32;           // weights per block (along the input dimension)
constexpr int64_t kPanel = 2 * kLanes;   // output features dequantized together
constexpr int64_t kSub = kLanes / kRegLanes;  // registers per 16-feature group
// Micro-tiles sized to the register file (accumulators + weights + one broadcast must fit, or
// every accumulator is stored and reloaded on each k): AVX-512, 32 zmm: 12 rows x 2 registers
// (32 features); AVX2, 16 ymm: 6 rows x 2 registers (16 features); SSE, 16 xmm: 6 x 2 (8).
#if defined(__AVX512F__)
constexpr int64_t kRows = 12;
#else
constexpr int64_t kRows = 6;
#endif
constexpr int64_t kTileRegs = 2;
constexpr int64_t kTileWidth = kTileRegs * kRegLanes;
// The register path (`few_rows_times_group`) keeps one register of accumulators per row, plus
// d, m, the weight and a broadcast: up to 16 rows at once on AVX-512 (32 zmm); 12 on AVX2,
// where 12 accumulators, d, m, the weight and the broadcast fill the 16 ymm (the code mask is
// read from memory); 8 on SSE. AVX2 took 8 until session 25: with 12, one dequantized weight
// feeds 12 multiply-adds instead of 8, and SmolLM2's 120 layer matmuls took 3-5 % less at
// 12-64 rows (12: 12.87 -> 12.03 ms, 32: 32.78 -> 31.63, 64: 65.94 -> 62.37; the LM head
// 2-3 %), same bits (x86-64-v3 builds taking turns in one process, 2 threads, Zen 5). On
// AVX-512 more than 16 rows a pass was 1.4-1.7x slower (20 and 24: the rows' x pointers no
// longer fit the general registers).
#if defined(__AVX512F__)
constexpr int64_t kFewRowsChunk = 16;
#else
constexpr int64_t kFewRowsChunk = KVFLEET_FEW_ROWS_CHUNK;
#endif
// Up to this many rows skip the panel buffer, in chunks of kFewRowsChunk rows (each chunk
// dequantizes the group again). Measured on all of SmolLM2's layer matmuls and its LM head, 2
// threads, AVX-512: 12 vs 19 ms at 1 row, 16 vs 23 at 8, 23 vs 32 at 16; at 103 rows the
// panels take 86 ms where 16-row passes would take ~150. A caller may set its own limit
// (`register_rows`): the engine's matmul plan times both per host and shape, and on a Zen 5
// the register path won up to 64 rows (kvfleet/engine/matmul_plan.py, WIDE_REGISTER_ROWS).
constexpr int64_t kFewRows = KVFLEET_FEW_ROWS;

// Whether `rows` rows (more than 2) take the register path. Each chunk of kFewRowsChunk rows is
// a pass over the weights, so a last chunk of a few rows costs nearly a whole pass for little
// work, and there the panels win. Measured on AVX2 with chunks of 8, SmolLM2's 120 layer
// matmuls, 2 threads, one process, the two paths alternating: panel / register time
// 1.33-1.43x at 3-8 rows, 0.88x at 9 (8 + 1), 0.90x at 10, 0.97x at 12 (8 + 4), 1.14x at 14,
// 1.02x at 16. (With AVX2's chunks of 12 this rule sends 13-16 rows to the panels; the
// engine's plan also times the register path for them, `quant_wide`.)
inline bool register_path(int64_t rows) {
  const int64_t last = rows % kFewRowsChunk;
  return rows <= kFewRowsChunk || (rows <= kFewRows && (last == 0 || 2 * last > kFewRowsChunk));
}

// Bytes of one (16 outputs, one block) group in the packed layouts. Q4_1: d[16], m[16] as
// float16 (the file's own values), then 16 bytes per pair (j, j + 16) of a block's positions,
// one byte per output feature (j's code in the low nibble). Q8_0: d[16] as float16, then 16
// signed bytes per position. The group size tells the two apart. The scales stay 16-bit:
// widened to float32 they were 1/6 of Q4_1's bytes, and a 1-2 row step reads every byte of
// every weight (F16C converts a register of them in one instruction, exactly).
constexpr int64_t kScaleBytes = 2;
constexpr int64_t kQ4CodesOffset = 2 * kLanes * kScaleBytes;
constexpr int64_t kQ8CodesOffset = kLanes * kScaleBytes;
constexpr int64_t kQ4GroupBytes = kQ4CodesOffset + kLanes * kLanes;
constexpr int64_t kQ8GroupBytes = kQ8CodesOffset + kBlock * kLanes;
enum class Format { kQ4_1, kQ8_0 };

// A few-row matmul streams its weights from DRAM, and the hardware prefetchers alone left it
// far from the host's read bandwidth: on the AVX2 host (SmolLM2's 120 layer matmuls at one
// row, 66 MB) 6.5-10.6 GB/s, where a plain read loop gets 14-17 (one core) and 20-23 (two),
// compute and memory taking turns rather than overlapping. So each thread asks for the bytes
// it will read kPrefetchAhead later. Distances measured in one process, alternating, 2
// threads: none 5.22 ms, 10 KiB 4.08, 20 KiB 3.96, 40 KiB 4.07, 80 KiB 4.45 (one thread
// 9.56 / 6.54 / 6.23 / 6.48 / 6.66); session 17's 0.3-2.5 KiB gained nothing. A prefetch
// never faults, so asking past the end of a matrix is harmless (in the engine that is mostly
// the next matrix, which the step reads next anyway). Into L2 (locality 2, prefetcht1), not
// L1: a core keeps few L1 misses in flight. Measured on a Zen 4 host, one process, builds
// alternating, 2 threads, prefetcht0 -> prefetcht1: the Q8_0 LM head at 1 row 1.03 -> 0.75
// ms (x86-64-v3 build 1.52 -> 0.98), at 2 rows 1.48 -> 1.15; the 120 layer matmuls at 1 row
// 3.94 -> 3.77 ms (v3 3.80 -> 3.55); 8 and 32 rows (compute-bound) unchanged.
constexpr int64_t kPrefetchAhead = 20 * 1024;

// Prefetches `bytes` bytes starting kPrefetchAhead past p.
inline void prefetch_ahead(const uint8_t* p, int64_t bytes) {
  const uintptr_t at = reinterpret_cast<uintptr_t>(p) + kPrefetchAhead;
  for (int64_t i = 0; i < bytes; i += 64)
    __builtin_prefetch(reinterpret_cast<const void*>(at + i), 0, 2);
}

// kRegLanes bytes widened to int32 lanes, zero-extended (T = uint8_t) or sign-extended
// (T = int8_t). Spelled out per ISA: GCC scalarizes the generic conversion.
template <typename T>
inline IReg widen(const T* p) {
  constexpr bool kSigned = std::is_signed_v<T>;
  IReg wide;
#if defined(__AVX512F__)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m512i v = kSigned ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes);
  std::memcpy(&wide, &v, sizeof(wide));
#elif defined(__AVX2__)
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m256i v = kSigned ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes);
  std::memcpy(&wide, &v, sizeof(wide));
#else
  for (int64_t i = 0; i < kRegLanes; ++i) wide[i] = p[i];
#endif
  return wide;
}

inline Reg to_float(IReg v) { return __builtin_convertvector(v, Reg); }

inline float half_at(const uint8_t* p) {
  at::Half h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(h);
}

// kRegLanes float16 values (the scales of one register slice) as float32, exactly.
inline Reg load_half_reg(const uint8_t* p) {
  Reg out;
#if defined(__AVX512F__)
  const __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  std::memcpy(&out, &v, sizeof(out));
#elif defined(__AVX2__) && defined(__F16C__)
  const __m256 v = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  std::memcpy(&out, &v, sizeof(out));
#else
  for (int64_t i = 0; i < kRegLanes; ++i) out[i] = half_at(p + i * kScaleBytes);
#endif
  return out;
}

// A group's weights for the register slice s (features s * kRegLanes ...): dequantized one
// position at a time, `weight(j)` for j in [0, 32).
template <Format F>
struct Slice;

template <>
struct Slice<Format::kQ8_0> {
  Reg d;
  const int8_t* codes;
  Slice(const uint8_t* group, int64_t s)
      : d(load_half_reg(group + s * kRegLanes * kScaleBytes)),
        codes(reinterpret_cast<const int8_t*>(group + kQ8CodesOffset) + s * kRegLanes) {}
  Reg low(int64_t j) const { return d * to_float(widen(codes + j * kLanes)); }
  Reg high(int64_t j) const { return low(j + kLanes); }
};

template <>
struct Slice<Format::kQ4_1> {
  Reg d, m;
  const uint8_t* codes;
  Slice(const uint8_t* group, int64_t s)
      : d(load_half_reg(group + s * kRegLanes * kScaleBytes)),
        m(load_half_reg(group + (kLanes + s * kRegLanes) * kScaleBytes)),
        codes(group + kQ4CodesOffset + s * kRegLanes) {}
  // Positions 0-15 are the low nibbles, 16-31 the high ones of the same bytes.
  Reg low(int64_t j) const { return d * to_float(widen(codes + j * kLanes) & 15) + m; }
  Reg high(int64_t j) const { return d * to_float(widen(codes + j * kLanes) >> 4) + m; }
};

// Dequantizes 16 output features x all inputs (`blocks` packed groups from `group`) into
// buf[k * kPanel + lane_offset + n].
template <Format F>
void dequantize_16(const uint8_t* group, int64_t blocks, float* buf, int64_t lane_offset) {
  constexpr int64_t group_bytes = F == Format::kQ4_1 ? kQ4GroupBytes : kQ8GroupBytes;
  for (int64_t b = 0; b < blocks; ++b, group += group_bytes) {
    float* out = buf + b * kBlock * kPanel + lane_offset;
    for (int64_t s = 0; s < kSub; ++s) {
      const Slice<F> slice(group, s);
      for (int64_t j = 0; j < kLanes; ++j) {
        store_reg(out + j * kPanel + s * kRegLanes, slice.low(j));
        store_reg(out + (j + kLanes) * kPanel + s * kRegLanes, slice.high(j));
      }
    }
  }
}

// out[r, c0 : c0 + C * kRegLanes] = x[r, :] . panel[:, c0 : ...] for R rows; panel [K][32].
template <int64_t R, int64_t C>
void tile(const float* x, int64_t x_stride, int64_t k_len, const float* panel, int64_t c0,
          float* out, int64_t out_stride) {
  Reg acc[R][C] = {};
  const float* w = panel + c0;
  for (int64_t k = 0; k < k_len; ++k, w += kPanel) {
    Reg wc[C];
    for (int64_t c = 0; c < C; ++c) wc[c] = load_reg(w + c * kRegLanes);
    for (int64_t r = 0; r < R; ++r) {
      const float xr = x[r * x_stride + k];
      for (int64_t c = 0; c < C; ++c) acc[r][c] += xr * wc[c];
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) store_reg(out + r * out_stride + c0 + c * kRegLanes, acc[r][c]);
}

// out[r, 0:valid] = x[r, :] . panel for R rows (R <= kRows); valid is 32, or 16 for a last
// panel of 16 features.
template <int64_t R>
void rows_times_panel(const float* x, int64_t x_stride, int64_t k_len, const float* panel,
                      float* out, int64_t out_stride, int64_t valid) {
  for (int64_t c0 = 0; c0 < valid; c0 += kTileWidth) {
    if (valid - c0 >= kTileWidth)
      tile<R, kTileRegs>(x, x_stride, k_len, panel, c0, out, out_stride);
    else  // AVX-512's half tile: the last 16 features
      tile<R, kSub>(x, x_stride, k_len, panel, c0, out, out_stride);
  }
}

template <int64_t R>
void tail(const float* x, int64_t x_stride, int64_t k_len, const float* panel, float* out,
          int64_t out_stride, int64_t valid, int64_t rows) {
  if constexpr (R > 0) {
    if (rows == R) return rows_times_panel<R>(x, x_stride, k_len, panel, out, out_stride, valid);
    tail<R - 1>(x, x_stride, k_len, panel, out, out_stride, valid, rows);
  }
}

// out[r, 16 features] for R rows straight from one group column (16 output features x all
// blocks): each weight is dequantized into a register and used at once, no panel buffer. For a
// few rows (a decode step) the panel's store and reload were most of the work; the weights
// must stream from memory anyway. The products are summed in the same order (k = 0, 1, ...)
// with the same multiply-adds as `tile`, so a row gets the same bits either way.
//
// S of the group's kSub register slices a pass, each broadcast of x feeding S multiply-adds.
// One slice a pass leaves R accumulator chains of one multiply-add a position, and at R <= 4
// the loop waits on the FMA's latency: on AVX2 (two slices a group) both slices at once
// multiplied 3-4 rows 1.27-1.32x faster (SmolLM2's layer matmuls and LM head, v3 builds taking
// turns in one process on a Zen 4 host); at 8 rows the 16 accumulators would not fit the 16
// ymm registers, and one slice a pass stays (two passes of 4 rows were 8 % slower).
template <int64_t R>
constexpr int64_t slices_per_pass() {
  return kSub > 1 && R * kSub <= 8 ? kSub : 1;
}

template <Format F, size_t... I>
inline std::array<Slice<F>, sizeof...(I)> slices_from(const uint8_t* group, int64_t s0,
                                                      std::index_sequence<I...>) {
  return {Slice<F>(group, s0 + static_cast<int64_t>(I))...};
}

template <Format F, int64_t R>
void few_rows_times_group(const float* x, int64_t x_stride, const uint8_t* group,
                          int64_t blocks, float* out, int64_t out_stride) {
  constexpr int64_t group_bytes = F == Format::kQ4_1 ? kQ4GroupBytes : kQ8GroupBytes;
  constexpr int64_t S = slices_per_pass<R>();
  for (int64_t s0 = 0; s0 < kSub; s0 += S) {
    Reg acc[R][S] = {};
    const uint8_t* g = group;
    for (int64_t b = 0; b < blocks; ++b, g += group_bytes) {
      const float* xb = x + b * kBlock;
      if (s0 == 0) prefetch_ahead(g, group_bytes);  // the later slices find it in L1/L2
      const auto slices = slices_from<F>(g, s0, std::make_index_sequence<S>{});
      for (int64_t j = 0; j < kLanes; ++j) {
        Reg w[S];
        for (int64_t s = 0; s < S; ++s) w[s] = slices[s].low(j);
        for (int64_t r = 0; r < R; ++r) {
          const float xr = xb[r * x_stride + j];
          for (int64_t s = 0; s < S; ++s) acc[r][s] += xr * w[s];
        }
      }
      for (int64_t j = 0; j < kLanes; ++j) {
        Reg w[S];
        for (int64_t s = 0; s < S; ++s) w[s] = slices[s].high(j);
        for (int64_t r = 0; r < R; ++r) {
          const float xr = xb[r * x_stride + kLanes + j];
          for (int64_t s = 0; s < S; ++s) acc[r][s] += xr * w[s];
        }
      }
    }
    for (int64_t r = 0; r < R; ++r)
      for (int64_t s = 0; s < S; ++s)
        store_reg(out + r * out_stride + (s0 + s) * kRegLanes, acc[r][s]);
  }
}

template <Format F, int64_t R>
void few_rows_chunk(const float* x, int64_t x_stride, const uint8_t* group, int64_t blocks,
                    float* out, int64_t out_stride, int64_t rows) {
  if constexpr (R > 0) {
    if (rows == R) return few_rows_times_group<F, R>(x, x_stride, group, blocks, out, out_stride);
    few_rows_chunk<F, R - 1>(x, x_stride, group, blocks, out, out_stride, rows);
  }
}

// Up to kFewRows rows, kFewRowsChunk at a time (what the registers hold).
template <Format F>
void few_rows(const float* x, int64_t x_stride, const uint8_t* group, int64_t blocks,
              float* out, int64_t out_stride, int64_t rows) {
  for (int64_t r = 0; r < rows; r += kFewRowsChunk)
    few_rows_chunk<F, kFewRowsChunk>(x + r * x_stride, x_stride, group, blocks,
                                     out + r * out_stride, out_stride,
                                     std::min(kFewRowsChunk, rows - r));
}

// One or two rows (the decode step of one or two sequences): here the float path is bound by
// instructions, not memory (at 1 row, 8 weights took widen, mask, convert, d * q + m and the
// multiply-add: 13 G weights/s a core on AVX2, ~10 GB/s of packed weights). So a block's
// products are summed over the codes as floats, and the block's scale is applied once:
//   sum_k (d q_k + m) x_k = d * sum_k q_k x_k + m * sum_k x_k,
// which drops d * q + m from every weight (1.5x faster on AVX2, measured on SmolLM2's shapes).
// The sum of x over each block is taken once per call. It is not the other paths' arithmetic
// (those multiply by the dequantized float32 weight), so a row's bits on this path differ
// from the many-row paths' by float32 rounding (~3e-7 relative against a float64 product,
// against ~7e-7 for the other order); a row's result does not depend on the other row.
// The positions j and j + 16 of a block (one Q4_1 byte's two codes) go to separate
// accumulators, and G groups x kSub slices x R rows of them are multiplied side by side, so
// 8 independent chains keep the FMA units busy on AVX2.
// On AVX-512 one group a pass (G = 1) is fastest: G is also how many weight streams (one per
// group, `blocks` groups apart) a thread reads at once, and fewer streams read faster there.
// Measured on an AVX-512 host (Zen 4, 2 threads, one process, the builds taking turns), the
// 120 layer matmuls / the Q8_0 LM head at 1 row: G = 4 (the AVX2 rule) 3.43 / 1.40 ms, G = 2
// 3.14 / 1.23, G = 1 2.78 / 0.86; at 2 rows G = 2 4.79 / 1.45, G = 1 4.38 / 1.22. The v3 build
// on the same host keeps G = 2 at 1 row (G = 1: layers 3.92 vs 3.65 ms).
constexpr int64_t kNarrowRows = 2;
constexpr int64_t kNarrowChains = 4;  // x 2 halves: accumulators fit 16 ymm on AVX2

template <int64_t R>
constexpr int64_t narrow_groups() {
#if defined(__AVX512F__)
  return 1;
#else
  return std::max<int64_t>(1, kNarrowChains / (kSub * R));
#endif
}

// The codes of positions j (low) and j + 16 (high) of a block for one register slice, as
// floats.
struct CodePair {
  Reg low, high;
};

template <Format F>
inline CodePair codes_at(const uint8_t* codes, int64_t j) {
  if constexpr (F == Format::kQ4_1) {
    const IReg c = widen(codes + j * kLanes);
    return {to_float(c & 15), to_float(c >> 4)};
  } else {
    const int8_t* q = reinterpret_cast<const int8_t*>(codes);
    return {to_float(widen(q + j * kLanes)), to_float(widen(q + (j + kLanes) * kLanes))};
  }
}

template <Format F, int64_t R, int64_t G>
void narrow_rows_times_groups(const float* x, int64_t x_stride, const float* x_sums,
                              const uint8_t* group, int64_t blocks, float* out,
                              int64_t out_stride) {
  constexpr int64_t group_bytes = F == Format::kQ4_1 ? kQ4GroupBytes : kQ8GroupBytes;
  constexpr int64_t codes_offset = F == Format::kQ4_1 ? kQ4CodesOffset : kQ8CodesOffset;
  const int64_t group_stride = blocks * group_bytes;
  Reg acc[G][kSub][R] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    const float* xb = x + b * kBlock;
    const uint8_t* gb = group + b * group_bytes;
    for (int64_t g = 0; g < G; ++g) prefetch_ahead(gb + g * group_stride, group_bytes);
    Reg low[G][kSub][R] = {}, high[G][kSub][R] = {};
    for (int64_t j = 0; j < kLanes; ++j) {
      for (int64_t g = 0; g < G; ++g) {
        for (int64_t s = 0; s < kSub; ++s) {
          const CodePair q = codes_at<F>(gb + g * group_stride + codes_offset + s * kRegLanes, j);
          for (int64_t r = 0; r < R; ++r) {
            low[g][s][r] += xb[r * x_stride + j] * q.low;
            high[g][s][r] += xb[r * x_stride + kLanes + j] * q.high;
          }
        }
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      for (int64_t s = 0; s < kSub; ++s) {
        const uint8_t* scales = gb + g * group_stride;
        const Reg d = load_half_reg(scales + s * kRegLanes * kScaleBytes);
        for (int64_t r = 0; r < R; ++r) acc[g][s][r] += d * (low[g][s][r] + high[g][s][r]);
        if constexpr (F == Format::kQ4_1) {
          const Reg m = load_half_reg(scales + (kLanes + s * kRegLanes) * kScaleBytes);
          for (int64_t r = 0; r < R; ++r) acc[g][s][r] += m * x_sums[r * blocks + b];
        }
      }
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t s = 0; s < kSub; ++s)
      for (int64_t r = 0; r < R; ++r)
        store_reg(out + r * out_stride + g * kLanes + s * kRegLanes, acc[g][s][r]);
}

template <Format F, int64_t R>
void narrow_rows(const float* xp, int64_t x_stride, const uint8_t* wp, int64_t blocks,
                 int64_t n_len, float* op) {
  constexpr int64_t G = narrow_groups<R>();
  constexpr int64_t group_bytes = F == Format::kQ4_1 ? kQ4GroupBytes : kQ8GroupBytes;
  // Each block's sum of x, in a fixed order (Q4_1's m term; Q8_0 has none).
  std::vector<float> x_sums(F == Format::kQ4_1 ? R * blocks : 0);
  if constexpr (F == Format::kQ4_1) {
    for (int64_t r = 0; r < R; ++r)
      for (int64_t b = 0; b < blocks; ++b) {
        float sum = 0.f;
        for (int64_t k = 0; k < kBlock; ++k) sum += xp[r * x_stride + b * kBlock + k];
        x_sums[r * blocks + b] = sum;
      }
  }
  const int64_t groups = n_len / kLanes;
  at::parallel_for(0, groups / G, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c)
      narrow_rows_times_groups<F, R, G>(xp, x_stride, x_sums.data(),
                                        wp + c * G * blocks * group_bytes, blocks,
                                        op + c * G * kLanes, n_len);
  });
  for (int64_t g = groups / G * G; g < groups; ++g)  // a last G - 1 groups at most
    narrow_rows_times_groups<F, R, 1>(xp, x_stride, x_sums.data(),
                                      wp + g * blocks * group_bytes, blocks, op + g * kLanes,
                                      n_len);
}

// x rows [m_len, k_len] (stride x_stride) times the packed weight into out [m_len, n_len].
// `register_rows` > 0: calls of up to that many rows take the register path (a choice the
// engine's matmul plan measures per host and shape); 0: `register_path`'s built-in rule.
template <Format F>
void multiply(const float* xp, int64_t x_stride, int64_t m_len, int64_t k_len,
              const uint8_t* wp, int64_t blocks, int64_t n_len, float* op,
              int64_t register_rows) {
  constexpr int64_t group_bytes = F == Format::kQ4_1 ? kQ4GroupBytes : kQ8GroupBytes;
  static_assert(kNarrowRows == 2, "narrow_rows is instantiated for 1 and 2 rows");
  if (m_len == 1) return narrow_rows<F, 1>(xp, x_stride, wp, blocks, n_len, op);
  if (m_len == 2) return narrow_rows<F, 2>(xp, x_stride, wp, blocks, n_len, op);
  if (register_rows > 0 ? m_len <= register_rows : register_path(m_len)) {
    at::parallel_for(0, n_len / kLanes, 4, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g)
        few_rows<F>(xp, x_stride, wp + g * blocks * group_bytes, blocks, op + g * kLanes,
                    n_len, m_len);
    });
    return;
  }
  const int64_t panels = (n_len + kPanel - 1) / kPanel;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    // Not zero-filled: dequantization writes every float the products read, except the upper
    // half of a last panel of 16 features, which no tile reads.
    std::unique_ptr<float[]> buf(new float[k_len * kPanel]);
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n0 = p * kPanel, valid = std::min(kPanel, n_len - n0);
      for (int64_t half = 0; half * kLanes < valid; ++half)
        dequantize_16<F>(wp + (n0 / kLanes + half) * blocks * group_bytes, blocks, buf.get(),
                         half * kLanes);
      int64_t r = 0;
      for (; r + kRows <= m_len; r += kRows)
        rows_times_panel<kRows>(xp + r * x_stride, x_stride, k_len, buf.get(),
                                op + r * n_len + n0, n_len, valid);
      if (r < m_len)
        tail<kRows - 1>(xp + r * x_stride, x_stride, k_len, buf.get(), op + r * n_len + n0,
                        n_len, valid, m_len - r);
    }
  });
}

// Re-lays out a GGUF matrix of `block_bytes`-byte blocks ([N, K / 32 * block_bytes] uint8)
// into uint8 [N / 16, K / 32, group_bytes]: `fill(group, block, n)` writes output feature n's
// block into its (16 outputs, one block) group.
template <typename Fill>
torch::Tensor pack_groups(const torch::Tensor& raw, int64_t k_len, int64_t block_bytes,
                          int64_t group_bytes, const char* fn, Fill fill) {
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte && raw.is_contiguous(), fn,
              ": raw must be a contiguous uint8 [N, K / 32 * ", block_bytes, "] tensor");
  const int64_t blocks = k_len / kBlock;
  TORCH_CHECK(k_len % kBlock == 0 && raw.size(1) == blocks * block_bytes, fn,
              ": K must be a multiple of 32 and each row K / 32 blocks of ", block_bytes,
              " bytes");
  TORCH_CHECK(raw.size(0) % kLanes == 0, fn, ": N must be a multiple of 16");
  const int64_t groups = raw.size(0) / kLanes;
  torch::Tensor packed = torch::empty({groups, blocks, group_bytes}, raw.options());
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  for (int64_t p = 0; p < groups; ++p)
    for (int64_t b = 0; b < blocks; ++b)
      for (int64_t n = 0; n < kLanes; ++n)
        fill(dst + (p * blocks + b) * group_bytes,
             src + ((p * kLanes + n) * blocks + b) * block_bytes, n);
  return packed;
}

// -- 8-bit activations (opt-in): a few rows times Q4_1 in integer arithmetic ---------------
//
// The float path above spends ~4 vector instructions on every 8 weights at 1 row (widen,
// mask, convert, multiply-add); at ~20 G weights/s a core that is close to what memory gives
// a 2-core AVX2 host, so this path gains less than it did (1.3-1.7x before the float path
// applied block scales once, 1.1-1.25x after; with both prefetching their weights, 0.86-0.90x
// at 1 row and 1.04-1.05x at 2: memory bounds both). Here each row is first quantized per
// 32-input block (x ~= dx * qx, qx int8, dx = max|x| / 127, as llama.cpp's Q8 activations)
// and a block's products are summed as integers, 32 weights per instruction (`maddubs`: the
// 4-bit codes are unsigned, qx signed):
//   sum_k (d q_k + m) x_k ~= d * dx * sum_k q_k qx_k + m * dx * sum_k qx_k.
// The second sum is taken over the rounded x too, not the exact one: Q4_1's m is about -8 d,
// so the weights d q + m are centred where d q alone is not, and the rounding errors of x
// cancel against the whole weight (0.5 % vs 1.6 % relative error on a SmolLM2 MLP row, measured).
// Not the float path's numbers (the rounding of x to 8 bits is what llama.cpp's decode pays
// too), so it is opt-in and judged by logit tolerance and greedy agreement; each row's result
// depends only on that row.
constexpr int64_t kQ8ActMaxRows = 2;

// One row's quantized activations: for block b and j in [0, 16), pairs[b * 16 + j] holds
// qx[32b + j] in its low byte and qx[32b + j + 16] in its high one (the two positions one
// packed Q4_1 byte holds the codes of); dx[b] the scale and sx[b] = dx[b] * sum of qx.
struct Q8Row {
  std::vector<int16_t> pairs;
  std::vector<float> dx, sx;
};

Q8Row quantize_row(const float* x, int64_t blocks) {
  Q8Row q{std::vector<int16_t>(blocks * kLanes), std::vector<float>(blocks),
          std::vector<float>(blocks)};
  for (int64_t b = 0; b < blocks; ++b) {
    const float* xb = x + b * kBlock;
    float amax = 0.f;
    for (int64_t k = 0; k < kBlock; ++k) amax = std::max(amax, std::fabs(xb[k]));
    const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
    int8_t qx[kBlock];
    int32_t sum = 0;
    for (int64_t k = 0; k < kBlock; ++k) {
      qx[k] = static_cast<int8_t>(std::max(-127.f, std::min(127.f, std::nearbyint(xb[k] * id))));
      sum += qx[k];
    }
    for (int64_t j = 0; j < kLanes; ++j)
      q.pairs[b * kLanes + j] = static_cast<int16_t>(
          static_cast<uint16_t>(static_cast<uint8_t>(qx[j])) |
          static_cast<uint16_t>(static_cast<uint8_t>(qx[j + kLanes]) << 8));
    q.dx[b] = d;
    q.sx[b] = d * static_cast<float>(sum);
  }
  return q;
}

// out[r, 16 features of one group] for R rows.
template <int64_t R>
void q4_group_q8(const Q8Row* rows, const uint8_t* group, int64_t blocks, float* out,
                 int64_t out_stride) {
#if defined(__AVX2__) && defined(__F16C__)
  __m256 acc[R][2];
  for (int64_t r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const __m128i low4 = _mm_set1_epi8(0x0F);
  for (int64_t b = 0; b < blocks; ++b, group += kQ4GroupBytes) {
    prefetch_ahead(group, kQ4GroupBytes);
    const uint8_t* codes = group + kQ4CodesOffset;
    __m256i wide[R][2];
    for (int64_t r = 0; r < R; ++r) wide[r][0] = wide[r][1] = _mm256_setzero_si256();
    // 8 positions' products at most in int16 (8 x 2 x 15 x 127 < 2^15), then widened.
    for (int64_t half = 0; half < 2; ++half) {
      __m256i sum[R];
      for (int64_t r = 0; r < R; ++r) sum[r] = _mm256_setzero_si256();
      for (int64_t j = half * 8; j < half * 8 + 8; ++j) {
        const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + j * kLanes));
        const __m128i lo = _mm_and_si128(c, low4);
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(c, 4), low4);
        // Feature f's codes for positions j and j + 16 side by side, features 0-15.
        const __m256i w = _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi));
        for (int64_t r = 0; r < R; ++r)
          sum[r] = _mm256_add_epi16(
              sum[r], _mm256_maddubs_epi16(w, _mm256_set1_epi16(rows[r].pairs[b * kLanes + j])));
      }
      for (int64_t r = 0; r < R; ++r) {
        wide[r][0] = _mm256_add_epi32(wide[r][0],
                                      _mm256_cvtepi16_epi32(_mm256_castsi256_si128(sum[r])));
        wide[r][1] = _mm256_add_epi32(wide[r][1],
                                      _mm256_cvtepi16_epi32(_mm256_extracti128_si256(sum[r], 1)));
      }
    }
    for (int64_t r = 0; r < R; ++r) {
      const __m256 dx = _mm256_set1_ps(rows[r].dx[b]), sx = _mm256_set1_ps(rows[r].sx[b]);
      for (int64_t h = 0; h < 2; ++h) {
        const __m256 d = _mm256_cvtph_ps(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(group + h * 8 * kScaleBytes)));
        const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(
            reinterpret_cast<const __m128i*>(group + (kLanes + h * 8) * kScaleBytes)));
        acc[r][h] = _mm256_fmadd_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(wide[r][h]),
                                    acc[r][h]);
        acc[r][h] = _mm256_fmadd_ps(m, sx, acc[r][h]);
      }
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t h = 0; h < 2; ++h) _mm256_storeu_ps(out + r * out_stride + h * 8, acc[r][h]);
#else
  // The same integer sums and the same float epilogue, one feature at a time.
  for (int64_t r = 0; r < R; ++r) {
    float acc[kLanes] = {};
    const uint8_t* g = group;
    for (int64_t b = 0; b < blocks; ++b, g += kQ4GroupBytes) {
      const uint8_t* codes = g + kQ4CodesOffset;
      for (int64_t f = 0; f < kLanes; ++f) {
        int32_t total = 0;
        for (int64_t j = 0; j < kLanes; ++j) {
          const uint16_t pair = static_cast<uint16_t>(rows[r].pairs[b * kLanes + j]);
          const int8_t x0 = static_cast<int8_t>(pair & 0xFF), x1 = static_cast<int8_t>(pair >> 8);
          total += (codes[j * kLanes + f] & 15) * x0 + (codes[j * kLanes + f] >> 4) * x1;
        }
        const float d = half_at(g + f * kScaleBytes), m = half_at(g + (kLanes + f) * kScaleBytes);
        acc[f] = std::fma(d * rows[r].dx[b], static_cast<float>(total), acc[f]);
        acc[f] = std::fma(m, rows[r].sx[b], acc[f]);
      }
    }
    std::memcpy(out + r * out_stride, acc, sizeof(acc));
  }
#endif
}

template <int64_t R>
void q4_rows_q8(const Q8Row* rows, const uint8_t* wp, int64_t blocks, int64_t n_len, float* op) {
  at::parallel_for(0, n_len / kLanes, 4, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      q4_group_q8<R>(rows, wp + g * blocks * kQ4GroupBytes, blocks, op + g * kLanes, n_len);
  });
}

// x must be float32 [M, K] with contiguous rows, packed from q4_1_pack or q8_0_pack for K
// inputs; `fn` names the caller in the error.
void check_operands(const torch::Tensor& x, const torch::Tensor& packed, const char* fn) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, fn,
              ": x must be a float32 [M, K] tensor with contiguous rows");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  (packed.size(2) == kQ4GroupBytes || packed.size(2) == kQ8GroupBytes),
              fn, ": packed must come from q4_1_pack or q8_0_pack");
  TORCH_CHECK(packed.size(1) * kBlock == x.size(1), fn, ": x has ", x.size(1),
              " columns, the weight ", packed.size(1) * kBlock);
}

// -- 16-bit activations (opt-in): Q4_1 / Q8_0 times rows in integer arithmetic ------------
//
// From ~8 rows a step's weight matmuls run at the host's float32 FMA peak (the paths above),
// so only arithmetic that does more per instruction goes faster. Here each row is rounded to
// 16 bits per 32-input block (x ~= dx * qx, qx int16, dx = max|x| / 32767: an error of at
// most ~1.5e-5 of the block's largest input, ~250x finer than llama.cpp's 8-bit activations)
// and the codes (4-bit unsigned or 8-bit signed, exact as int16) are multiplied by it in
// pairs: one `dpwssd` (AVX-512 VNNI) does 2 products and their sum in every 32-bit lane, twice
// a float32 FMA's work (`madd` + add elsewhere). A block's integer sums are exact; its scales
// are applied once per block and row:
//   sum_k (d q_k + m) x_k ~= dx * d * sum_k q_k qx_k + m * dx * sum_k qx_k
// (the second sum over the rounded x, as in the 8-bit path, so that rounding errors cancel
// against the whole, centred weight). Not the float32 weights' products, so opt-in: logits
// move ~7e-3 (tests/integration/test_hf_parity.py). Each row's result depends only on that
// row, and is the same on the register path (`i16_few_rows`: codes widened in registers, used
// at once) and on the panels (`I16Panel`: a thread widens 32 output features once and
// multiplies every row tile of the call by them).
//
// The two positions of a pair are a block's j and j + 16 (one Q4_1 byte's two codes).
constexpr int64_t kPairs = kBlock / 2;

// Rows rounded to 16 bits: for row r, block b and j in [0, 16), pairs[(r * blocks + b) * 16
// + j] holds qx[32b + j] in its low half and qx[32b + j + 16] in its high half; dx[r * blocks
// + b] the block's scale, sx the same times its sum of qx.
struct I16Rows {
  std::vector<int32_t> pairs;
  std::vector<float> dx, sx;
};

// kRegLanes floats rounded to the nearest integer (ties to even, as std::nearbyint).
inline IReg round_to_int(Reg v) {
#if defined(__AVX512F__)
  return (IReg)_mm512_cvtps_epi32((__m512)v);
#elif defined(__AVX2__)
  return (IReg)_mm256_cvtps_epi32((__m256)v);
#else
  return (IReg)_mm_cvtps_epi32((__m128)v);
#endif
}

I16Rows quantize_rows_i16(const float* x, int64_t x_stride, int64_t m_len, int64_t blocks) {
  constexpr int64_t kBlockRegs = kBlock / kRegLanes;
  I16Rows q{std::vector<int32_t>(m_len * blocks * kPairs), std::vector<float>(m_len * blocks),
            std::vector<float>(m_len * blocks)};
  at::parallel_for(0, m_len * blocks, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* xb = x + (i / blocks) * x_stride + (i % blocks) * kBlock;
      Reg v[kBlockRegs], amax = {};
      IReg finite = IReg{} - 1;
      for (int64_t s = 0; s < kBlockRegs; ++s) {
        v[s] = load_reg(xb + s * kRegLanes);
        const Reg a = (Reg)((IReg)v[s] & 0x7FFFFFFF);
        amax = a > amax ? a : amax;
        finite &= a <= std::numeric_limits<float>::max();  // false for inf and NaN
      }
      float top = 0.f;
      bool ok = true;
      for (int64_t l = 0; l < kRegLanes; ++l) {
        top = std::max(top, amax[l]);
        ok = ok && finite[l] != 0;
      }
      // A non-finite input makes the block's scale NaN, so it reaches the output as in the
      // float path instead of being rounded away.
      const float d = ok ? top / 32767.f : std::nanf(""), id = top > 0.f ? 32767.f / top : 0.f;
      IReg qx[kBlockRegs], sum = {};
      for (int64_t s = 0; s < kBlockRegs; ++s) {
        qx[s] = round_to_int(v[s] * (ok ? id : 0.f));  // |x| * id <= 32767 (+ rounding)
        sum += qx[s];
      }
      int32_t total = 0;
      for (int64_t l = 0; l < kRegLanes; ++l) total += sum[l];
      int32_t* pairs = q.pairs.data() + i * kPairs;
      for (int64_t s = 0; s < kBlockRegs / 2; ++s)
        *reinterpret_cast<IReg*>(pairs + s * kRegLanes) =
            (qx[s] & 0xFFFF) | (qx[s + kBlockRegs / 2] << 16);
      q.dx[i] = d;
      q.sx[i] = d * static_cast<float>(total);
    }
  });
  return q;
}

// acc + the sum of each 32-bit lane's two int16 products.
inline IReg dot_pairs(IReg acc, IReg a, IReg b) {
#if defined(__AVX512VNNI__)
  return (IReg)_mm512_dpwssd_epi32((__m512i)acc, (__m512i)a, (__m512i)b);
#elif defined(__AVX512BW__)
  return acc + (IReg)_mm512_madd_epi16((__m512i)a, (__m512i)b);
#elif defined(__AVX2__)
  return acc + (IReg)_mm256_madd_epi16((__m256i)a, (__m256i)b);
#else
  for (int64_t i = 0; i < kRegLanes; ++i)
    acc[i] += static_cast<int16_t>(a[i] & 0xFFFF) * static_cast<int16_t>(b[i] & 0xFFFF) +
              (a[i] >> 16) * (b[i] >> 16);
  return acc;
#endif
}

// One thread's panel of 32 output features: codes[(b * 16 + j) * 32 + n] the pair (j, j + 16)
// of block b for feature n; d and m (zero for Q8_0) [b * 32 + n] as float32.
struct I16Panel {
  std::vector<int32_t> codes;
  std::vector<float> d, m;
  explicit I16Panel(int64_t blocks)
      : codes(blocks * kPairs * kPanel), d(blocks * kPanel), m(blocks * kPanel) {}
};

// The pairs (j, j + 16) of one packed group's codes for register slice s (features
// s * kRegLanes ...) as two int16 per lane.
template <Format F>
inline IReg code_pairs(const uint8_t* group, int64_t j, int64_t s) {
  if constexpr (F == Format::kQ4_1) {
    // Low nibble to bits 0-3, high nibble to bits 16-19 (one AVX-512 ternary-logic op).
    const IReg c = widen(group + kQ4CodesOffset + j * kLanes + s * kRegLanes);
    return (c | (c << 12)) & 0x000F000F;
  } else {
    const int8_t* q = reinterpret_cast<const int8_t*>(group + kQ8CodesOffset);
    return (widen(q + j * kLanes + s * kRegLanes) & 0xFFFF) |
           (widen(q + (j + kPairs) * kLanes + s * kRegLanes) << 16);
  }
}

// The scales d and m (zero for Q8_0) of one packed group's register slice s, as float32.
template <Format F>
inline void scales_at(const uint8_t* group, int64_t s, Reg& d, Reg& m) {
  d = load_half_reg(group + s * kRegLanes * kScaleBytes);
  m = F == Format::kQ4_1 ? load_half_reg(group + (kLanes + s * kRegLanes) * kScaleBytes) : Reg{};
}

// A block's integer sums into the float accumulator: one expression for every path, so a row
// gets the same bits whichever path multiplies it.
template <Format F>
inline Reg add_block(Reg acc, IReg sums, float dx, float sx, Reg d, Reg m) {
  acc += to_float(sums) * dx * d;
  if constexpr (F == Format::kQ4_1) acc += m * sx;
  return acc;
}

// Widens 16 output features (`blocks` packed groups from `group`) into panel lanes
// [lane_offset, lane_offset + 16).
template <Format F>
void widen_i16(const uint8_t* group, int64_t blocks, I16Panel& panel, int64_t lane_offset) {
  constexpr int64_t group_bytes = F == Format::kQ4_1 ? kQ4GroupBytes : kQ8GroupBytes;
  for (int64_t b = 0; b < blocks; ++b, group += group_bytes) {
    for (int64_t s = 0; s < kSub; ++s) {
      const int64_t n = lane_offset + s * kRegLanes;
      Reg d, m;
      scales_at<F>(group, s, d, m);
      store_reg(panel.d.data() + b * kPanel + n, d);
      store_reg(panel.m.data() + b * kPanel + n, m);
      int32_t* out = panel.codes.data() + b * kPairs * kPanel + n;
      for (int64_t j = 0; j < kPairs; ++j)
        *reinterpret_cast<IReg*>(out + j * kPanel) = code_pairs<F>(group, j, s);
    }
  }
}

// out[r, 16 features of one group] for R rows (r0 ...), the codes widened in registers and
// used at once: for a few rows, widening a panel first cost more than it saved.
template <Format F, int64_t R>
void i16_few_rows(const I16Rows& x, int64_t r0, const uint8_t* group, int64_t blocks, float* out,
                  int64_t out_stride) {
  constexpr int64_t group_bytes = F == Format::kQ4_1 ? kQ4GroupBytes : kQ8GroupBytes;
  Reg acc[R][kSub] = {};
  for (int64_t b = 0; b < blocks; ++b, group += group_bytes) {
    prefetch_ahead(group, group_bytes);
    IReg sums[R][kSub] = {};
    const int32_t* xp = x.pairs.data() + (r0 * blocks + b) * kPairs;
    for (int64_t j = 0; j < kPairs; ++j) {
      IReg w[kSub];
      for (int64_t s = 0; s < kSub; ++s) w[s] = code_pairs<F>(group, j, s);
      for (int64_t r = 0; r < R; ++r) {
        const IReg xr = IReg{} + xp[r * blocks * kPairs + j];
        for (int64_t s = 0; s < kSub; ++s) sums[r][s] = dot_pairs(sums[r][s], w[s], xr);
      }
    }
    for (int64_t s = 0; s < kSub; ++s) {
      Reg d, m;
      scales_at<F>(group, s, d, m);
      for (int64_t r = 0; r < R; ++r) {
        const int64_t i = (r0 + r) * blocks + b;
        acc[r][s] = add_block<F>(acc[r][s], sums[r][s], x.dx[i], x.sx[i], d, m);
      }
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t s = 0; s < kSub; ++s)
      store_reg(out + (r0 + r) * out_stride + s * kRegLanes, acc[r][s]);
}

template <Format F, int64_t R>
void i16_few_rows_chunk(const I16Rows& x, int64_t r0, int64_t rows, const uint8_t* group,
                        int64_t blocks, float* out, int64_t out_stride) {
  if constexpr (R > 0) {
    if (rows == R) return i16_few_rows<F, R>(x, r0, group, blocks, out, out_stride);
    i16_few_rows_chunk<F, R - 1>(x, r0, rows, group, blocks, out, out_stride);
  }
}

// out[r, c0 : c0 + C * kRegLanes] for R rows (rows r0 ...) of the quantized x.
template <Format F, int64_t R, int64_t C>
void i16_tile(const I16Rows& x, int64_t r0, int64_t blocks, const I16Panel& panel, int64_t c0,
              float* out, int64_t out_stride) {
  Reg acc[R][C] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    IReg sums[R][C] = {};
    const int32_t* w = panel.codes.data() + b * kPairs * kPanel + c0;
    const int32_t* xp = x.pairs.data() + (r0 * blocks + b) * kPairs;
    for (int64_t j = 0; j < kPairs; ++j, w += kPanel) {
      IReg wc[C];
      for (int64_t c = 0; c < C; ++c) wc[c] = *reinterpret_cast<const IReg*>(w + c * kRegLanes);
      for (int64_t r = 0; r < R; ++r) {
        const IReg xr = IReg{} + xp[r * blocks * kPairs + j];
        for (int64_t c = 0; c < C; ++c) sums[r][c] = dot_pairs(sums[r][c], wc[c], xr);
      }
    }
    for (int64_t c = 0; c < C; ++c) {
      const Reg d = load_reg(panel.d.data() + b * kPanel + c0 + c * kRegLanes);
      const Reg m = load_reg(panel.m.data() + b * kPanel + c0 + c * kRegLanes);
      for (int64_t r = 0; r < R; ++r) {
        const int64_t i = (r0 + r) * blocks + b;
        acc[r][c] = add_block<F>(acc[r][c], sums[r][c], x.dx[i], x.sx[i], d, m);
      }
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c)
      store_reg(out + (r0 + r) * out_stride + c0 + c * kRegLanes, acc[r][c]);
}

// Rows of a panel tile: on AVX-512 VNNI 4, 6 and 8 rows took 27.1 / 27.2 / 27.5 ms at 32
// rows and 49.3 / 49.8 / 50.7 at 64 (SmolLM2's layer matmuls, 2 threads); on AVX2 the
// accumulators of 3 rows x 2 registers x (int + float) already fill the 16 ymm.
#if defined(__AVX512F__)
constexpr int64_t kI16Rows = 4;
#else
constexpr int64_t kI16Rows = 3;
#endif

template <Format F, int64_t R>
void i16_rows(const I16Rows& x, int64_t r0, int64_t rows, int64_t blocks, const I16Panel& panel,
              int64_t valid, float* out, int64_t out_stride) {
  if constexpr (R > 0) {
    if (rows != R) return i16_rows<F, R - 1>(x, r0, rows, blocks, panel, valid, out, out_stride);
    for (int64_t c0 = 0; c0 < valid; c0 += kTileWidth) {
      if (valid - c0 >= kTileWidth)
        i16_tile<F, R, kTileRegs>(x, r0, blocks, panel, c0, out, out_stride);
      else
        i16_tile<F, R, kSub>(x, r0, blocks, panel, c0, out, out_stride);
    }
  }
}

// Up to kI16FewRows rows take the register path (`i16_few_rows`), kI16FewChunk at a time.
// Measured on SmolLM2's 120 layer matmuls and LM head, 2 threads, one process, builds taking
// turns (Zen 4): with AVX-512 VNNI, register / panel time at 8 rows 6.0 / 10.6 ms, 16: 11.2 /
// 15.8, 32: 24.9 / 27.3, 64: 49.5 / 60.0 (a slow phase), 256: 238 / 223; on the x86-64-v3
// build (AVX2), chunks of 4 vs 3: 8 rows 12.9 vs 14.0 ms, 16: 24.6 vs 29.9, and at 64 rows
// the panels (78.8) beat it (92.1).
#if defined(__AVX512F__)
constexpr int64_t kI16FewRows = 64, kI16FewChunk = 8;
#else
constexpr int64_t kI16FewRows = 16, kI16FewChunk = 4;
#endif

template <Format F>
void multiply_i16(const I16Rows& x, int64_t m_len, const uint8_t* wp, int64_t blocks,
                  int64_t n_len, float* op) {
  constexpr int64_t group_bytes = F == Format::kQ4_1 ? kQ4GroupBytes : kQ8GroupBytes;
  if (m_len <= kI16FewRows) {
    at::parallel_for(0, n_len / kLanes, 4, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g)
        for (int64_t r = 0; r < m_len; r += kI16FewChunk)
          i16_few_rows_chunk<F, kI16FewChunk>(x, r, std::min(kI16FewChunk, m_len - r),
                                              wp + g * blocks * group_bytes, blocks,
                                              op + g * kLanes, n_len);
    });
    return;
  }
  const int64_t panels = (n_len + kPanel - 1) / kPanel;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    I16Panel panel(blocks);
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n0 = p * kPanel, valid = std::min(kPanel, n_len - n0);
      for (int64_t half = 0; half * kLanes < valid; ++half)
        widen_i16<F>(wp + (n0 / kLanes + half) * blocks * group_bytes, blocks, panel,
                     half * kLanes);
      for (int64_t r = 0; r < m_len; r += kI16Rows)
        i16_rows<F, kI16Rows>(x, r, std::min(kI16Rows, m_len - r), blocks, panel, valid, op + n0,
                           n_len);
    }
  });
}

}  // namespace

// x: [M, K] float32 (rows may be strided); packed: from q4_1_pack. Returns ~x @ W^T, [M, N]
// float32, with x rounded to 8 bits per 32-input block (see above); rows are taken
// kQ8ActMaxRows at a time, so it is meant for a decode step's few rows.
torch::Tensor quant_matmul_q8(const torch::Tensor& x, const torch::Tensor& packed) {
  check_operands(x, packed, "quant_matmul_q8");
  TORCH_CHECK(packed.size(2) == kQ4GroupBytes,
              "quant_matmul_q8: packed must come from q4_1_pack (an 8-bit LM head gained 8 % "
              "this way, so only Q4_1 has this path)");
  const int64_t m_len = x.size(0), blocks = packed.size(1), n_len = packed.size(0) * kLanes;
  torch::Tensor out = torch::empty({m_len, n_len}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  for (int64_t r = 0; r < m_len; r += kQ8ActMaxRows) {
    const int64_t n_rows = std::min(kQ8ActMaxRows, m_len - r);
    Q8Row rows[kQ8ActMaxRows];
    for (int64_t i = 0; i < n_rows; ++i) rows[i] = quantize_row(xp + (r + i) * x.stride(0), blocks);
    if (n_rows == 2)
      q4_rows_q8<2>(rows, wp, blocks, n_len, op + r * n_len);
    else
      q4_rows_q8<1>(rows, wp, blocks, n_len, op + r * n_len);
  }
  return out;
}

// x: [M, K] float32 (rows may be strided); packed: from q4_1_pack or q8_0_pack. Returns
// ~x @ W^T, [M, N] float32, with x rounded to 16 bits per 32-input block (see above).
torch::Tensor quant_matmul_i16(const torch::Tensor& x, const torch::Tensor& packed) {
  check_operands(x, packed, "quant_matmul_i16");
  const int64_t m_len = x.size(0), blocks = packed.size(1), n_len = packed.size(0) * kLanes;
  torch::Tensor out = torch::empty({m_len, n_len}, x.options());
  if (m_len == 0) return out;
  const I16Rows rows = quantize_rows_i16(x.data_ptr<float>(), x.stride(0), m_len, blocks);
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  if (packed.size(2) == kQ4GroupBytes)
    multiply_i16<Format::kQ4_1>(rows, m_len, wp, blocks, n_len, out.data_ptr<float>());
  else
    multiply_i16<Format::kQ8_0>(rows, m_len, wp, blocks, n_len, out.data_ptr<float>());
  return out;
}

// Re-lays out a GGUF Q4_1 matrix ([N, K / 32 blocks of 20 bytes], uint8 [N, K / 32 * 20]) for
// `quant_matmul`: uint8 [N / 16, K / 32, kQ4GroupBytes]. N must be a multiple of 16, K of 32.
torch::Tensor q4_1_pack(const torch::Tensor& raw, int64_t k_len) {
  return pack_groups(raw, k_len, 20, kQ4GroupBytes, "q4_1_pack",
                     [](uint8_t* group, const uint8_t* block, int64_t n) {
                       std::memcpy(group + n * kScaleBytes, block, kScaleBytes);  // d
                       std::memcpy(group + (kLanes + n) * kScaleBytes, block + 2,
                                   kScaleBytes);  // m
                       for (int64_t j = 0; j < kLanes; ++j)
                         group[kQ4CodesOffset + j * kLanes + n] = block[4 + j];
                     });
}

// The same for a GGUF Q8_0 matrix (blocks of 34 bytes): uint8 [N / 16, K / 32, kQ8GroupBytes].
torch::Tensor q8_0_pack(const torch::Tensor& raw, int64_t k_len) {
  return pack_groups(raw, k_len, 34, kQ8GroupBytes, "q8_0_pack",
                     [](uint8_t* group, const uint8_t* block, int64_t n) {
                       std::memcpy(group + n * kScaleBytes, block, kScaleBytes);  // d
                       for (int64_t j = 0; j < kBlock; ++j)
                         group[kQ8CodesOffset + j * kLanes + n] = block[2 + j];
                     });
}

// x: [M, K] float32 (rows may be strided); packed: from q4_1_pack or q8_0_pack.
// Returns x @ W^T, [M, N] float32. `register_rows`: see `multiply`.
torch::Tensor quant_matmul(const torch::Tensor& x, const torch::Tensor& packed,
                           int64_t register_rows) {
  check_operands(x, packed, "quant_matmul");
  TORCH_CHECK(register_rows >= 0, "quant_matmul: register_rows must be >= 0 (0: the built-in "
              "choice), got ", register_rows);
  const int64_t m_len = x.size(0), k_len = x.size(1), blocks = packed.size(1);
  const int64_t n_len = packed.size(0) * kLanes;
  torch::Tensor out = torch::empty({m_len, n_len}, x.options());
  if (m_len == 0) return out;
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  if (packed.size(2) == kQ4GroupBytes)
    multiply<Format::kQ4_1>(xp, x.stride(0), m_len, k_len, wp, blocks, n_len, op, register_rows);
  else
    multiply<Format::kQ8_0>(xp, x.stride(0), m_len, k_len, wp, blocks, n_len, op, register_rows);
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q4_1_pack", &q4_1_pack, "Re-lay out a GGUF Q4_1 matrix for quant_matmul");
  m.def("q8_0_pack", &q8_0_pack, "Re-lay out a GGUF Q8_0 matrix for quant_matmul");
  m.def("quant_matmul", &quant_matmul, "x @ W^T with W packed from Q4_1 or Q8_0 (float32, CPU)",
        py::arg("x"), py::arg("packed"), py::arg("register_rows") = 0,
        py::call_guard<py::gil_scoped_release>());
  m.def("quant_matmul_q8", &quant_matmul_q8,
        "~x @ W^T with W packed from Q4_1 and x rounded to 8 bits per block (float32, CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("quant_matmul_i16", &quant_matmul_i16,
        "~x @ W^T with W packed from Q4_1 or Q8_0 and x rounded to 16 bits per block",
        py::call_guard<py::gil_scoped_release>());
}
