// Decode attention straight from the paged KV cache (one query token per sequence).
//
// The SDPA path gathers every sequence's K and V blocks into a contiguous copy and then reads
// the copy: two passes over the cache per layer plus a write. Here each (sequence, kv head)
// task walks its block table and reads the cached positions from memory once (the query heads
// of a grouped-query group re-read them from L1/L2). Per task: scores for every position,
// exact softmax (max subtracted), then the weighted sum of V, all in float32, with the query
// and the accumulators held in registers.
//
// Determinism: a task's arithmetic depends only on its own sequence (fixed summation order,
// explicit vector types rather than compiler-reassociated reductions), so a sequence's output
// is bitwise the same whatever it is batched with and however tasks are split across threads.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kMaxVecs = 16;  // head_dim <= 256
// 16 floats; aligned(4) so loads from any float address are allowed (GCC lowers these to
// AVX-512, AVX2 or SSE as the build target has).
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float)), aligned(4)));

inline Vec load(const float* p) { return *reinterpret_cast<const Vec*>(p); }
inline void store(float* p, Vec v) { *reinterpret_cast<Vec*>(p) = v; }

typedef float Vec8 __attribute__((vector_size(8 * sizeof(float))));
typedef float Vec4 __attribute__((vector_size(4 * sizeof(float))));

// A fixed tree of halvings (4 dependent adds), not 16 serial ones: the serial sum was most of
// the kernel's time, since every cached position needs one per query head.
inline float horizontal_sum(Vec v) {
  const Vec8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                 __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const Vec4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) +
                 __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

}  // namespace

// q: [B, H, D]; k_cache, v_cache: [num_blocks, block_size, KVH, D]; block_tables: [B, M]
// (int64); context_lens: [B] (int64, each in [1, M * block_size]). Returns [B, H, D].
torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                                     const torch::Tensor& v_cache,
                                     const torch::Tensor& block_tables,
                                     const torch::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "paged_decode_attention: q must be [B, H, D] and the caches [N, BS, KVH, D]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
                  v_cache.scalar_type() == at::kFloat,
              "paged_decode_attention: float32 tensors only");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "paged_decode_attention: block_tables and context_lens must be int64");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  block_tables.is_contiguous() && context_lens.is_contiguous(),
              "paged_decode_attention: contiguous tensors only");
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(1);
  const int64_t kv_heads = k_cache.size(2), max_blocks = block_tables.size(1);
  TORCH_CHECK(k_cache.size(3) == dim && dim % kLanes == 0 && dim <= kLanes * kMaxVecs,
              "paged_decode_attention: head_dim must match and be a multiple of 16, <= 256");
  TORCH_CHECK(heads % kv_heads == 0, "paged_decode_attention: heads % kv_heads != 0");
  TORCH_CHECK(block_tables.size(0) == batch && context_lens.size(0) == batch,
              "paged_decode_attention: one block table and context length per sequence");
  const int64_t group = heads / kv_heads;
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
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
  torch::Tensor out = torch::empty_like(q);
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  const int64_t token_stride = kv_heads * dim;  // floats between slots of a block

  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, h = task % kv_heads, ctx = lens[b];
      const int64_t* table = tables + b * max_blocks;
      const float* qh = qp + (b * heads + h * group) * dim;
      const int64_t vecs = dim / kLanes;
      scores.resize(group * ctx);
      for (int64_t g = 0; g < group; ++g) {
        Vec qv[kMaxVecs];
        for (int64_t i = 0; i < vecs; ++i) qv[i] = load(qh + g * dim + i * kLanes);
        float* s = scores.data() + g * ctx;
        for (int64_t t = 0; t < ctx; ++t) {
          const float* k = kp + (table[t / block_size] * block_size + t % block_size) *
                                    token_stride + h * dim;
          Vec prod = qv[0] * load(k);
          for (int64_t i = 1; i < vecs; ++i) prod += qv[i] * load(k + i * kLanes);
          s[t] = horizontal_sum(prod) * fscale;
        }
      }
      std::vector<float> denom(group);
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * ctx;
        const float m = *std::max_element(s, s + ctx);
        float sum = 0.f;
        for (int64_t t = 0; t < ctx; ++t) {
          s[t] = std::exp(s[t] - m);
          sum += s[t];
        }
        denom[g] = sum;
      }
      // Per query head, the weighted sum of V in registers (a head is at most kMaxVecs
      // vectors); V is re-read per head of the group from L1/L2, where the first pass left it.
      for (int64_t g = 0; g < group; ++g) {
        Vec acc[kMaxVecs] = {};
        const float* p = scores.data() + g * ctx;
        for (int64_t t = 0; t < ctx; ++t) {
          const float* v = vp + (table[t / block_size] * block_size + t % block_size) *
                                    token_stride + h * dim;
          for (int64_t i = 0; i < vecs; ++i) acc[i] += p[t] * load(v + i * kLanes);
        }
        float* o = op + (b * heads + h * group + g) * dim;
        const float inv = 1.f / denom[g];
        for (int64_t i = 0; i < vecs; ++i) store(o + i * kLanes, acc[i] * inv);
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "Decode attention over a paged KV cache (float32, CPU)",
        py::call_guard<py::gil_scoped_release>());
}
