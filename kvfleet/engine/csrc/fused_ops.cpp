// The elementwise parts of a Llama layer, one pass per row each: RMSNorm (with the residual
// add before it), RoPE on Q and K in place, and SiLU(gate) * up.
//
// As torch ops they are ~25 calls a layer (pow, mean, add, rsqrt, mul, mul; mul, roll, mul,
// add; silu, mul; the residual adds), each a dispatch, an allocation and a pass over memory:
// ~1,500 calls a step, a fixed cost that a decode step of one row pays in full, and the
// intermediate tensors of a 512-token prefill chunk (up to 6 MB each) go through L3.
//
// Every row is computed on its own, in a fixed order, so a row's bits do not depend on the
// other rows of the step or on the thread count. The formulas are HF's; results differ from
// the torch ops only by float32 rounding (the reduction order of the mean, fused
// multiply-adds, the exp of SiLU).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

#include "vec.h"

namespace {

using namespace kvfleet;

// Rows per parallel task: enough floats that a task outweighs waking a thread.
int64_t grain(int64_t row_floats) {
  return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, row_floats));
}

// out = w * (x * (1 / sqrt(mean(x^2) + eps))), HF's LlamaRMSNorm in float32.
void normalize_row(const float* x, const float* w, float* out, int64_t n, float eps) {
  Vec acc = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const Vec v = load(x + i);
    acc += v * v;
  }
  float sum = horizontal_sum(acc);
  for (; i < n; ++i) sum += x[i] * x[i];
  const float r = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
  i = 0;
  for (; i + kLanes <= n; i += kLanes) store(out + i, load(w + i) * (load(x + i) * r));
  for (; i < n; ++i) out[i] = w[i] * (x[i] * r);
}

void check_rows(const torch::Tensor& x, const char* fn, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, fn, ": ",
              name, " must be a float32 [rows, features] tensor with contiguous rows");
}

void check_weight(const torch::Tensor& x, const torch::Tensor& weight, const char* fn) {
  TORCH_CHECK(weight.dim() == 1 && weight.scalar_type() == at::kFloat &&
                  weight.is_contiguous() && weight.size(0) == x.size(1),
              fn, ": weight must be a contiguous float32 [", x.size(1), "] tensor");
}

}  // namespace

// RMSNorm of each row of x [T, H] by weight [H]. Returns a new contiguous [T, H].
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  check_rows(x, "rms_norm", "x");
  check_weight(x, weight, "rms_norm");
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  torch::Tensor out = torch::empty({rows, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      normalize_row(xp + r * stride, wp, op + r * n, n, static_cast<float>(eps));
  });
  return out;
}

// hidden += delta (in place; hidden [T, H] contiguous), then RMSNorm of the new hidden by
// weight. Returns the normalized rows, a new [T, H]: a layer's residual add and the norm
// that follows it, in one pass over rows that stay in L1.
torch::Tensor add_rms_norm_(torch::Tensor hidden, const torch::Tensor& delta,
                            const torch::Tensor& weight, double eps) {
  check_rows(hidden, "add_rms_norm_", "hidden");
  check_rows(delta, "add_rms_norm_", "delta");
  check_weight(hidden, weight, "add_rms_norm_");
  TORCH_CHECK(hidden.is_contiguous() && delta.sizes() == hidden.sizes(),
              "add_rms_norm_: hidden must be contiguous and delta the same shape");
  const int64_t rows = hidden.size(0), n = hidden.size(1), d_stride = delta.stride(0);
  torch::Tensor out = torch::empty({rows, n}, hidden.options());
  float* hp = hidden.data_ptr<float>();
  const float* dp = delta.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* h = hp + r * n;
      const float* d = dp + r * d_stride;
      int64_t i = 0;
      for (; i + kLanes <= n; i += kLanes) store(h + i, load(h + i) + load(d + i));
      for (; i < n; ++i) h[i] += d[i];
      normalize_row(h, wp, op + r * n, n, static_cast<float>(eps));
    }
  });
  return out;
}

// silu(gate) * up for gate_up [T, 2I] (gate then up, as the fused projection returns them).
// Returns [T, I]. silu(g) = g / (1 + exp(-g)), as torch computes it.
torch::Tensor silu_mul(const torch::Tensor& gate_up) {
  check_rows(gate_up, "silu_mul", "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_mul: gate_up must have an even width");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2, stride = gate_up.stride(0);
  torch::Tensor out = torch::empty({rows, n}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, grain(2 * n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = gp + r * stride;
      const float* u = g + n;
      float* o = op + r * n;
      int64_t i = 0;
      for (; i + kLanes <= n; i += kLanes) {
        const Vec gv = load(g + i);
        store(o + i, gv / (1.f + vexp(-gv)) * load(u + i));
      }
      for (; i < n; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  });
  return out;
}

// RoPE in place on the first `heads` heads of each row of x [T, >= heads * D] (Q then K of
// the fused projection; V after them is left alone): per head, y = x * cos + roll(x, D / 2)
// * sin_signed, with cos, sin_signed [T, D] (sin_signed = (-sin1, sin2): HF's rotate_half).
void rope_(torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& sin_signed,
           int64_t heads, int64_t head_dim) {
  check_rows(x, "rope_", "x");
  TORCH_CHECK(head_dim > 0 && head_dim % 2 == 0 && head_dim <= 1024 &&
                  heads * head_dim <= x.size(1),
              "rope_: heads * head_dim must fit a row and head_dim be even, <= 1024");
  for (const torch::Tensor* t : {&cos, &sin_signed})
    TORCH_CHECK(t->dim() == 2 && t->scalar_type() == at::kFloat && t->is_contiguous() &&
                    t->size(0) == x.size(0) && t->size(1) == head_dim,
                "rope_: cos and sin_signed must be contiguous float32 [", x.size(0), ", ",
                head_dim, "]");
  const int64_t rows = x.size(0), stride = x.stride(0), half = head_dim / 2;
  float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin_signed.data_ptr<float>();
  at::parallel_for(0, rows, grain(heads * head_dim), [&](int64_t begin, int64_t end) {
    float rolled[1024];
    for (int64_t r = begin; r < end; ++r) {
      const float* c = cp + r * head_dim;
      const float* s = sp + r * head_dim;
      for (int64_t h = 0; h < heads; ++h) {
        float* v = xp + r * stride + h * head_dim;
        std::copy(v + half, v + head_dim, rolled);
        std::copy(v, v + half, rolled + half);
        int64_t i = 0;
        for (; i + kLanes <= head_dim; i += kLanes)
          store(v + i, load(v + i) * load(c + i) + load(rolled + i) * load(s + i));
        for (; i < head_dim; ++i) v[i] = v[i] * c[i] + rolled[i] * s[i];
      }
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm of each row (float32, CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("add_rms_norm_", &add_rms_norm_,
        "hidden += delta in place, then RMSNorm of each row (float32, CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a fused gate/up projection (float32, CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("rope_", &rope_, "RoPE in place on the leading heads of each row (float32, CPU)",
        py::call_guard<py::gil_scoped_release>());
}
