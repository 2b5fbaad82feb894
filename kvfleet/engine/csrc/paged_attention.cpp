// Attention straight from the paged KV cache: decode (one query token per sequence, many
// sequences per call) and prefill (one chunk of a prompt per call, causal).
//
// Decode:
// The SDPA path gathers every sequence's K and V blocks into a contiguous copy and then reads
// the copy: two passes over the cache per layer plus a write. Here each task (a sequence's
// grouped-query group of heads, or one query head when there are few sequences) walks its
// block table and reads the cached positions straight from the blocks. Per head: scores for
// every position, exact softmax (max subtracted), then the weighted sum of V, all in float32,
// with the query and the accumulators held in registers.
//
// Determinism: a task's arithmetic depends only on its own sequence (fixed summation order,
// explicit vector types rather than compiler-reassociated reductions), so a sequence's output
// is bitwise the same whatever it is batched with and however tasks are split across threads.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "vec.h"

namespace {

using namespace kvfleet;
constexpr int64_t kMaxVecs = 16;  // head_dim <= 256

// K/V elements are float32, or bfloat16 kept as its 16 bits (the upper half of a float32, so
// widening is a shift: exact). A 16-bit cache halves the bytes a decode step reads from it.
typedef uint16_t U16Reg __attribute__((vector_size(kRegLanes * sizeof(uint16_t)), aligned(2)));
typedef uint16_t U16Vec __attribute__((vector_size(kLanes * sizeof(uint16_t)), aligned(2)));

// Bfloat16 bits widened to the float32 vector F (lanes of integer vector I, 16-bit vector B).
template <typename F, typename I, typename B>
inline F widen_bf16(const uint16_t* p) {
  const I bits = __builtin_convertvector(*reinterpret_cast<const B*>(p), I) << 16;
  F r;
  std::memcpy(&r, &bits, sizeof(r));
  return r;
}

inline Reg load_kv_reg(const float* p) { return load_reg(p); }
inline Reg load_kv_reg(const uint16_t* p) { return widen_bf16<Reg, IReg, U16Reg>(p); }
inline Vec load_kv(const float* p) { return load(p); }
inline Vec load_kv(const uint16_t* p) { return widen_bf16<Vec, IVec, U16Vec>(p); }

// Both caches float32, or both bfloat16.
inline bool cache_type_ok(const torch::Tensor& k_cache, const torch::Tensor& v_cache) {
  return k_cache.scalar_type() == v_cache.scalar_type() &&
         (k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kBFloat16);
}

// f(k, v) with the caches' elements as float or as bfloat16's 16 bits.
template <typename F>
void with_cache_type(const torch::Tensor& k_cache, const torch::Tensor& v_cache, F f) {
  if (k_cache.scalar_type() == at::kBFloat16)
    f(reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>()),
      reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>()));
  else
    f(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
}

// Asks for a head's K or V row of the next block while this block's are read. Blocks sit
// anywhere in the cache, so the hardware prefetcher, which follows the slot stride within a
// block, loses the stream at every block boundary; this cut the attention of 32 sequences
// over 340 positions (30 layers, from DRAM) by ~10 % on one AVX2 core. Into L2 (locality 2,
// prefetcht1), not L1: a core keeps few L1 misses in flight, and with prefetcht0 the same
// attention read its cache at 9.5 GB/s a core against 13.1 with prefetcht1 (Zen 4, 1 thread;
// 2 threads 17.5 -> 21.5 GB/s; prefetcht2 the same as t1, prefetchnta slower).
template <typename KV>
inline void prefetch_row(const KV* p, int64_t dim) {
  for (int64_t i = 0; i < dim * static_cast<int64_t>(sizeof(KV)); i += 64)
    __builtin_prefetch(reinterpret_cast<const char*>(p) + i, 0, 2);
}

// Where a head's rows of the block holding positions t0.. of a sequence start (`offset`
// elements into each slot), those of the next block (to prefetch; this block's own when it is
// the last), and how many of the block's slots are in the context.
template <typename KV>
struct BlockRows {
  const KV* rows;
  const KV* next;
  int64_t n;
};

template <typename KV>
inline BlockRows<KV> block_rows(const KV* cache, const int64_t* table, int64_t t0, int64_t ctx,
                                int64_t block_size, int64_t token_stride, int64_t offset) {
  const KV* rows = cache + table[t0 / block_size] * block_size * token_stride + offset;
  const KV* next = t0 + block_size < ctx
                       ? cache + table[t0 / block_size + 1] * block_size * token_stride + offset
                       : rows;
  return {rows, next, std::min(block_size, ctx - t0)};
}

