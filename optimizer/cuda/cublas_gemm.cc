// cuBLAS loaded at run time (cublas_gemm.h). The few entry points used are declared here by their
// documented C signatures and enum values (cublas_api.h), since the build has no cuBLAS headers.
#include "optimizer/cuda/cublas_gemm.h"

#include <dlfcn.h>

#include <cstdlib>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

namespace ckpt::optimizer::internal {
namespace {

using Status = int;  // cublasStatus_t: 0 is CUBLAS_STATUS_SUCCESS.
using CreateFn = Status (*)(void** handle);
using DestroyFn = Status (*)(void* handle);
using SetStreamFn = Status (*)(void* handle, cudaStream_t stream);
using SetMathModeFn = Status (*)(void* handle, int mode);
using GemmExFn = Status (*)(void* handle, int transa, int transb, int m, int n, int k,
                            const void* alpha, const void* a, int a_type, int lda, const void* b,
                            int b_type, int ldb, const void* beta, void* c, int c_type, int ldc,
                            int compute_type, int algo);
constexpr int kOpN = 0, kOpT = 1;  // cublasOperation_t.
constexpr int kBf16 = 14;          // cudaDataType CUDA_R_16BF.
constexpr int kCompute32F = 68;    // cublasComputeType_t CUBLAS_COMPUTE_32F.
constexpr int kGemmDefault = -1;   // cublasGemmAlgo_t CUBLAS_GEMM_DEFAULT.
// cublasMath_t CUBLAS_DEFAULT_MATH | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION: a split
// product's partial sums stay FP32, so each product is rounded to BF16 once, as torch's.
constexpr int kMathNoReducedReduction = 16;

struct Api {
  CreateFn create = nullptr;
  DestroyFn destroy = nullptr;
  SetStreamFn set_stream = nullptr;
  SetMathModeFn set_math_mode = nullptr;
  GemmExFn gemm = nullptr;
  std::string why;  // Why it is not loaded.
};

// Loaded once per process and never unloaded (handles of any engine may use it until exit).
const Api& LoadApi() {
  static const Api api = [] {
    Api a;
    const char* env = std::getenv("CKPT_CUBLAS");
    const std::string choice = env == nullptr ? "" : env;
    if (choice == "off") {
      a.why = "CKPT_CUBLAS=off";
      return a;
    }
    // The cuBLAS of the CUDA runtime ckpt was built with: another major version would bring
    // its own runtime into the process.
    const std::string name =
        choice.empty() ? absl::StrCat("libcublas.so.", CUDART_VERSION / 1000) : choice;
    void* lib = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      const char* error = dlerror();
      a.why = absl::StrCat("cannot load ", name, ": ", error == nullptr ? "not found" : error);
      return a;
    }
    a.create = reinterpret_cast<CreateFn>(dlsym(lib, "cublasCreate_v2"));
    a.destroy = reinterpret_cast<DestroyFn>(dlsym(lib, "cublasDestroy_v2"));
    a.set_stream = reinterpret_cast<SetStreamFn>(dlsym(lib, "cublasSetStream_v2"));
    a.set_math_mode = reinterpret_cast<SetMathModeFn>(dlsym(lib, "cublasSetMathMode"));
    a.gemm = reinterpret_cast<GemmExFn>(dlsym(lib, "cublasGemmEx"));
    if (a.create == nullptr || a.destroy == nullptr || a.set_stream == nullptr ||
        a.set_math_mode == nullptr || a.gemm == nullptr) {
      a.create = nullptr;
      a.why = absl::StrCat(name, " lacks cublasCreate_v2, cublasSetStream_v2, cublasSetMathMode "
                           "or cublasGemmEx");
    }
    return a;
  }();
  return api;
}

// C = bf16(alpha A op(B) + beta D), row-major, as LaunchGemmBf16. cuBLAS is column-major: a
// row-major matrix is its transpose there, so C^T = op(B)^T A^T, with D copied into C first for
// cuBLAS's in-place beta.
cudaError_t Product(void* handle, const uint16_t* a, const uint16_t* b, bool trans_b,
                    const uint16_t* d, uint16_t* c, int m, int n, int k, float alpha, float beta,
                    cudaStream_t stream) {
  const Api& api = LoadApi();
  if (d != nullptr) {
    const cudaError_t e = cudaMemcpyAsync(c, d, static_cast<size_t>(m) * n * 2,
                                          cudaMemcpyDeviceToDevice, stream);
    if (e != cudaSuccess) return e;
  } else {
    beta = 0.0f;  // C is not read.
  }
  if (api.set_stream(handle, stream) != 0) return cudaErrorUnknown;
  const Status s = api.gemm(handle, trans_b ? kOpT : kOpN, kOpN, n, m, k, &alpha, b, kBf16,
                            trans_b ? k : n, a, kBf16, k, &beta, c, kBf16, n, kCompute32F,
                            kGemmDefault);
  // cudaError_t carries no cuBLAS status: a failed product reports cudaErrorUnknown.
  return s == 0 ? cudaSuccess : cudaErrorUnknown;
}

}  // namespace

CublasGemm CublasGemm::Create(std::string* why) {
  CublasGemm g;
  const Api& api = LoadApi();
  if (api.create == nullptr) {
    *why = api.why;
    return g;
  }
  void* handle = nullptr;
  const Status s = api.create(&handle);
  if (s != 0) {
    *why = absl::StrCat("cublasCreate failed (status ", s, ")");
    return g;
  }
  g.handle_ = handle;
  const Status m = api.set_math_mode(handle, kMathNoReducedReduction);
  if (m != 0) {
    *why = absl::StrCat("cublasSetMathMode failed (status ", m, ")");
    return CublasGemm();  // g's destructor releases the handle.
  }
  return g;
}

CublasGemm::~CublasGemm() {
  if (handle_ != nullptr) LoadApi().destroy(handle_);
}

CublasGemm::CublasGemm(CublasGemm&& o) noexcept : handle_(std::exchange(o.handle_, nullptr)) {}

CublasGemm& CublasGemm::operator=(CublasGemm&& o) noexcept {
  if (this != &o) {
    if (handle_ != nullptr) LoadApi().destroy(handle_);
    handle_ = std::exchange(o.handle_, nullptr);
  }
  return *this;
}

GemmBackend CublasGemm::backend() const {
  return handle_ == nullptr ? GemmBackend{} : GemmBackend{&Product, handle_};
}

}  // namespace ckpt::optimizer::internal
