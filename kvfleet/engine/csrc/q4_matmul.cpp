// Weight matmuls straight from 4-bit GGUF blocks (Q4_1), dequantized next to the FMAs.
//
// A step's weight matmuls stream every layer's weights; as float32 that is ~420 MB for
// SmolLM2-135M, so a decode step waits on memory, not arithmetic. Q4_1 keeps 32 weights in 20
// bytes (a float16 scale d and minimum m, 32 4-bit codes q), the weight being d * q + m. Here
// the weights stay in that form (re-laid out at load, 0.75 bytes a weight) and each thread
// dequantizes a panel of 32 output features into a float32 buffer in its L2, which then feeds
// every row of the step: the memory traffic of a step falls ~5x, the arithmetic is unchanged.
//
// Exactness: the panel holds the very float32 values the loader's dequantization gives. d * q
// is exact in float32 (an 11-bit float16 significand times a 4-bit code), so computed with
// or without an FMA the one rounding is the add's, as in the loader. Only the order in which
// a row's products are summed differs from another GEMM, as between any two BLAS libraries;
// that order is fixed per row, so a row's result does not depend on the other rows.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kBlock = 32;           // weights per Q4_1 block (along the input dimension)
constexpr int64_t kPanel = 2 * kLanes;   // output features dequantized together
constexpr int64_t kRows = 12;            // rows per micro-tile: 12 x 2 vector accumulators
// Bytes of one (16 outputs, one block) group in the packed layout: d[16], m[16] as float32,
// then 16 bytes per pair (j, j + 16) of a block's positions, one byte per output feature.
constexpr int64_t kGroupBytes = 2 * kLanes * 4 + kLanes * kLanes;

typedef float Vec __attribute__((vector_size(kLanes * sizeof(float)), aligned(4)));
typedef int32_t IVec __attribute__((vector_size(kLanes * sizeof(int32_t)), aligned(4)));

inline Vec load(const float* p) { return *reinterpret_cast<const Vec*>(p); }
inline void store(float* p, Vec v) { *reinterpret_cast<Vec*>(p) = v; }

// 16 bytes zero-extended to 16 int32 lanes (GCC scalarizes the generic conversion).
inline IVec widen(const uint8_t* p) {
  IVec wide;
#if defined(__AVX512F__)
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  std::memcpy(&wide, &v, sizeof(wide));
#elif defined(__AVX2__)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i lo = _mm256_cvtepu8_epi32(bytes);
  const __m256i hi = _mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8));
  std::memcpy(&wide, &lo, sizeof(lo));
  std::memcpy(reinterpret_cast<char*>(&wide) + sizeof(lo), &hi, sizeof(hi));
#else
  for (int64_t i = 0; i < kLanes; ++i) wide[i] = p[i];
#endif
  return wide;
}

// Dequantizes 16 output features x all inputs (`blocks` packed groups from `group`) into
// buf[k * kPanel + lane_offset + n].
void dequantize_16(const uint8_t* group, int64_t blocks, float* buf, int64_t lane_offset) {
  for (int64_t b = 0; b < blocks; ++b, group += kGroupBytes) {
    const Vec d = load(reinterpret_cast<const float*>(group));
    const Vec m = load(reinterpret_cast<const float*>(group) + kLanes);
    const uint8_t* codes = group + 2 * kLanes * 4;
    float* out = buf + b * kBlock * kPanel + lane_offset;
    for (int64_t j = 0; j < kLanes; ++j) {
      const IVec wide = widen(codes + j * kLanes);
      const Vec lo = __builtin_convertvector(wide & 15, Vec);
      const Vec hi = __builtin_convertvector(wide >> 4, Vec);
      store(out + j * kPanel, d * lo + m);
      store(out + (j + kLanes) * kPanel, d * hi + m);
    }
  }
}