inline float horizontal_max(Vec v) {
  float m = v[0];
  for (int64_t i = 1; i < kLanes; ++i) m = std::max(m, v[i]);
  return m;
}

// Softmax weights in place: the `chunks` vectors of scores at s become exp(score - m), m
// their maximum; returns 1 / their sum. A -inf score (a masked or padding position) becomes
// exactly 0.
inline float exp_weights(float* s, int64_t chunks, float m) {
  Vec sum = splat(0.f);
  for (int64_t c = 0; c < chunks; ++c) {
    const Vec p = vexp(load(s + c * kLanes) - m);
    store(s + c * kLanes, p);
    sum += p;
  }
  return 1.f / horizontal_sum(sum);
}

// A sum of one register's lanes by a fixed tree (so a row's result does not depend on others).
inline float register_sum(Reg v) {
#if defined(__AVX512F__)
  return horizontal_sum(v);
#elif defined(__AVX2__)
  const Vec4 a = __builtin_shufflevector(v, v, 0, 1, 2, 3) +
                 __builtin_shufflevector(v, v, 4, 5, 6, 7);
  return (a[0] + a[2]) + (a[1] + a[3]);
#else
  return (v[0] + v[2]) + (v[1] + v[3]);
#endif
}

// A decode call's tasks: G query heads of one grouped-query group of one sequence each (G = the
// group, or 1), for a head_dim of V * 16. The query and the accumulators are ISA registers
// (Reg), dim / kRegLanes of them a head, indexed by compile-time loops so they stay in
// registers: 16-float Vec arrays indexed at run time went through the stack. With G > 1 a
// task reads each K and V row once for its G heads: one task per query head re-read the
// group's rows from L2 and spent ~40 cycles a position and head (AVX-512, float32 cache). Where
// G heads' queries and accumulators would not fit the ISA's registers (AVX2, plain SSE), a
// task scores its heads one after the other over each block, re-reading the block's K rows
// from L1, and sums V for all G heads a slice of head_dim at a time (AVX2, or a 16-bit cache).
// Each head's arithmetic is the same whatever G is, so G is chosen per call for balance: with
// one sequence and 3 kv heads (SmolLM2), kv-head tasks would split 2:1 over 2 threads.
template <int64_t V, int64_t G, typename KV>
void decode(const float* qp, int64_t q_stride, int64_t batch, int64_t heads, int64_t kv_heads,
            const KV* kp, const KV* vp, const int64_t* tables, int64_t max_blocks,
            const int64_t* lens, int64_t block_size, float scale, float* op) {
  constexpr int64_t dim = V * kLanes, regs = dim / kRegLanes;
  // G heads' accumulators (and, for the scores, their queries) in registers at once.
  constexpr bool fused = G * regs <= 16;
  // Otherwise the weighted sums of V take head_dim in slices of kVSlice registers: the
  // largest divisor of regs with G slices of accumulators and one of V in 16 registers. Not on
  // plain SSE with a float32 cache, where a head at a time was 5 % faster (18.2 vs 19.1 ms,
  // measured as in the sliced branch; with bfloat16 the slices were 10-17 % faster there too).
  constexpr bool sliced_v = kRegLanes == 8 || !std::is_same_v<KV, float>;
  constexpr int64_t kVSlice = [] {
    for (int64_t w = regs; w > 1; --w)
      if (regs % w == 0 && (G + 1) * w <= 16) return w;
    return int64_t{1};
  }();
  const int64_t group = heads / kv_heads, tasks_per_seq = heads / G;
  const int64_t token_stride = kv_heads * dim;  // floats between slots of a block
  at::parallel_for(0, batch * tasks_per_seq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / tasks_per_seq, head0 = task % tasks_per_seq * G;
      const int64_t h = head0 / group, ctx = lens[b];
      const int64_t* table = tables + b * max_blocks;
      // Each head's scores padded to whole vectors with -inf, which the softmax turns into
      // weights of exactly 0; head g's at s + g * width.
      const int64_t chunks = (ctx + kLanes - 1) / kLanes, width = chunks * kLanes;
      scores.resize(G * width);
      float* s = scores.data();
      {
        Reg qv[G][regs];
        for (int64_t g = 0; g < G; ++g)
          for (int64_t i = 0; i < regs; ++i)
            qv[g][i] = load_reg(qp + b * q_stride + (head0 + g) * dim + i * kRegLanes);
        // Block by block: a division per position (t / block_size, t % block_size) cost
        // more than the position's dot product.
        for (int64_t t0 = 0; t0 < ctx; t0 += block_size) {
          const auto [k, next, n] = block_rows(kp, table, t0, ctx, block_size, token_stride,
                                               h * dim);
          if constexpr (fused) {
            for (int64_t j = 0; j < n; ++j) {
              prefetch_row(next + j * token_stride, dim);
              const KV* row = k + j * token_stride;
              Reg kr[regs];
              for (int64_t i = 0; i < regs; ++i) kr[i] = load_kv_reg(row + i * kRegLanes);
              float dot[G];
              for (int64_t g = 0; g < G; ++g) {
                Reg prod = qv[g][0] * kr[0];
                for (int64_t i = 1; i < regs; ++i) prod += qv[g][i] * kr[i];
                dot[g] = register_sum(prod) * scale;
              }
              for (int64_t g = 0; g < G; ++g) s[g * width + t0 + j] = dot[g];
            }
          } else {
            for (int64_t g = 0; g < G; ++g) {
              Reg q[regs];
              for (int64_t i = 0; i < regs; ++i) q[i] = qv[g][i];
              for (int64_t j = 0; j < n; ++j) {
                if (g == 0) prefetch_row(next + j * token_stride, dim);
                const KV* row = k + j * token_stride;
                Reg prod = q[0] * load_kv_reg(row);
                for (int64_t i = 1; i < regs; ++i) prod += q[i] * load_kv_reg(row + i * kRegLanes);
                s[g * width + t0 + j] = register_sum(prod) * scale;
              }
            }
          }
        }
      }
      // Softmax 16 positions at a time (vexp): a scalar exp per position was more than half
      // of a decode step's attention at short contexts.
      float inv[G];
      for (int64_t g = 0; g < G; ++g) {
        float* sg = s + g * width;
        std::fill(sg + ctx, sg + width, -INFINITY);
        Vec top = load(sg);
        for (int64_t c = 1; c < chunks; ++c) {
          const Vec x = load(sg + c * kLanes);
          top = vmax(top, x);
        }
        inv[g] = exp_weights(sg, chunks, horizontal_max(top));
      }
      // The weighted sums of V in registers.
      Reg acc[G][regs] = {};
      for (int64_t t0 = 0; t0 < ctx; t0 += block_size) {
        const auto [v, next, n] = block_rows(vp, table, t0, ctx, block_size, token_stride,
                                             h * dim);
        if constexpr (fused) {
          for (int64_t j = 0; j < n; ++j) {
            prefetch_row(next + j * token_stride, dim);
            const KV* row = v + j * token_stride;
            Reg vr[regs];
            for (int64_t i = 0; i < regs; ++i) vr[i] = load_kv_reg(row + i * kRegLanes);
            for (int64_t g = 0; g < G; ++g) {
              const float w = s[g * width + t0 + j];
              for (int64_t i = 0; i < regs; ++i) acc[g][i] += w * vr[i];
            }
          }
        } else if constexpr (sliced_v) {
          // The G heads' accumulators for one slice of head_dim at a time (and the slice's V
          // registers) in the register file, so each V register loaded (and, from a 16-bit
          // cache, widened) feeds G multiply-adds; one head at a time re-read every row G
          // times. Same sums in the same order. AVX2, SmolLM2 (3 heads a group, two slices of
          // 4 ymm), 32 sequences x 326 positions, 30 layers from DRAM, 2 threads: 17.6-17.9
          // -> 16.8-17.3 ms with a float32 cache, 21.1 -> 17.5 with bfloat16 (in the engine's
          // kernel: 18.2-18.3 -> 17.5-18.0 and 18.2-20.0 -> 16.2-17.4, same bits).
          for (int64_t c0 = 0; c0 < regs; c0 += kVSlice) {
            Reg a[G][kVSlice];
            for (int64_t g = 0; g < G; ++g)
              for (int64_t i = 0; i < kVSlice; ++i) a[g][i] = acc[g][c0 + i];
            for (int64_t j = 0; j < n; ++j) {
              if (c0 == 0) prefetch_row(next + j * token_stride, dim);
              const KV* row = v + j * token_stride + c0 * kRegLanes;
              Reg vr[kVSlice];
              for (int64_t i = 0; i < kVSlice; ++i) vr[i] = load_kv_reg(row + i * kRegLanes);
              for (int64_t g = 0; g < G; ++g) {
                const float w = s[g * width + t0 + j];
                for (int64_t i = 0; i < kVSlice; ++i) a[g][i] += w * vr[i];
              }
            }
            for (int64_t g = 0; g < G; ++g)
              for (int64_t i = 0; i < kVSlice; ++i) acc[g][c0 + i] = a[g][i];
          }
        } else {
          for (int64_t g = 0; g < G; ++g) {
            Reg a[regs];
            for (int64_t i = 0; i < regs; ++i) a[i] = acc[g][i];
            const float* w = s + g * width + t0;
            for (int64_t j = 0; j < n; ++j) {
              if (g == 0) prefetch_row(next + j * token_stride, dim);
              const KV* row = v + j * token_stride;
              for (int64_t i = 0; i < regs; ++i) a[i] += w[j] * load_kv_reg(row + i * kRegLanes);
            }
            for (int64_t i = 0; i < regs; ++i) acc[g][i] = a[i];
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* o = op + (b * heads + head0 + g) * dim;
        for (int64_t i = 0; i < regs; ++i) store_reg(o + i * kRegLanes, acc[g][i] * inv[g]);
      }
    }
  });
}

}  // namespace

