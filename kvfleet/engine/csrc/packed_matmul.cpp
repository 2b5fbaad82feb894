// Weight matmuls on weights packed once into MKL's internal layout (float32, CPU).
//
// `torch.mm` calls MKL's sgemm, which re-packs the weight matrix into its panel layout on
// every call; for the row counts an engine step has (1-128) that packing is a large part of
// the call. MKL's packed API packs once (cblas_sgemm_pack) and multiplies many times
// (cblas_sgemm_compute). The weight is the "A" matrix of a column-major product:
//   out^T [N x M] = W^T [N x K] * x^T [K x M]
// where W^T column-major with leading dimension N is exactly the row-major [K, N] (= [in, out])
// weight the model stores, and x / out row-major are x^T / out^T column-major.
//
// MKL's size query asks for more memory than the packed data fills (3-9x here). The buffer is
// a fresh anonymous mapping, not heap memory: its pages become resident only where MKL writes,
// so memory grows by about the weight's size (measured: 406 MiB for 405 MiB of weights). From
// malloc it could land on freed, already-resident heap pages, and all of it would count.
// The MKL symbols come from libtorch_cpu, which links MKL statically and exports them.
#include <sys/mman.h>
#include <torch/extension.h>

extern "C" {
size_t cblas_sgemm_pack_get_size(int identifier, int m, int n, int k);
void cblas_sgemm_pack(int layout, int identifier, int trans, int m, int n, int k, float alpha,
                      const float* src, int ld, float* dest);
void cblas_sgemm_compute(int layout, int transa, int transb, int m, int n, int k,
                         const float* a, int lda, const float* b, int ldb, float beta,
                         float* c, int ldc);
}

namespace {
constexpr int kColMajor = 102;
constexpr int kNoTrans = 111;
constexpr int kPacked = 151;
constexpr int kAMatrix = 161;
// Row count the packing is tuned for; any row count may use the result.
constexpr int kRowsHint = 64;
}  // namespace

torch::Tensor pack_weight(const torch::Tensor& weight_t) {
  TORCH_CHECK(weight_t.dim() == 2 && weight_t.scalar_type() == torch::kFloat32 &&
                  weight_t.is_contiguous() && weight_t.device().is_cpu(),
              "pack_weight: expected a contiguous float32 CPU [in, out] matrix");
  const int k = static_cast<int>(weight_t.size(0));
  const int n = static_cast<int>(weight_t.size(1));
  const size_t bytes = cblas_sgemm_pack_get_size(kAMatrix, n, kRowsHint, k);
  void* memory = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  TORCH_CHECK(memory != MAP_FAILED, "pack_weight: mapping ", bytes, " bytes failed");
  auto packed = torch::from_blob(
      memory, {static_cast<int64_t>(bytes / 4)},
      [bytes](void* p) { munmap(p, bytes); }, weight_t.options());
  cblas_sgemm_pack(kColMajor, kAMatrix, kNoTrans, n, kRowsHint, k, 1.0f,
                   weight_t.data_ptr<float>(), n, packed.data_ptr<float>());
  return packed;
}

torch::Tensor packed_matmul(const torch::Tensor& x, const torch::Tensor& packed, int64_t out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous() &&
                  x.device().is_cpu(),
              "packed_matmul: expected contiguous float32 CPU rows");
  const int m = static_cast<int>(x.size(0));
  const int k = static_cast<int>(x.size(1));
  const int n = static_cast<int>(out);
  auto result = torch::empty({m, n}, x.options());
  if (m == 0) return result;
  cblas_sgemm_compute(kColMajor, kPacked, kNoTrans, n, m, k, packed.data_ptr<float>(), n,
                      x.data_ptr<float>(), k, 0.0f, result.data_ptr<float>(), n);
  return result;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack_weight", &pack_weight, "Pack an [in, out] float32 weight for packed_matmul",
        py::call_guard<py::gil_scoped_release>());
  m.def("packed_matmul", &packed_matmul, "x @ weight for a weight from pack_weight",
        py::call_guard<py::gil_scoped_release>());
}
