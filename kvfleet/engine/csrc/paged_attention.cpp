// Decode attention straight from the paged KV cache (one query token per sequence).
//
// The SDPA path gathers every sequence's K and V blocks into a contiguous copy and then reads
// the copy: two passes over the cache per layer plus a write. Here each (sequence, kv head)
// task walks its block table and reads each cached position once. Grouped-query heads share
// the K/V reads. Per task: scores for every position, exact softmax (max subtracted), then
// the weighted sum of V, all in float32.
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
// 16 floats; aligned(4) so loads from any float address are allowed (GCC lowers these to
// AVX-512, AVX2 or SSE as the build target has).
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float)), aligned(4)));

inline Vec load(const float* p) { return *reinterpret_cast<const Vec*>(p); }
inline void store(float* p, Vec v) { *reinterpret_cast<Vec*>(p) = v; }

inline float horizontal_sum(Vec v) {
  float s = 0.f;
  for (int64_t i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

inline float dot(const float* a, const float* b, int64_t n) {
  Vec acc = {};
  for (int64_t i = 0; i < n; i += kLanes) acc += load(a + i) * load(b + i);
  return horizontal_sum(acc);
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
  TORCH_CHECK(k_cache.size(3) == dim && dim % kLanes == 0,
              "paged_decode_attention: head_dim must match and be a multiple of 16");
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
    std::vector<float> acc;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, h = task % kv_heads, ctx = lens[b];
      const int64_t* table = tables + b * max_blocks;
      const float* qh = qp + (b * heads + h * group) * dim;
      scores.resize(group * ctx);
      for (int64_t t = 0; t < ctx; ++t) {
        const float* k = kp + (table[t / block_size] * block_size + t % block_size) *
                                  token_stride + h * dim;
        for (int64_t g = 0; g < group; ++g) scores[g * ctx + t] = dot(qh + g * dim, k, dim) * fscale;
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
      acc.assign(group * dim, 0.f);
      for (int64_t t = 0; t < ctx; ++t) {
        const float* v = vp + (table[t / block_size] * block_size + t % block_size) *
                                  token_stride + h * dim;
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * ctx + t];
          float* a = acc.data() + g * dim;
          for (int64_t i = 0; i < dim; i += kLanes) store(a + i, load(a + i) + p * load(v + i));
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* o = op + (b * heads + h * group + g) * dim;
        const float inv = 1.f / denom[g];
        for (int64_t i = 0; i < dim; ++i) o[i] = acc[g * dim + i] * inv;
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