// q: [B, H, D] (rows may be strided, e.g. a view into the fused QKV projection); k_cache,
// v_cache: [num_blocks, block_size, KVH, D]; block_tables: [B, M] (int64); context_lens: [B]
// (int64, each in [1, M * block_size]). Returns [B, H, D].
torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                                     const torch::Tensor& v_cache,
                                     const torch::Tensor& block_tables,
                                     const torch::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "paged_decode_attention: q must be [B, H, D] and the caches [N, BS, KVH, D]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && cache_type_ok(k_cache, v_cache),
              "paged_decode_attention: q must be float32 and the caches both float32 or both "
              "bfloat16");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "paged_decode_attention: block_tables and context_lens must be int64");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && block_tables.is_contiguous() &&
                  context_lens.is_contiguous(),
              "paged_decode_attention: contiguous tensors only (q's rows may be strided)");
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(1);
  const int64_t kv_heads = k_cache.size(2), max_blocks = block_tables.size(1);
  TORCH_CHECK(k_cache.size(3) == dim && dim % kLanes == 0 && dim <= kLanes * kMaxVecs,
              "paged_decode_attention: head_dim must match and be a multiple of 16, <= 256");
  TORCH_CHECK(heads % kv_heads == 0, "paged_decode_attention: heads % kv_heads != 0");
  TORCH_CHECK(block_tables.size(0) == batch && context_lens.size(0) == batch,
              "paged_decode_attention: one block table and context length per sequence");
  const float* qp = q.data_ptr<float>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= max_blocks * block_size,
                "paged_decode_attention: context length ", lens[b], " of sequence ", b,
                " outside [1, ", max_blocks * block_size, "]");
    for (int64_t i = 0; i < (lens[b] + block_size - 1) / block_size; ++i) {
      const int64_t block = tables[b * max_blocks + i];
      TORCH_CHECK(block >= 0 && block < num_blocks, "paged_decode_attention: block ", block,
                  " of sequence ", b, " outside [0, ", num_blocks, ")");
    }
  }
  torch::Tensor out = torch::empty(q.sizes(), q.options());  // contiguous, whatever q's strides
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  with_cache_type(k_cache, v_cache, [&](const auto* kp, const auto* vp) {
    using KV = std::remove_const_t<std::remove_pointer_t<decltype(kp)>>;
    // Grouped tasks where a group of 2-4 heads gives every thread several tasks (head_dim 64
    // or 128: the instantiations are few), one task per query head otherwise.
    const int64_t group = heads / kv_heads;
    const bool grouped = group >= 2 && group <= 4 && (dim == 64 || dim == 128) &&
                         batch * kv_heads >= 4 * at::get_num_threads();
#define KVFLEET_DECODE_ARGS \
  qp, q.stride(0), batch, heads, kv_heads, kp, vp, tables, max_blocks, lens, block_size, fscale, op
#define KVFLEET_DECODE_GROUPED(V)                                   \
  if (dim == V * kLanes) {                                          \
    if (group == 2) decode<V, 2, KV>(KVFLEET_DECODE_ARGS);          \
    if (group == 3) decode<V, 3, KV>(KVFLEET_DECODE_ARGS);          \
    if (group == 4) decode<V, 4, KV>(KVFLEET_DECODE_ARGS);          \
  }
    if (grouped) {
      KVFLEET_DECODE_GROUPED(4) KVFLEET_DECODE_GROUPED(8)
      return;
    }
#undef KVFLEET_DECODE_GROUPED
    switch (dim / kLanes) {
#define KVFLEET_DECODE(V)                       \
  case V:                                       \
    decode<V, 1, KV>(KVFLEET_DECODE_ARGS);      \
    break;
      KVFLEET_DECODE(1) KVFLEET_DECODE(2) KVFLEET_DECODE(3) KVFLEET_DECODE(4)
      KVFLEET_DECODE(5) KVFLEET_DECODE(6) KVFLEET_DECODE(7) KVFLEET_DECODE(8)
      KVFLEET_DECODE(9) KVFLEET_DECODE(10) KVFLEET_DECODE(11) KVFLEET_DECODE(12)
      KVFLEET_DECODE(13) KVFLEET_DECODE(14) KVFLEET_DECODE(15) KVFLEET_DECODE(16)
#undef KVFLEET_DECODE
#undef KVFLEET_DECODE_ARGS
    }
  });
  return out;
}

