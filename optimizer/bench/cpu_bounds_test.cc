// The benchmark's memory-only kernels and bound measurements: they must move exactly the step's
// bytes and compute what they claim, or the bound they print means nothing.
#include "optimizer/bench/cpu_bounds.h"

#include <cstring>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "optimizer/cpu_kernels.h"
#include "tests/support/status_matchers.h"
#include "tests/support/tensor_gen.h"

namespace ckpt::optimizer::internal {
namespace {

using formats::DType;
using testing::StatusIs;

std::vector<CpuIsa> SupportedIsas() {
  std::vector<CpuIsa> out;
  for (CpuIsa isa : {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (CpuSupports(isa)) out.push_back(isa);
  }
  return out;
}

TEST(TaskElemsTest, MultiplesOf64WithinLimitsAboutEightPerThread) {
  for (uint64_t total : {0ull, 1ull, 1000ull, 1ull << 20, 12345677ull, 1ull << 30}) {
    for (int threads : {1, 3, 16, 64}) {
      const uint64_t t = TaskElems(total, threads);
      SCOPED_TRACE(::testing::Message() << total << " elements, " << threads << " threads");
      EXPECT_EQ(t % 64, 0u);
      EXPECT_GE(t, 4096u);
      EXPECT_LE(t, 1u << 18);
      if (t > 4096 && t < (1u << 18)) {
        const uint64_t tasks = (total + t - 1) / t;
        EXPECT_GE(tasks, 8u * threads);
        EXPECT_LE(tasks, 9u * threads);
      }
    }
  }
  EXPECT_EQ(TaskElems(1ull << 30, 16), 1u << 18);  // Large models: the longest tasks.
  EXPECT_EQ(TaskElems(1000, 16), 4096u);           // Tiny ones: one task does it all.
}

float GradAt(const std::vector<std::byte>& g, DType dtype, size_t i) {
  if (dtype == DType::kF32) {
    float f;
    std::memcpy(&f, g.data() + 4 * i, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, g.data() + 2 * i, 2);
  return dtype == DType::kBF16 ? Bf16ToFloat(h) : HalfToFloat(h);
}

TEST(ShapedKernelTest, EveryIsaAddsTheScaledGradientToEachStreamAndWritesTheCopy) {
  const size_t n = 1000 + 37;  // The 32-wide loop, a 16-wide block and a scalar tail.
  for (CpuIsa isa : SupportedIsas()) {
    for (DType grad : {DType::kF32, DType::kBF16, DType::kF16}) {
      SCOPED_TRACE(::testing::Message() << IsaName(isa) << " " << formats::DTypeName(grad));
      const std::vector<float> g = testing::RandomNormal(n, 7, 1.0f);
      const std::vector<std::byte> grads = testing::EncodeFloats(g, grad);
      std::vector<float> master = testing::RandomNormal(n, 8, 1.0f), m(n, 0.5f), v(n, 0.25f);
      const std::vector<float> master0 = master;
      // Both a streaming-aligned and a misaligned copy destination.
      for (size_t shift : {0, 1}) {
        std::vector<uint16_t> storage(n + 64, 0xffff);
        uint16_t* params = storage.data() + shift +
                           (32 - reinterpret_cast<uintptr_t>(storage.data()) % 32) % 32 / 2;
        master = master0;
        std::fill(m.begin(), m.end(), 0.5f);
        std::fill(v.begin(), v.end(), 0.25f);
        KernelArgs a{master.data(), m.data(), v.data(), nullptr, grads.data(), params, n, 2.0f, {}};
        SelectShapedKernel(isa, grad, DType::kBF16)(a);
        for (size_t i = 0; i < n; ++i) {
          const float gi = GradAt(grads, grad, i) * 2.0f;
          ASSERT_EQ(master[i], master0[i] + gi) << i;
          ASSERT_EQ(m[i], 0.5f + gi) << i;
          ASSERT_EQ(v[i], 0.25f + gi) << i;
          ASSERT_EQ(params[i], FloatToBf16(master[i])) << i;
        }
      }
    }
  }
}

TEST(TriadTest, EveryIsaAndStoreKindComputesBPlusScaledC) {
  const size_t n = 4096 + 21;
  const std::vector<float> b = testing::RandomNormal(n, 1, 1.0f),
                           c = testing::RandomNormal(n, 2, 1.0f);
  for (CpuIsa isa : SupportedIsas()) {
    for (bool streaming : {true, false}) {
      for (size_t shift : {0, 1, 3}) {  // Destinations before, at and after a vector boundary.
        SCOPED_TRACE(::testing::Message()
                     << IsaName(isa) << " streaming=" << streaming << " +" << shift);
        std::vector<float> storage(n + 32, -1.0f);
        float* a = storage.data() + shift;
        TriadKernel(isa, streaming, a, b.data(), c.data(), 3.0f, n);
        for (size_t i = 0; i < n; ++i) ASSERT_EQ(a[i], b[i] + 3.0f * c[i]) << i;
        EXPECT_EQ(a[n], -1.0f);  // Nothing past the end.
      }
    }
  }
}

TEST(CpuBoundsTest, MeasurementsAreFiniteAndPositive) {
  absl::StatusOr<double> triad = MeasureTriadGBps(1 << 18, 2, CpuIsa::kAuto, 2);
  ASSERT_THAT(triad, testing::IsOk());
  EXPECT_GT(*triad, 0.0);
  EXPECT_LT(*triad, 1e5);
  const size_t n = 1 << 18;
  std::vector<float> g(n, 1.0f);
  std::vector<uint16_t> params(n);
  absl::StatusOr<double> shaped =
      MeasureShapedGparams(g.data(), DType::kF32, params.data(), n, 2, CpuIsa::kAuto, 2);
  ASSERT_THAT(shaped, testing::IsOk());
  EXPECT_GT(*shaped, 0.0);
  // Every pass added 1 to masters that started at zero: the copy shows how many passes ran.
  EXPECT_EQ(Bf16ToFloat(params[n - 1]), 3.0f);  // One touching pass and two timed ones.
}

TEST(CpuBoundsTest, EmptyOrUnsupportedInputIsRefused) {
  EXPECT_THAT(MeasureTriadGBps(0, 2, CpuIsa::kAuto, 1),
              StatusIs(absl::StatusCode::kInvalidArgument));
  std::vector<float> g(64, 1.0f);
  std::vector<uint16_t> params(64);
  EXPECT_THAT(MeasureShapedGparams(g.data(), DType::kF32, params.data(), 0, 2, CpuIsa::kAuto, 1),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(MeasureShapedGparams(g.data(), DType::kI32, params.data(), 64, 2, CpuIsa::kAuto, 1),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace ckpt::optimizer::internal