// out[r, 0:32] = x[r, :] . panel for `R` rows (R <= kRows), panel = [K][32] float32.
template <int64_t R>
void rows_times_panel(const float* x, int64_t x_stride, int64_t k_len, const float* panel,
                      float* out, int64_t out_stride, int64_t valid) {
  Vec acc0[R] = {}, acc1[R] = {};
  for (int64_t k = 0; k < k_len; ++k) {
    const Vec w0 = load(panel + k * kPanel), w1 = load(panel + k * kPanel + kLanes);
    for (int64_t r = 0; r < R; ++r) {
      const float xr = x[r * x_stride + k];
      acc0[r] += xr * w0;
      acc1[r] += xr * w1;
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    if (valid == kPanel) {
      store(out + r * out_stride, acc0[r]);
      store(out + r * out_stride + kLanes, acc1[r]);
    } else {  // a last panel of 16 features
      store(out + r * out_stride, acc0[r]);
    }
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

}  // namespace

// Re-lays out a GGUF Q4_1 matrix ([N, K / 32 blocks of 20 bytes], uint8 [N, K / 32 * 20]) for
// `q4_matmul`: uint8 [N / 16, K / 32, kGroupBytes]. N must be a multiple of 16, K of 32.
torch::Tensor q4_1_pack(const torch::Tensor& raw, int64_t k_len) {
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte && raw.is_contiguous(),
              "q4_1_pack: raw must be a contiguous uint8 [N, K / 32 * 20] tensor");
  const int64_t n_len = raw.size(0), blocks = k_len / kBlock;
  TORCH_CHECK(k_len % kBlock == 0 && raw.size(1) == blocks * 20,
              "q4_1_pack: K must be a multiple of 32 and each row K / 32 blocks of 20 bytes");
  TORCH_CHECK(n_len % kLanes == 0, "q4_1_pack: N must be a multiple of 16");
  torch::Tensor packed = torch::empty({n_len / kLanes, blocks, kGroupBytes}, raw.options());
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  for (int64_t p = 0; p < n_len / kLanes; ++p) {
    for (int64_t b = 0; b < blocks; ++b) {
      uint8_t* group = dst + (p * blocks + b) * kGroupBytes;
      float* d = reinterpret_cast<float*>(group);
      float* m = d + kLanes;
      for (int64_t n = 0; n < kLanes; ++n) {
        const uint8_t* block = src + ((p * kLanes + n) * blocks + b) * 20;
        at::Half half_d, half_m;
        std::memcpy(&half_d, block, 2);
        std::memcpy(&half_m, block + 2, 2);
        d[n] = static_cast<float>(half_d);
        m[n] = static_cast<float>(half_m);
        for (int64_t j = 0; j < kLanes; ++j) group[2 * kLanes * 4 + j * kLanes + n] = block[4 + j];
      }
    }
  }
  return packed;
}

// x: [M, K] float32 (rows may be strided); packed: from q4_1_pack. Returns [M, N] float32.
torch::Tensor q4_matmul(const torch::Tensor& x, const torch::Tensor& packed) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "q4_matmul: x must be a float32 [M, K] tensor with contiguous rows");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(2) == kGroupBytes,
              "q4_matmul: packed must come from q4_1_pack");
  const int64_t m_len = x.size(0), k_len = x.size(1), blocks = packed.size(1);
  TORCH_CHECK(blocks * kBlock == k_len, "q4_matmul: x has ", k_len, " columns, the weight ",
              blocks * kBlock);
  const int64_t n_len = packed.size(0) * kLanes;
  torch::Tensor out = torch::empty({m_len, n_len}, x.options());
  if (m_len == 0) return out;
  const float* xp = x.data_ptr<float>();
  const int64_t x_stride = x.stride(0);
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t panels = (n_len + kPanel - 1) / kPanel;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    // Not zero-filled: dequantization writes every float the products read, except the upper
    // half of a last panel of 16 features, zeroed below (its products are not stored).
    std::unique_ptr<float[]> buf(new float[k_len * kPanel]);
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n0 = p * kPanel, valid = std::min(kPanel, n_len - n0);
      for (int64_t half = 0; half * kLanes < valid; ++half)
        dequantize_16(wp + (n0 / kLanes + half) * blocks * kGroupBytes, blocks, buf.get(),
                      half * kLanes);
      if (valid < kPanel)
        for (int64_t k = 0; k < k_len; ++k) store(buf.get() + k * kPanel + kLanes, Vec{});
      int64_t r = 0;
      for (; r + kRows <= m_len; r += kRows)
        rows_times_panel<kRows>(xp + r * x_stride, x_stride, k_len, buf.get(),
                                op + r * n_len + n0, n_len, valid);
      if (r < m_len)
        tail<kRows - 1>(xp + r * x_stride, x_stride, k_len, buf.get(), op + r * n_len + n0,
                        n_len, valid, m_len - r);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q4_1_pack", &q4_1_pack, "Re-lay out a GGUF Q4_1 matrix for q4_matmul");
  m.def("q4_matmul", &q4_matmul, "x @ W^T with W in packed Q4_1 (float32, CPU)",
        py::call_guard<py::gil_scoped_release>());
}