// Prefill: a chunk's tokens attend to the cached positions before it and causally to its own
// (already written to the cache). The SDPA path gathered the chunk's blocks into a copy and,
// after a prefix-cache hit, ran the cached part and the chunk's own part as two calls merged
// by log-sum-exp. Here tiles of 12 query rows of one kv head each compute their scores against
// K (transposed once per call into 16-position chunks, so a chunk's scores for one row are
// one vector of FMAs), an exact softmax, and the weighted sum of V read from the slots.

namespace {

// In-register transpose of a 16 x 16 square (square[l][d] -> square[d][l]): swap the
// off-diagonal 8 x 8 blocks, then the 4 x 4 blocks inside each, then 2 x 2, then single
// elements. Swapping the S-wide blocks of a row pair (a, b): lane j of the new a is
// (j & S ? b[j - S] : a[j]), of the new b (j & S ? b[j] : a[j + S]); two shuffles.
template <int S, size_t... J>
inline void swap_blocks(Vec& a, Vec& b, std::index_sequence<J...>) {
  const Vec lo = __builtin_shufflevector(a, b, ((J & S) ? kLanes + J - S : J)...);
  b = __builtin_shufflevector(a, b, ((J & S) ? kLanes + J : J + S)...);
  a = lo;
}

template <int S>
inline void swap_blocks(Vec (&square)[kLanes]) {
  for (int64_t i = 0; i < kLanes; ++i)
    if (!(i & S)) swap_blocks<S>(square[i], square[i + S], std::make_index_sequence<kLanes>{});
}

inline void transpose16(Vec (&square)[kLanes]) {
  swap_blocks<8>(square);
  swap_blocks<4>(square);
  swap_blocks<2>(square);
  swap_blocks<1>(square);
}

// Register budgets of a tile, per ISA (accumulators + loaded operands + one broadcast must fit
// the register file, or GCC moves every accumulator through the stack on each use: the
// 16-float Vec arrays this code first used made prefill attention 1.6x slower than SDPA on
// AVX2, where a Vec is two ymm). Scores: kTileRows query rows x kPassRegs registers of
// positions per pass. Weighted sums of V: kPvAcc accumulator registers, a row's head_dim
// split into slices of at most kPvSliceMax registers.
#if defined(__AVX512F__)
constexpr int64_t kTileRows = 12;   // 12 rows x 32 positions: 24 zmm + 2 K
constexpr int64_t kPvSliceMax = 16, kPvAcc = 24;
#else
constexpr int64_t kTileRows = 6;    // 6 rows x 2 registers: 12 ymm (16 positions) + 2 K
constexpr int64_t kPvSliceMax = 2, kPvAcc = 12;
#endif
constexpr int64_t kPassRegs = 2;
constexpr int64_t kPassPositions = kPassRegs * kRegLanes;

inline float register_max(Reg v) {
  float m = v[0];
  for (int64_t i = 1; i < kRegLanes; ++i) m = std::max(m, v[i]);
  return m;
}

// One tile: up to kTileRows consecutive GQA-folded query rows (row = token * group + g) of
// kv head `h`, against the causal prefix of each. K comes pre-transposed in 16-position
// chunks ([chunk][dim][16 positions]) so a chunk's scores for one row are one vector built by
// `dim` FMAs; V is read straight from the cache's slots.
template <int64_t V, typename KV>
void prefill_tile(const float* q, int64_t q_stride, int64_t heads, int64_t group, int64_t h,
                  int64_t row0, int64_t rows, int64_t start, const float* k_t, const KV* v_cache,
                  const int64_t* slots, int64_t token_stride, float scale, float* out,
                  std::vector<float>& scores) {
  constexpr int64_t dim = V * kLanes;
  const float* qrow[kTileRows];
  int64_t len[kTileRows];  // positions row r attends to: [0, len[r])
  for (int64_t r = 0; r < kTileRows; ++r) {
    const int64_t row = row0 + std::min(r, rows - 1);  // rows past the tile repeat its last
    const int64_t token = row / group, g = row % group;
    qrow[r] = q + token * q_stride + (h * group + g) * dim;
    len[r] = start + token + 1;
  }
  const int64_t max_len = len[kTileRows - 1];
  const int64_t chunks = (max_len + kLanes - 1) / kLanes, width = chunks * kLanes;
  scores.resize(kTileRows * width);
  IReg lane;
  for (int64_t i = 0; i < kRegLanes; ++i) lane[i] = static_cast<int32_t>(i);
  // kPassRegs registers of positions per pass: kTileRows * kPassRegs accumulators, kPassRegs
  // K loads + kTileRows broadcasts per kTileRows * kPassRegs FMAs. Position p of the
  // transposed K is at chunk p / 16, lane p % 16; a pass past the last chunk reads chunk 0
  // again (finite values, masked below, never stored).
  Reg row_max[kTileRows];
  for (int64_t r = 0; r < kTileRows; ++r) row_max[r] = Reg{} - INFINITY;
  for (int64_t p0 = 0; p0 < width; p0 += kPassPositions) {
    const float* kr[kPassRegs];
    for (int64_t i = 0; i < kPassRegs; ++i) {
      const int64_t pos = p0 + i * kRegLanes;
      kr[i] = pos < width ? k_t + (pos / kLanes) * dim * kLanes + pos % kLanes : k_t;
    }
    Reg acc[kTileRows][kPassRegs] = {};
    for (int64_t d = 0; d < dim; ++d) {
      Reg kv[kPassRegs];
      for (int64_t i = 0; i < kPassRegs; ++i) kv[i] = load_reg(kr[i] + d * kLanes);
      for (int64_t r = 0; r < kTileRows; ++r) {
        const float qd = qrow[r][d];
        for (int64_t i = 0; i < kPassRegs; ++i) acc[r][i] += qd * kv[i];
      }
    }
    for (int64_t i = 0; i < kPassRegs && p0 + i * kRegLanes < width; ++i) {
      const IReg pos = lane + static_cast<int32_t>(p0 + i * kRegLanes);
      for (int64_t r = 0; r < kTileRows; ++r) {
        const Reg sc = acc[r][i] * scale;
        const IReg keep = pos < static_cast<int32_t>(len[r]);
        const Reg masked = keep ? sc : Reg{} - INFINITY;
        row_max[r] = row_max[r] > masked ? row_max[r] : masked;
        store_reg(scores.data() + r * width + p0 + i * kRegLanes, masked);
      }
    }
  }
  float inv[kTileRows];
  for (int64_t r = 0; r < rows; ++r)
    inv[r] = exp_weights(scores.data() + r * width, chunks, register_max(row_max[r]));
  // Weighted sums of V, kPvRows rows x one slice of head_dim at a time, so each loaded V
  // register feeds kPvRows FMAs. A row's weights past its own causal end are exactly 0 (vexp
  // of -inf), so they add nothing.
  constexpr int64_t kRowRegs = dim / kRegLanes;
  constexpr int64_t kSlice = std::min(kRowRegs, kPvSliceMax);
  static_assert(kRowRegs % kSlice == 0, "head_dim slices must tile the row");
  constexpr int64_t kPvRows = std::max<int64_t>(1, kPvAcc / kSlice);
  for (int64_t r0 = 0; r0 < rows; r0 += kPvRows) {
    const int64_t n = std::min(kPvRows, rows - r0);
    const float* pr[kPvRows];
    for (int64_t r = 0; r < kPvRows; ++r)
      pr[r] = scores.data() + (r0 + std::min(r, n - 1)) * width;  // extra rows repeat the last
    const int64_t end = len[r0 + n - 1];
    for (int64_t c0 = 0; c0 < kRowRegs; c0 += kSlice) {
      Reg acc[kPvRows][kSlice] = {};
      for (int64_t t = 0; t < end; ++t) {
        const KV* v = v_cache + slots[t] * token_stride + h * dim + c0 * kRegLanes;
        Reg vv[kSlice];
        for (int64_t i = 0; i < kSlice; ++i) vv[i] = load_kv_reg(v + i * kRegLanes);
        for (int64_t r = 0; r < kPvRows; ++r)
          for (int64_t i = 0; i < kSlice; ++i) acc[r][i] += pr[r][t] * vv[i];
      }
      for (int64_t r = 0; r < n; ++r) {
        const int64_t row = row0 + r0 + r, token = row / group, g = row % group;
        float* o = out + (token * heads + h * group + g) * dim + c0 * kRegLanes;
        for (int64_t i = 0; i < kSlice; ++i)
          store_reg(o + i * kRegLanes, acc[r][i] * inv[r0 + r]);
      }
    }
  }
}

template <int64_t V, typename KV>
void prefill(const float* q, int64_t q_stride, int64_t n, int64_t heads, int64_t kv_heads,
             int64_t start, const KV* k_cache, const KV* v_cache, const int64_t* slots,
             float scale, float* out) {
  constexpr int64_t dim = V * kLanes;
  const int64_t group = heads / kv_heads, token_stride = kv_heads * dim;
  const int64_t ctx = start + n, chunks = (ctx + kLanes - 1) / kLanes;
  // K of every kv head transposed into [head][chunk][dim][16 positions] (padding zeros, masked
  // out): each tile of a head reads it chunk by chunk from L2 instead of gathering slots.
  std::vector<float> k_t(kv_heads * chunks * dim * kLanes, 0.f);
  // By chunk, every kv head in turn: a position's K for all heads is one contiguous run of
  // the cache, read front to back (rather than one head's slice of each run per task). Each
  // 16 positions x 16 dims square is transposed in registers: scattering single floats cost
  // as much as a tenth of the attention of a 100-token chunk over 1,000 cached positions.
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const KV* rows[kLanes];
      for (int64_t l = 0; l < kLanes; ++l) {
        const int64_t t = c * kLanes + l;
        rows[l] = t < ctx ? k_cache + slots[t] * token_stride : nullptr;
      }
      for (int64_t h = 0; h < kv_heads; ++h) {
        float* dst = k_t.data() + (h * chunks + c) * dim * kLanes;
        for (int64_t i = 0; i < V; ++i) {
          Vec square[kLanes];
          for (int64_t l = 0; l < kLanes; ++l)
            square[l] = rows[l] ? load_kv(rows[l] + h * dim + i * kLanes) : Vec{};
          transpose16(square);
          for (int64_t d = 0; d < kLanes; ++d) store(dst + (i * kLanes + d) * kLanes, square[d]);
        }
      }
    }
  });
  const int64_t tiles_per_head = (n * group + kTileRows - 1) / kTileRows;
  const int64_t tasks = kv_heads * tiles_per_head;
  // Tiles later in the chunk attend to more positions; dealing tasks out round-robin (rather
  // than parallel_for's contiguous ranges) gives each thread its share of long and short ones.
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), tasks);
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t w = begin; w < end; ++w) {
      for (int64_t task = w; task < tasks; task += workers) {
        const int64_t h = task / tiles_per_head, row0 = (task % tiles_per_head) * kTileRows;
        prefill_tile<V, KV>(q, q_stride, heads, group, h, row0,
                        std::min(kTileRows, n * group - row0), start,
                        k_t.data() + h * chunks * dim * kLanes, v_cache, slots, token_stride,
                        scale, out, scores);
      }
    }
  });
}

}  // namespace

// Prefill attention of one chunk straight from the paged KV cache: q: [n, H, D] (rows may be
// strided, e.g. a view into the fused QKV projection), the chunk's
// tokens at positions start .. start + n - 1, whose K/V are already in the cache; each attends
// causally to every position up to its own. block_table: [M] (int64). Returns [n, H, D].
//
// Every query row's result depends only on its own position and the cache (its own scores,
// softmax and sums in a fixed order), so a token gets the same bits however its prompt was
// split into chunks and whatever else the step computes.
torch::Tensor paged_prefill_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                                      const torch::Tensor& v_cache,
                                      const torch::Tensor& block_table, int64_t start,
                                      double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "paged_prefill_attention: q must be [n, H, D] and the caches [N, BS, KVH, D]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && cache_type_ok(k_cache, v_cache),
              "paged_prefill_attention: q must be float32 and the caches both float32 or both "
              "bfloat16");
  TORCH_CHECK(block_table.dim() == 1 && block_table.scalar_type() == at::kLong,
              "paged_prefill_attention: block_table must be a 1-D int64 tensor");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && block_table.is_contiguous(),
              "paged_prefill_attention: contiguous tensors only (q's rows may be strided)");
  const int64_t n = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(1);
  const int64_t kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == dim && dim % kLanes == 0 && dim <= kLanes * kMaxVecs,
              "paged_prefill_attention: head_dim must match and be a multiple of 16, <= 256");
  TORCH_CHECK(heads % kv_heads == 0, "paged_prefill_attention: heads % kv_heads != 0");
  TORCH_CHECK(n >= 1 && start >= 0 && start + n <= block_table.size(0) * block_size,
              "paged_prefill_attention: positions [", start, ", ", start + n,
              ") outside the block table's ", block_table.size(0) * block_size);
  const int64_t* table = block_table.data_ptr<int64_t>();
  std::vector<int64_t> slots(start + n);
  for (int64_t t = 0; t < start + n; ++t) {
    const int64_t block = table[t / block_size];
    TORCH_CHECK(block >= 0 && block < num_blocks, "paged_prefill_attention: block ", block,
                " outside [0, ", num_blocks, ")");
    slots[t] = block * block_size + t % block_size;
  }
  torch::Tensor out = torch::empty(q.sizes(), q.options());  // contiguous, whatever q's strides
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  with_cache_type(k_cache, v_cache, [&](const auto* kp, const auto* vp) {
    using KV = std::remove_const_t<std::remove_pointer_t<decltype(kp)>>;
    switch (dim / kLanes) {
#define KVFLEET_PREFILL(V)                                                                  \
  case V:                                                                                   \
    prefill<V, KV>(qp, q.stride(0), n, heads, kv_heads, start, kp, vp, slots.data(), fscale, \
                   op);                                                                     \
    break;
      KVFLEET_PREFILL(1) KVFLEET_PREFILL(2) KVFLEET_PREFILL(3) KVFLEET_PREFILL(4)
      KVFLEET_PREFILL(5) KVFLEET_PREFILL(6) KVFLEET_PREFILL(7) KVFLEET_PREFILL(8)
      KVFLEET_PREFILL(9) KVFLEET_PREFILL(10) KVFLEET_PREFILL(11) KVFLEET_PREFILL(12)
      KVFLEET_PREFILL(13) KVFLEET_PREFILL(14) KVFLEET_PREFILL(15) KVFLEET_PREFILL(16)
#undef KVFLEET_PREFILL
    }
  });
  return out;
}

// Writes the step's new K and V into their cache slots: k, v [T, KVH, D] (a token's heads
// contiguous, rows may be strided, e.g. views into the fused QKV projection), the caches
// [N, BS, KVH, D], slots [T] (int64, block * BS + offset). One copy per token and cache;
// index_copy_ took ~1 us per token (60 calls a step).
void write_kv(const torch::Tensor& k, const torch::Tensor& v, torch::Tensor k_cache,
              torch::Tensor v_cache, const torch::Tensor& slots) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k_cache.dim() == 4 &&
                  v_cache.sizes() == k_cache.sizes(),
              "write_kv: k and v must be [T, KVH, D] and the caches [N, BS, KVH, D]");
  TORCH_CHECK(k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat &&
                  cache_type_ok(k_cache, v_cache),
              "write_kv: k and v must be float32 and the caches both float32 or both bfloat16");
  TORCH_CHECK(k.size(1) == k_cache.size(2) && k.size(2) == k_cache.size(3),
              "write_kv: k's heads and head_dim must match the cache's");
  const int64_t row = k.size(1) * k.size(2);
  for (const torch::Tensor* t : {&k, &v})
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == t->size(2),
                "write_kv: a token's K or V must be one contiguous run (rows may be strided)");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(),
              "write_kv: the caches must be contiguous");
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kLong && slots.is_contiguous() &&
                  slots.size(0) == k.size(0),
              "write_kv: slots must be a contiguous int64 [", k.size(0), "] tensor");
  const int64_t n = k.size(0), num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "write_kv: slot ", sp[t], " outside [0, ",
                num_slots, ")");
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  if (k_cache.scalar_type() == at::kBFloat16) {
    // Rounded to nearest even, as torch's own float32 -> bfloat16 conversion.
    at::BFloat16* kc = k_cache.data_ptr<at::BFloat16>();
    at::BFloat16* vc = v_cache.data_ptr<at::BFloat16>();
    at::parallel_for(0, n, 256, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        for (int64_t i = 0; i < row; ++i) {
          kc[sp[t] * row + i] = at::BFloat16(kp[t * k.stride(0) + i]);
          vc[sp[t] * row + i] = at::BFloat16(vp[t * v.stride(0) + i]);
        }
    });
    return;
  }
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  at::parallel_for(0, n, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      std::memcpy(kc + sp[t] * row, kp + t * k.stride(0), row * sizeof(float));
      std::memcpy(vc + sp[t] * row, vp + t * v.stride(0), row * sizeof(float));
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "Decode attention over a paged KV cache (float32, CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("write_kv", &write_kv, "Write a step's K and V into their paged cache slots",
        py::call_guard<py::gil_scoped_release>());
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "Causal prefill attention of one chunk over a paged KV cache (float32, CPU)",
        py::call_guard<py::gil_scoped_release>());
}
