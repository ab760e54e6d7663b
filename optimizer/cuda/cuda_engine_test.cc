// CUDA engine tests (label `cuda`): skipped when no device is visible.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <iostream>
#include <string>
#include <random>
#include <span>
#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "ckpt/checkpoint_store.h"
#include "ckpt/coordinator.h"
#include "ckpt/formats/float_convert.h"
#include "ckpt/optimizer/checkpointer.h"
#include "ckpt/optimizer/staged_adamw.h"
#include "optimizer/cuda/cublas_gemm.h"
#include "optimizer/cuda/cuda_resources.h"
#include "optimizer/cuda/muon_kernel.h"
#include "optimizer/engine.h"
#include "optimizer/rules/muon/muon.h"
#include "tests/support/numeric.h"
#include "tests/support/status_matchers.h"
#include "tests/support/tensor_gen.h"

namespace ckpt::optimizer {
namespace {

using formats::DType;
using testing::IsOk;
using testing::MaxRelError;
constexpr auto Random = testing::RandomNormal;
constexpr auto Encode = testing::EncodeFloats;

bool HaveDevice() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

#define SKIP_WITHOUT_DEVICE() \
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device visible"

StagedAdamWOptions Options(EngineKind engine, MomentDType moments, uint64_t unit_bytes) {
  StagedAdamWOptions o;
  o.params = {{"a", {37, 3}, DType::kBF16, 0},
              {"b", {100001}, DType::kBF16, 1},
              {"c", {4097}, DType::kBF16, 0}};
  o.groups = {
      ParamGroup{.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .weight_decay = 0.1f},
      ParamGroup{.lr = 3e-3f, .beta1 = 0.8f, .beta2 = 0.95f, .eps = 1e-6f, .weight_decay = 0.0f}};
  o.pieces = {{0, 5, 100}, {1, 0, 100001}, {2, 0, 4097}};
  o.engine = engine;
  o.moment_dtype = moments;
  o.unit_bytes = unit_bytes;
  return o;
}

uint64_t Size(const StagedAdamWOptions& o) {
  uint64_t n = 0;
  for (const Piece& p : o.pieces) n += p.count;
  return n;
}

struct State {
  std::vector<float> master;
  std::vector<std::byte> m, v, x, params;  // x: max_exp_avg_sq (AMSGrad), empty without.
};

// Runs `steps` steps with gradients of `grad_dtype`; the CUDA engine gets device buffers.
// With `masks`, step k steps the parameters (*masks)[k] flags (StepArgs::stepped).
State RunEngine(const StagedAdamWOptions& o, DType grad_dtype, int steps,
                bool release_between = false,
                const std::vector<std::vector<uint8_t>>* masks = nullptr) {
  const uint64_t n = Size(o);
  auto opt = StagedAdamW::Create(o, Encode(Random(n, 1, 1.0f), DType::kBF16));
  EXPECT_THAT(opt, IsOk());
  State s;
  s.params.assign(n * 2, std::byte{0});
  const bool cuda = o.engine == EngineKind::kCuda;
  void* dgrads = nullptr;
  void* dparams = nullptr;
  cudaStream_t stream = nullptr;
  if (cuda) {
    EXPECT_EQ(cudaMalloc(&dgrads, n * formats::DTypeSize(grad_dtype)), cudaSuccess);
    EXPECT_EQ(cudaMalloc(&dparams, n * 2), cudaSuccess);
    EXPECT_EQ(cudaMemset(dparams, 0, n * 2), cudaSuccess);  // As s.params: skipped stay so.
    EXPECT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  }
  for (int step = 0; step < steps; ++step) {
    std::vector<float> g = Random(n, 100 + step, 0.5f);
    for (size_t i = 0; i < n; i += 3) g[i] = 0.0f;
    std::vector<std::byte> gb = Encode(g, grad_dtype);
    StepArgs args{gb.data(), grad_dtype, 0.75f, s.params.data()};
    if (masks != nullptr) args.stepped = (*masks)[static_cast<size_t>(step)];
    if (cuda) {
      EXPECT_EQ(cudaMemcpyAsync(dgrads, gb.data(), gb.size(), cudaMemcpyHostToDevice, stream),
                cudaSuccess);
      args.grads = dgrads;
      args.params = dparams;
      args.stream = CudaStreamView::Of(reinterpret_cast<CUstream_st*>(stream)).value();
    }
    auto report = (*opt)->Step(args);
    EXPECT_THAT(report, IsOk());
    if (cuda) {
      EXPECT_EQ(cudaStreamWaitEvent(stream, reinterpret_cast<cudaEvent_t>(report->done), 0),
                cudaSuccess);
      EXPECT_EQ(cudaMemcpyAsync(s.params.data(), dparams, n * 2, cudaMemcpyDeviceToHost, stream),
                cudaSuccess);
      EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      if (release_between) {
        CKPT_EXPECT_OK((*opt)->ReleaseDevice());
        EXPECT_EQ((*opt)->device_bytes(), 0u);
        CKPT_EXPECT_OK((*opt)->RestoreDevice());
      }
    }
  }
  CKPT_EXPECT_OK((*opt)->Synchronize());
  s.master.assign((*opt)->master().begin(), (*opt)->master().end());
  const size_t mb = MomentBytes(o.moment_dtype);
  s.m.assign((*opt)->exp_avg_bytes().begin(), (*opt)->exp_avg_bytes().end());
  s.v.assign((*opt)->exp_avg_sq_bytes().begin(), (*opt)->exp_avg_sq_bytes().end());
  s.x.assign((*opt)->max_exp_avg_sq_bytes().begin(), (*opt)->max_exp_avg_sq_bytes().end());
  EXPECT_EQ(s.m.size(), n * mb);
  if (cuda) {
    cudaFree(dgrads);
    cudaFree(dparams);
    cudaStreamDestroy(stream);
  }
  return s;
}

// Same operations in the same order with IEEE rounding: every bit must agree.
void ExpectSameState(const State& gpu, const State& cpu) {
  EXPECT_LE(MaxRelError(gpu.master, cpu.master), 2e-6);
  EXPECT_EQ(gpu.params, cpu.params) << "BF16 weights must be bit-exact";
  EXPECT_EQ(std::memcmp(gpu.master.data(), cpu.master.data(), 4 * cpu.master.size()), 0);
  EXPECT_EQ(gpu.m, cpu.m);
  EXPECT_EQ(gpu.v, cpu.v);
  EXPECT_EQ(gpu.x, cpu.x);
}

// The flat weight bytes of `o`'s pieces from `init` (one value per element), each piece in its
// parameter's dtype at a multiple of its element size (StagedAdamW's weight layout).
std::vector<std::byte> FlatWeights(const StagedAdamWOptions& o, const std::vector<float>& init) {
  std::vector<std::byte> weights;
  uint64_t at = 0;
  for (const Piece& p : o.pieces) {
    const DType d = o.params[p.param].dtype;
    const size_t size = formats::DTypeSize(d);
    weights.resize((weights.size() + size - 1) / size * size);
    const std::vector<std::byte> b =
        Encode(std::vector<float>(init.begin() + at, init.begin() + at + p.count), d);
    weights.insert(weights.end(), b.begin(), b.end());
    at += p.count;
  }
  return weights;
}

// One device buffer of FP32 gradients and one of weights per piece (the parameters' own
// storage, as the Python package passes them), freed with this object.
class DevicePieces {
 public:
  // The weights from `weights` (the optimizer's flat weight bytes), or zeros when empty.
  DevicePieces(const StagedAdamW& opt, const std::vector<std::byte>& weights) : opt_(opt) {
    const StagedAdamWOptions& o = opt.options();
    for (size_t k = 0; k < o.pieces.size(); ++k) {
      const uint64_t count = o.pieces[k].count;
      const size_t wbytes = count * formats::DTypeSize(o.params[o.pieces[k].param].dtype);
      void* g = nullptr;
      void* w = nullptr;
      EXPECT_EQ(cudaMalloc(&g, count * 4), cudaSuccess);
      EXPECT_EQ(cudaMalloc(&w, wbytes), cudaSuccess);
      if (weights.empty()) {
        EXPECT_EQ(cudaMemset(w, 0, wbytes), cudaSuccess);
      } else {
        EXPECT_EQ(cudaMemcpy(w, weights.data() + opt.piece_weight_offset(k), wbytes,
                             cudaMemcpyHostToDevice),
                  cudaSuccess);
      }
      buffers_.push_back({g, w});
    }
  }
  DevicePieces(const DevicePieces&) = delete;
  DevicePieces& operator=(const DevicePieces&) = delete;
  ~DevicePieces() {
    for (const PieceBuffers& b : buffers_) {
      cudaFree(const_cast<void*>(b.grads));
      cudaFree(b.params);
    }
  }
  std::span<const PieceBuffers> buffers() const { return buffers_; }
  // Every piece's gradients from `g` (all pieces back to back), queued on `stream`.
  void Upload(const std::vector<float>& g, cudaStream_t stream) {
    uint64_t at = 0;
    for (size_t k = 0; k < buffers_.size(); ++k) {
      const uint64_t count = opt_.options().pieces[k].count;
      EXPECT_EQ(cudaMemcpyAsync(const_cast<void*>(buffers_[k].grads), g.data() + at,
                                count * 4, cudaMemcpyHostToDevice, stream),
                cudaSuccess);
      at += count;
    }
    EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);  // `g` may go.
  }
  // Every piece's weights, in the optimizer's flat layout, after what `stream` queued so far.
  std::vector<std::byte> Weights(cudaStream_t stream) const {
    const StagedAdamWOptions& o = opt_.options();
    std::vector<std::byte> out(opt_.weight_bytes());
    for (size_t k = 0; k < buffers_.size(); ++k) {
      EXPECT_EQ(cudaMemcpyAsync(out.data() + opt_.piece_weight_offset(k), buffers_[k].params,
                                o.pieces[k].count *
                                    formats::DTypeSize(o.params[o.pieces[k].param].dtype),
                                cudaMemcpyDeviceToHost, stream),
                cudaSuccess);
    }
    EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    return out;
  }

 private:
  const StagedAdamW& opt_;
  std::vector<PieceBuffers> buffers_;
};

// RunEngine for the CUDA engine with an async save of the state after step 0 in flight for the
// remaining steps (Checkpointer over a MemEnv store, `pool` bytes of staging), finalized after
// the last; `saved_master_b` receives the checkpoint's masters of parameter `name` (`count`
// elements).
State RunCudaUnderAsyncSave(const StagedAdamWOptions& o, int steps, uint64_t pool,
                            std::vector<float>* saved_master_b, const std::string& name = "b",
                            uint64_t count = 100001) {
  const uint64_t n = Size(o);
  auto opt = StagedAdamW::Create(o, Encode(Random(n, 1, 1.0f), DType::kBF16));
  EXPECT_THAT(opt, IsOk());
  std::unique_ptr<Env> mem = NewMemEnv();
  StoreOptions so;
  so.env = mem.get();
  auto store = CheckpointStore::Open("/store", so);
  EXPECT_THAT(store, IsOk());
  SingleProcessCoordinator solo;
  State s;
  s.params.assign(n * 2, std::byte{0});
  auto ckpt = Checkpointer::Create(opt->get(), store->get(), &solo, {.async_staging_bytes = pool});
  EXPECT_THAT(ckpt, IsOk());
  void* dgrads = nullptr;
  void* dparams = nullptr;
  cudaStream_t stream = nullptr;
  EXPECT_EQ(cudaMalloc(&dgrads, n * 4), cudaSuccess);
  EXPECT_EQ(cudaMalloc(&dparams, n * 2), cudaSuccess);
  EXPECT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  std::unique_ptr<PendingSave> pending;
  for (int step = 0; step < steps; ++step) {
    std::vector<float> g = Random(n, 100 + step, 0.5f);
    for (size_t i = 0; i < n; i += 3) g[i] = 0.0f;
    std::vector<std::byte> gb = Encode(g, DType::kF32);
    EXPECT_EQ(cudaMemcpyAsync(dgrads, gb.data(), gb.size(), cudaMemcpyHostToDevice, stream),
              cudaSuccess);
    StepArgs args{dgrads, DType::kF32, 0.75f, dparams};
    args.stream = CudaStreamView::Of(reinterpret_cast<CUstream_st*>(stream)).value();
    auto report = (*opt)->Step(args);
    EXPECT_THAT(report, IsOk());
    EXPECT_EQ(cudaStreamWaitEvent(stream, reinterpret_cast<cudaEvent_t>(report->done), 0),
              cudaSuccess);
    EXPECT_EQ(cudaMemcpyAsync(s.params.data(), dparams, n * 2, cudaMemcpyDeviceToHost, stream),
              cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    if (step == 0) {
      auto p = (*ckpt)->SaveAsync(1);
      EXPECT_THAT(p, IsOk());
      if (p.ok()) pending = *std::move(p);
    }
  }
  if (pending != nullptr) {
    CKPT_EXPECT_OK(pending->Finalize());
    EXPECT_GT(pending->report().units, 4u);
  }
  CKPT_EXPECT_OK((*opt)->Synchronize());
  s.master.assign((*opt)->master().begin(), (*opt)->master().end());
  s.m.assign((*opt)->exp_avg_bytes().begin(), (*opt)->exp_avg_bytes().end());
  s.v.assign((*opt)->exp_avg_sq_bytes().begin(), (*opt)->exp_avg_sq_bytes().end());
  s.x.assign((*opt)->max_exp_avg_sq_bytes().begin(), (*opt)->max_exp_avg_sq_bytes().end());
  auto reader = (*store)->OpenLatest();
  EXPECT_THAT(reader, IsOk());
  if (reader.ok()) {
    saved_master_b->assign(count, 0.0f);
    CKPT_EXPECT_OK((*reader)->ReadRange("optimizer.master." + name, 0, count,
                                        std::as_writable_bytes(std::span(*saved_master_b))));
  }
  cudaFree(dgrads);
  cudaFree(dparams);
  cudaStreamDestroy(stream);
  return s;
}

// A step fenced by an async save passes its units to the engine in batches, so a unit may run
// in another slot than in the step before: the result must still equal the CPU engine's, and
// the checkpoint must hold the state at the call. Staging of 0 (every unit waits for the
// writer) and of 1 GiB (units copied aside).
TEST(CudaEngineTest, StepsFencedByAnAsyncSaveMatchTheCpuEngine) {
  SKIP_WITHOUT_DEVICE();
  const uint64_t unit_bytes = 16 << 10;  // Dozens of units.
  const State cpu = RunEngine(Options(EngineKind::kCpu, MomentDType::kF32, unit_bytes),
                              DType::kF32, 5);
  const State cpu_at_save = RunEngine(Options(EngineKind::kCpu, MomentDType::kF32, unit_bytes),
                                      DType::kF32, 1);
  const std::vector<float> want_b(cpu_at_save.master.begin() + 100,
                                  cpu_at_save.master.begin() + 100 + 100001);
  for (uint64_t pool : {uint64_t{0}, uint64_t{1} << 30}) {
    std::vector<float> saved_b;
    const State gpu = RunCudaUnderAsyncSave(
        Options(EngineKind::kCuda, MomentDType::kF32, unit_bytes), 5, pool, &saved_b);
    ExpectSameState(gpu, cpu);
    EXPECT_EQ(std::memcmp(saved_b.data(), want_b.data(), want_b.size() * 4), 0)
        << "the checkpoint does not hold the state at the call (pool " << pool << ")";
  }
}

class CudaParityTest : public ::testing::TestWithParam<DType> {};

TEST_P(CudaParityTest, Fp32MomentsMatchTheCpuEngine) {
  SKIP_WITHOUT_DEVICE();
  const uint64_t unit = 64 << 10;  // Many units: every slot is reused many times.
  State cpu = RunEngine(Options(EngineKind::kCpu, MomentDType::kF32, unit), GetParam(), 4);
  State gpu = RunEngine(Options(EngineKind::kCuda, MomentDType::kF32, unit), GetParam(), 4);
  ExpectSameState(gpu, cpu);
}

// BF16 moments: the CPU engine's precision-aware mode is checked against a host emulation of the
// recurrence in optimizer_test (Bf16MomentsTest); here the CUDA engine must match it bit for bit.
TEST_P(CudaParityTest, Bf16MomentsMatchTheCpuEngine) {
  SKIP_WITHOUT_DEVICE();
  const uint64_t unit = 64 << 10;
  State cpu = RunEngine(Options(EngineKind::kCpu, MomentDType::kBF16, unit), GetParam(), 4);
  State gpu = RunEngine(Options(EngineKind::kCuda, MomentDType::kBF16, unit), GetParam(), 4);
  ExpectSameState(gpu, cpu);
}

INSTANTIATE_TEST_SUITE_P(GradDtypes, CudaParityTest,
                         ::testing::Values(DType::kF32, DType::kBF16, DType::kF16),
                         [](const ::testing::TestParamInfo<DType>& p) {
                           return std::string(formats::DTypeName(p.param));
                         });

// Move-assignment releases what the target owned and leaves the source owning nothing (it used
// to swap, so a moved-from object still held the target's old stream).
TEST(CudaResourcesTest, MoveAssignmentReleasesTheOldResourceAndEmptiesTheSource) {
  SKIP_WITHOUT_DEVICE();
  size_t free_before = 0, total = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_before, &total), cudaSuccess);
  {
    auto a = internal::DeviceBuffer::Create(size_t{256} << 20);
    auto b = internal::DeviceBuffer::Create(size_t{256} << 20);
    ASSERT_THAT(a, IsOk());
    ASSERT_THAT(b, IsOk());
    void* b_data = b->data();
    *a = std::move(*b);
    EXPECT_FALSE(b->valid());
    EXPECT_EQ(b->size(), 0u);
    EXPECT_EQ(a->data(), b_data);
    size_t free_now = 0;
    ASSERT_EQ(cudaMemGetInfo(&free_now, &total), cudaSuccess);
    // One 256 MiB buffer is alive, not two.
    EXPECT_GT(free_now + (size_t{384} << 20), free_before);
    auto s1 = internal::CudaStream::Create();
    auto s2 = internal::CudaStream::Create();
    ASSERT_THAT(s1, IsOk());
    ASSERT_THAT(s2, IsOk());
    cudaStream_t kept = s2->get();
    *s1 = std::move(*s2);
    EXPECT_FALSE(s2->valid());
    EXPECT_EQ(s1->get(), kept);
    auto e1 = internal::CudaEvent::Create();
    auto e2 = internal::CudaEvent::Create();
    ASSERT_THAT(e1, IsOk());
    ASSERT_THAT(e2, IsOk());
    *e1 = std::move(*e2);
    EXPECT_FALSE(e2->valid());
    EXPECT_TRUE(e1->valid());
  }
}

TEST(CudaEngineTest, GradientWrittenLateOnTheCallersStreamIsSeen) {
  SKIP_WITHOUT_DEVICE();
  StagedAdamWOptions o = Options(EngineKind::kCuda, MomentDType::kF32, 64 << 10);
  const uint64_t n = Size(o);
  State expected = RunEngine(o, DType::kF32, 1);
  auto opt = StagedAdamW::Create(o, Encode(Random(n, 1, 1.0f), DType::kBF16));
  CKPT_ASSERT_OK(opt);
  void* dgrads = nullptr;
  void* dparams = nullptr;
  cudaStream_t stream;
  ASSERT_EQ(cudaMalloc(&dgrads, n * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dparams, n * 2), cudaSuccess);
  ASSERT_EQ(cudaMemset(dgrads, 0x7f, n * 4), cudaSuccess);  // Garbage until the late write.
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  std::vector<float> g = Random(n, 100, 0.5f);
  for (size_t i = 0; i < n; i += 3) g[i] = 0.0f;
  // The caller's stream is busy for 300 ms, then writes the real gradients.
  ASSERT_EQ(cudaLaunchHostFunc(
                stream, [](void*) { std::this_thread::sleep_for(std::chrono::milliseconds(300)); },
                nullptr),
            cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(dgrads, g.data(), n * 4, cudaMemcpyHostToDevice, stream), cudaSuccess);
  StepArgs args{dgrads, DType::kF32, 0.75f, dparams};
  args.stream = CudaStreamView::Of(reinterpret_cast<CUstream_st*>(stream)).value();
  auto report = (*opt)->Step(args);
  CKPT_ASSERT_OK(report);
  std::vector<std::byte> params(n * 2);
  // No wait on report->done: Step orders the caller's stream after its writes of the
  // parameters, so the copy queued next sees them.
  ASSERT_EQ(cudaMemcpyAsync(params.data(), dparams, n * 2, cudaMemcpyDeviceToHost, stream),
            cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  CKPT_ASSERT_OK((*opt)->Synchronize());
  EXPECT_EQ(params, expected.params);
  EXPECT_EQ(std::memcmp((*opt)->master().data(), expected.master.data(), 4 * n), 0);
  cudaFree(dgrads);
  cudaFree(dparams);
  cudaStreamDestroy(stream);
}

// WriteModelWeights on the CUDA engine: to device memory through the slots, ordered on the
// caller's stream after its earlier work (a late memset of the destination is overwritten, not
// overwriting), and to host memory after the last step's copies: both what Step wrote.
TEST(CudaEngineTest, WriteModelWeightsToDeviceAndHostEqualsWhatTheStepWrote) {
  SKIP_WITHOUT_DEVICE();
  StagedAdamWOptions o = Options(EngineKind::kCuda, MomentDType::kF32, 64 << 10);
  const uint64_t n = Size(o);
  State expected = RunEngine(o, DType::kF32, 2);
  auto opt = StagedAdamW::Create(o, Encode(Random(n, 1, 1.0f), DType::kBF16));
  CKPT_ASSERT_OK(opt);
  void* dgrads = nullptr;
  void* dparams = nullptr;
  void* dout = nullptr;
  cudaStream_t stream;
  ASSERT_EQ(cudaMalloc(&dgrads, n * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dparams, n * 2), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dout, n * 2), cudaSuccess);
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  const CudaStreamView view = CudaStreamView::Of(reinterpret_cast<CUstream_st*>(stream)).value();
  for (int s = 0; s < 2; ++s) {
    std::vector<float> g = Random(n, 100 + s, 0.5f);
    for (size_t i = 0; i < n; i += 3) g[i] = 0.0f;
    ASSERT_EQ(cudaMemcpy(dgrads, g.data(), n * 4, cudaMemcpyHostToDevice), cudaSuccess);
    StepArgs args{dgrads, DType::kF32, 0.75f, dparams};  // RunEngine's scale.
    args.stream = view;
    CKPT_ASSERT_OK((*opt)->Step(args));
  }
  ASSERT_EQ(cudaLaunchHostFunc(
                stream, [](void*) { std::this_thread::sleep_for(std::chrono::milliseconds(200)); },
                nullptr),
            cudaSuccess);
  ASSERT_EQ(cudaMemsetAsync(dout, 0x7f, n * 2, stream), cudaSuccess);
  CKPT_ASSERT_OK((*opt)->WriteModelWeights(dout, view));
  std::vector<std::byte> on_device(n * 2), on_host(n * 2, std::byte{0});
  ASSERT_EQ(cudaMemcpyAsync(on_device.data(), dout, n * 2, cudaMemcpyDeviceToHost, stream),
            cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(on_device, expected.params);
  CKPT_ASSERT_OK((*opt)->WriteModelWeights(on_host.data()));
  EXPECT_EQ(on_host, expected.params);
  // The next step is unchanged by the write's use of the slots.
  CKPT_ASSERT_OK((*opt)->Synchronize());
  EXPECT_EQ(std::memcmp((*opt)->master().data(), expected.master.data(), 4 * n), 0);
  cudaFree(dgrads);
  cudaFree(dparams);
  cudaFree(dout);
  cudaStreamDestroy(stream);
}

// The CUDA engine on each piece's own device buffers (StepArgs::pieces: kernels cut at the
// pieces' boundaries) equals the step on flat device buffers, check_finite included.
// Parameters skipped in some steps (StepArgs::stepped): whole units skipped, and units whose
// runs are partly skipped (the state copied through the slot unchanged), equal the CPU engine
// bit for bit, per-parameter bias corrections included.
TEST(CudaEngineTest, SkippedParametersMatchTheCpuEngine) {
  SKIP_WITHOUT_DEVICE();
  const std::vector<std::vector<uint8_t>> masks = {
      {1, 1, 1, 1}, {1, 0, 1, 1}, {1, 1, 1, 0}, {0, 0, 0, 0}, {0, 1, 0, 1}, {1, 1, 1, 1}};
  for (uint64_t unit_bytes : {uint64_t{64} << 10, uint64_t{256}}) {
    SCOPED_TRACE(unit_bytes);
    StagedAdamWOptions o = Options(EngineKind::kCuda, MomentDType::kF32, unit_bytes);
    // "d" follows "b" in its group: the last unit of "b" holds "d" too.
    o.params.push_back({"d", {300}, DType::kBF16, 1});
    o.pieces = {{0, 5, 100}, {2, 0, 4097}, {1, 0, 100001}, {3, 0, 300}};
    StagedAdamWOptions cpu = o;
    cpu.engine = EngineKind::kCpu;
    ExpectSameState(RunEngine(o, DType::kF32, 6, false, &masks),
                    RunEngine(cpu, DType::kF32, 6, false, &masks));
  }
}

// AMSGrad in group 1 (not group 0, whose maximum the slots copy through unchanged), with
// skipped parameters, both moment dtypes, and under an async save's fence (units copied aside
// with their maximum): bit for bit the CPU engine's.
TEST(CudaEngineTest, AmsgradMatchesTheCpuEngine) {
  SKIP_WITHOUT_DEVICE();
  const std::vector<std::vector<uint8_t>> masks = {
      {1, 1, 1}, {1, 0, 1}, {1, 1, 0}, {0, 0, 0}, {1, 1, 1}};
  for (MomentDType moments : {MomentDType::kF32, MomentDType::kBF16}) {
    StagedAdamWOptions o = Options(EngineKind::kCuda, moments, 16 << 10);
    o.groups[1].amsgrad = true;
    StagedAdamWOptions cpu = o;
    cpu.engine = EngineKind::kCpu;
    const State want = RunEngine(cpu, DType::kF32, 5, false, &masks);
    ASSERT_EQ(want.x.size(), Size(o) * MomentBytes(moments));
    ExpectSameState(RunEngine(o, DType::kF32, 5, false, &masks), want);
  }
  StagedAdamWOptions o = Options(EngineKind::kCuda, MomentDType::kF32, 16 << 10);
  o.groups[1].amsgrad = true;
  StagedAdamWOptions cpu = o;
  cpu.engine = EngineKind::kCpu;
  std::vector<float> saved_b;
  ExpectSameState(RunCudaUnderAsyncSave(o, 5, uint64_t{1} << 30, &saved_b),
                  RunEngine(cpu, DType::kF32, 5));
}

// Parameters of FP32, BF16 and FP16 in one optimizer: the CUDA engine writes each in its own
// dtype (flat device buffer, each piece at its offset) and equals the CPU engine bit for bit;
// WriteModelWeights into each piece's device buffer writes the same bytes.
TEST(CudaEngineTest, MixedDtypesMatchTheCpuEngine) {
  SKIP_WITHOUT_DEVICE();
  StagedAdamWOptions o = Options(EngineKind::kCuda, MomentDType::kF32, 64 << 10);
  o.params[0].dtype = DType::kF32;
  o.params[2].dtype = DType::kF16;
  const uint64_t n = Size(o);
  const std::vector<std::byte> weights = FlatWeights(o, Random(n, 1, 1.0f));
  StagedAdamWOptions cpu_options = o;
  cpu_options.engine = EngineKind::kCpu;
  auto gpu = StagedAdamW::Create(o, weights);
  auto cpu = StagedAdamW::Create(cpu_options, weights);
  CKPT_ASSERT_OK(gpu);
  CKPT_ASSERT_OK(cpu);
  ASSERT_EQ((*gpu)->weight_bytes(), weights.size());
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  const CudaStreamView view = CudaStreamView::Of(reinterpret_cast<CUstream_st*>(stream)).value();
  void* dgrads = nullptr;
  void* dparams = nullptr;
  ASSERT_EQ(cudaMalloc(&dgrads, n * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dparams, weights.size()), cudaSuccess);
  std::vector<std::byte> host_params(weights.size());
  for (int s = 0; s < 3; ++s) {
    const std::vector<float> g = Random(n, 100 + s, 0.5f);
    ASSERT_EQ(cudaMemcpy(dgrads, g.data(), n * 4, cudaMemcpyHostToDevice), cudaSuccess);
    StepArgs args{dgrads, DType::kF32, 0.75f, dparams};
    args.stream = view;
    CKPT_ASSERT_OK((*gpu)->Step(args));
    CKPT_ASSERT_OK((*cpu)->Step({g.data(), DType::kF32, 0.75f, host_params.data()}));
  }
  std::vector<std::byte> got(weights.size());
  ASSERT_EQ(cudaMemcpyAsync(got.data(), dparams, got.size(), cudaMemcpyDeviceToHost, stream),
            cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(got, host_params);
  CKPT_ASSERT_OK((*gpu)->Synchronize());
  EXPECT_EQ(std::memcmp((*gpu)->master().data(), (*cpu)->master().data(), 4 * n), 0);
  // Into each piece's own device buffer, at its offset in a zeroed copy.
  ASSERT_EQ(cudaMemset(dparams, 0, weights.size()), cudaSuccess);
  std::vector<PieceBuffers> dest;
  for (size_t k = 0; k < o.pieces.size(); ++k) {
    dest.push_back({nullptr, static_cast<std::byte*>(dparams) + (*gpu)->piece_weight_offset(k)});
  }
  CKPT_ASSERT_OK((*gpu)->WriteModelWeights(dest, view));
  ASSERT_EQ(cudaMemcpyAsync(got.data(), dparams, got.size(), cudaMemcpyDeviceToHost, stream),
            cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(got, host_params);
  cudaFree(dgrads);
  cudaFree(dparams);
  cudaStreamDestroy(stream);
}

// AddParams on the CUDA engine (its slots remade for the grown units) equals the CPU engine.
TEST(CudaEngineTest, AddedParametersMatchTheCpuEngine) {
  SKIP_WITHOUT_DEVICE();
  StagedAdamWOptions o = Options(EngineKind::kCuda, MomentDType::kF32, 4096);
  const ParamSpec added = o.params[2];
  o.params.resize(2);
  o.pieces.resize(2);
  StagedAdamWOptions cpu_options = o;
  cpu_options.engine = EngineKind::kCpu;
  const uint64_t n = Size(o), total = n + added.numel();
  const std::vector<std::byte> w = Encode(Random(n, 1, 1.0f), DType::kBF16);
  const std::vector<std::byte> w_added = Encode(Random(added.numel(), 2, 1.0f), DType::kBF16);
  auto gpu = StagedAdamW::Create(o, w);
  auto cpu = StagedAdamW::Create(cpu_options, w);
  CKPT_ASSERT_OK(gpu);
  CKPT_ASSERT_OK(cpu);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  const CudaStreamView view = CudaStreamView::Of(reinterpret_cast<CUstream_st*>(stream)).value();
  void* dgrads = nullptr;
  void* dparams = nullptr;
  ASSERT_EQ(cudaMalloc(&dgrads, total * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dparams, total * 2), cudaSuccess);
  std::vector<std::byte> host(total * 2);
  for (int s = 0; s < 4; ++s) {
    if (s == 2) {
      for (StagedAdamW* opt : {gpu->get(), cpu->get()}) {
        CKPT_ASSERT_OK(opt->AddParams({added}, {}, {{2, 0, added.numel()}}, w_added));
      }
    }
    const uint64_t now = (*gpu)->size();
    const std::vector<float> g = Random(now, 100 + s, 0.5f);
    ASSERT_EQ(cudaMemcpy(dgrads, g.data(), now * 4, cudaMemcpyHostToDevice), cudaSuccess);
    StepArgs args{dgrads, DType::kF32, 1.0f, dparams};
    args.stream = view;
    CKPT_ASSERT_OK((*gpu)->Step(args));
    CKPT_ASSERT_OK((*cpu)->Step({g.data(), DType::kF32, 1.0f, host.data()}));
  }
  std::vector<std::byte> got(total * 2);
  ASSERT_EQ(cudaMemcpyAsync(got.data(), dparams, got.size(), cudaMemcpyDeviceToHost, stream),
            cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(got, host);
  CKPT_ASSERT_OK((*gpu)->Synchronize());
  EXPECT_EQ(std::memcmp((*gpu)->master().data(), (*cpu)->master().data(), 4 * total), 0);
  EXPECT_EQ((*gpu)->param_steps(), (std::vector<uint64_t>{4, 4, 2}));
  cudaFree(dgrads);
  cudaFree(dparams);
  cudaStreamDestroy(stream);
}

// One unit over 20 small parameters, each in its own device buffers: more runs than one launch
// takes (kMaxSegments), of two weight dtypes, some skipped at some steps (so that their step
// counts, hence their constants, part), three of them parameters of no elements (first, in the
// middle, last: their empty pieces have no run): the launches that batch the runs write bit for
// bit the CPU engine's state and weights.
TEST(CudaEngineTest, AUnitOfManyRunsEqualsTheCpuEngine) {
  SKIP_WITHOUT_DEVICE();
  StagedAdamWOptions o;
  o.groups = {ParamGroup{.lr = 1e-2f, .weight_decay = 0.1f}};
  for (uint32_t k = 0; k < 20; ++k) {
    const DType d = k == 10 || k == 11 ? DType::kF32 : DType::kBF16;
    const uint64_t count = k == 0 || k == 9 || k == 19 ? 0 : 7 + 13 * k;
    o.params.push_back({absl::StrCat("p", k), {count}, d, 0});
    o.pieces.push_back({k, 0, count});
  }
  o.unit_bytes = 64 << 10;  // Every parameter in one unit.
  o.engine = EngineKind::kCuda;
  StagedAdamWOptions cpu_options = o;
  cpu_options.engine = EngineKind::kCpu;
  const uint64_t n = Size(o);
  const std::vector<std::byte> weights = FlatWeights(o, Random(n, 1, 1.0f));
  auto gpu = StagedAdamW::Create(o, weights);
  auto cpu = StagedAdamW::Create(cpu_options, weights);
  CKPT_ASSERT_OK(gpu);
  CKPT_ASSERT_OK(cpu);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  const CudaStreamView view = CudaStreamView::Of(reinterpret_cast<CUstream_st*>(stream)).value();
  DevicePieces device(**gpu, weights);
  std::vector<std::byte> host_params = weights;
  for (int s = 0; s < 4; ++s) {
    std::vector<uint8_t> stepped(o.pieces.size(), 1);
    for (size_t k = 0; k < stepped.size(); ++k) stepped[k] = k % 3 != static_cast<size_t>(s) % 3;
    const std::vector<float> g = Random(n, 100 + s, 0.5f);
    device.Upload(g, stream);
    StepArgs args;
    args.grad_dtype = DType::kF32;
    args.grad_scale = 0.75f;
    args.stream = view;
    args.pieces = device.buffers();
    args.stepped = stepped;
    CKPT_ASSERT_OK((*gpu)->Step(args));
    StepArgs host{g.data(), DType::kF32, 0.75f, host_params.data()};
    host.stepped = stepped;
    CKPT_ASSERT_OK((*cpu)->Step(host));
  }
  EXPECT_EQ(device.Weights(stream), host_params);
  CKPT_ASSERT_OK((*gpu)->Synchronize());
  EXPECT_EQ(std::memcmp((*gpu)->master().data(), (*cpu)->master().data(), 4 * n), 0);
  EXPECT_TRUE(std::ranges::equal((*gpu)->exp_avg_bytes(), (*cpu)->exp_avg_bytes()));
  EXPECT_TRUE(std::ranges::equal((*gpu)->exp_avg_sq_bytes(), (*cpu)->exp_avg_sq_bytes()));
  EXPECT_NE((*gpu)->param_steps()[1], (*gpu)->param_steps()[3]);  // The constants parted.
  cudaStreamDestroy(stream);
}

TEST(CudaEngineTest, PieceBuffersOnTheDeviceEqualFlatBuffers) {
  SKIP_WITHOUT_DEVICE();
  StagedAdamWOptions o = Options(EngineKind::kCuda, MomentDType::kF32, 64 << 10);
  const uint64_t n = Size(o);
  State expected = RunEngine(o, DType::kF32, 2);
  auto opt = StagedAdamW::Create(o, Encode(Random(n, 1, 1.0f), DType::kBF16));
  CKPT_ASSERT_OK(opt);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  const CudaStreamView view = CudaStreamView::Of(reinterpret_cast<CUstream_st*>(stream)).value();
  DevicePieces device(**opt, {});
  for (int s = 0; s < 3; ++s) {
    std::vector<float> g = Random(n, 100 + s, 0.5f);
    for (size_t i = 0; i < n; i += 3) g[i] = 0.0f;
    if (s == 2) g[n - 5] = INFINITY;  // In the last piece: the step is skipped.
    device.Upload(g, stream);
    StepArgs args;
    args.grad_dtype = DType::kF32;
    args.grad_scale = 0.75f;  // RunEngine's.
    args.check_finite = true;
    args.stream = view;
    args.pieces = device.buffers();
    auto report = (*opt)->Step(args);
    CKPT_ASSERT_OK(report);
    EXPECT_EQ(report->skipped, s == 2);
  }
  EXPECT_EQ(device.Weights(stream), expected.params);
  CKPT_ASSERT_OK((*opt)->Synchronize());
  EXPECT_EQ(std::memcmp((*opt)->master().data(), expected.master.data(), 4 * n), 0);
  cudaStreamDestroy(stream);
}

// StepArgs::gate (the plain step a gated overlap falls back to when clipping fires): the
// stream is not ordered after the writes; readers await piece by piece or the whole step, and
// the next Step awaits what is left. Bit for bit the CPU engine's plain steps.
TEST(CudaEngineTest, GatedPlainStepsEqualTheCpuEngine) {
  SKIP_WITHOUT_DEVICE();
  StagedAdamWOptions o = Options(EngineKind::kCuda, MomentDType::kF32, 64 << 10);
  StagedAdamWOptions cpu = o;
  cpu.engine = EngineKind::kCpu;
  const uint64_t n = Size(o);
  const int steps = 4;
  State expected = RunEngine(cpu, DType::kF32, steps);
  auto opt = StagedAdamW::Create(o, Encode(Random(n, 1, 1.0f), DType::kBF16));
  CKPT_ASSERT_OK(opt);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  const CudaStreamView view = CudaStreamView::Of(reinterpret_cast<CUstream_st*>(stream)).value();
  DevicePieces device(**opt, {});  // Zeros, as RunEngine's weights.
  for (int s = 0; s < steps; ++s) {
    std::vector<float> g = Random(n, 100 + s, 0.5f);
    for (size_t i = 0; i < n; i += 3) g[i] = 0.0f;
    device.Upload(g, stream);
    StepArgs args;
    args.grad_dtype = DType::kF32;
    args.grad_scale = 0.75f;  // RunEngine's.
    args.stream = view;
    args.pieces = device.buffers();
    args.gate = true;
    auto report = (*opt)->Step(args);
    CKPT_ASSERT_OK(report);
    EXPECT_TRUE(report->gated);
    EXPECT_TRUE((*opt)->gate_open());
    if (s == 0) {  // Piece by piece, in forward's order.
      for (uint32_t k = 0; k < o.pieces.size(); ++k) {
        CKPT_ASSERT_OK((*opt)->AwaitPieces({&k, 1}, view));
      }
      EXPECT_FALSE((*opt)->gate_open());
    } else if (s == 1) {
      CKPT_ASSERT_OK((*opt)->AwaitStep(view));
      EXPECT_FALSE((*opt)->gate_open());
    }  // Else the next Step (or the AwaitStep below) awaits it.
  }
  CKPT_ASSERT_OK((*opt)->AwaitStep(view));
  EXPECT_EQ(device.Weights(stream), expected.params);
  CKPT_ASSERT_OK((*opt)->Synchronize());
  EXPECT_EQ(std::memcmp((*opt)->master().data(), expected.master.data(), 4 * n), 0);
  EXPECT_TRUE(std::ranges::equal((*opt)->exp_avg_bytes(), expected.m));
  EXPECT_TRUE(std::ranges::equal((*opt)->exp_avg_sq_bytes(), expected.v));
  cudaStreamDestroy(stream);
}

// The overlapped step on the CUDA engine (device piece buffers, backward's order), against
// plain steps of the CPU engine on host buffers: speculation held, clipping that fires (redo),
// a NaN in the last piece released (skip, weights put back), every bit the same.
// (moments, gated): a gated step (OverlapOptions::gate) keeps two units on the device at once
// during backward, sends the rest at Finish, and leaves the stream to await each piece.
class CudaOverlapTest : public ::testing::TestWithParam<std::tuple<MomentDType, bool>> {};

TEST_P(CudaOverlapTest, OverlappedStepsMatchPlainStepsOfTheCpuEngine) {
  SKIP_WITHOUT_DEVICE();
  const auto [moments, gated] = GetParam();
  StagedAdamWOptions o = Options(EngineKind::kCuda, moments, 64 << 10);
  StagedAdamWOptions c = Options(EngineKind::kCpu, moments, 64 << 10);
  const uint64_t n = Size(o);
  const std::vector<std::byte> init = Encode(Random(n, 1, 1.0f), DType::kBF16);
  auto gpu = StagedAdamW::Create(o, init);
  auto cpu = StagedAdamW::Create(c, init);
  CKPT_ASSERT_OK(gpu);
  CKPT_ASSERT_OK(cpu);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  const CudaStreamView view = CudaStreamView::Of(reinterpret_cast<CUstream_st*>(stream)).value();
  std::vector<void*> dgrads, dparams;
  std::vector<PieceBuffers> dbuf, hbuf;
  std::vector<std::vector<float>> hgrads;
  std::vector<std::vector<std::byte>> hparams;
  uint64_t at = 0;
  for (const Piece& p : o.pieces) {
    void* g = nullptr;
    void* w = nullptr;
    ASSERT_EQ(cudaMalloc(&g, p.count * 4), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&w, p.count * 2), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(w, init.data() + at * 2, p.count * 2, cudaMemcpyHostToDevice),
              cudaSuccess);
    dgrads.push_back(g);
    dparams.push_back(w);
    dbuf.push_back({g, w});
    hgrads.emplace_back(p.count);
    hparams.emplace_back(init.begin() + static_cast<ptrdiff_t>(at * 2),
                         init.begin() + static_cast<ptrdiff_t>((at + p.count) * 2));
    at += p.count;
  }
  for (size_t k = 0; k < hgrads.size(); ++k) hbuf.push_back({hgrads[k].data(), hparams[k].data()});
  const float final_scale[] = {0.75f, 0.3f, 0.75f, 0.75f, 0.75f};
  for (int s = 0; s < 5; ++s) {
    std::vector<float> g = Random(n, 100 + s, 0.5f);
    if (s == 3) g[7] = NAN;  // In piece 0, which backward releases last.
    at = 0;
    for (size_t k = 0; k < o.pieces.size(); ++k) {
      std::copy(g.begin() + static_cast<ptrdiff_t>(at),
                g.begin() + static_cast<ptrdiff_t>(at + o.pieces[k].count), hgrads[k].begin());
      ASSERT_EQ(cudaMemcpyAsync(dgrads[k], hgrads[k].data(), o.pieces[k].count * 4,
                                cudaMemcpyHostToDevice, stream),
                cudaSuccess);
      at += o.pieces[k].count;
    }
    StepArgs args;
    args.grad_dtype = DType::kF32;
    args.grad_scale = final_scale[s];
    args.check_finite = true;
    args.pieces = hbuf;
    auto plain = (*cpu)->Step(args);
    CKPT_ASSERT_OK(plain);
    StepArgs begin;
    begin.grad_dtype = DType::kF32;
    begin.grad_scale = 0.75f;
    begin.stream = view;
    OverlapOptions options;
    options.gate = gated;
    options.window = 2;
    auto overlap = (*gpu)->BeginOverlap(begin, options);
    CKPT_ASSERT_OK(overlap);
    for (uint32_t k : {2u, 1u, 0u}) CKPT_ASSERT_OK(overlap->Release({&k, 1}, {&dbuf[k], 1}));
    if (!gated) overlap->Drain();  // Gated: what the window held back goes out at Finish.
    args.pieces = dbuf;
    args.stream = view;
    auto report = overlap->Finish(args);
    CKPT_ASSERT_OK(report);
    const bool held = final_scale[s] == 0.75f && !plain->skipped;
    EXPECT_EQ(report->skipped, plain->skipped) << "step " << s;
    EXPECT_EQ(report->speculation_held, held);
    EXPECT_EQ(report->gated, gated && held);
    EXPECT_EQ((*gpu)->gate_open(), gated && held);
    if (gated) {
      EXPECT_GE(report->speculated_units, 2u);
      EXPECT_LE(report->speculated_units, (*gpu)->units().size());
      if (s == 2) {
        CKPT_ASSERT_OK((*gpu)->AwaitStep(view));  // Every piece at once.
      } else {
        // As a forward would: each piece awaited just before it is read, in slab order.
        for (uint32_t k = 0; k < o.pieces.size(); ++k)
          CKPT_ASSERT_OK((*gpu)->AwaitPieces({&k, 1}, view));
      }
      EXPECT_FALSE((*gpu)->gate_open());
    } else {
      EXPECT_EQ(report->speculated_units, (*gpu)->units().size());
    }
    for (size_t k = 0; k < o.pieces.size(); ++k) {
      std::vector<std::byte> got(o.pieces[k].count * 2);
      ASSERT_EQ(cudaMemcpyAsync(got.data(), dparams[k], got.size(), cudaMemcpyDeviceToHost,
                                stream),
                cudaSuccess);
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      EXPECT_EQ(got, hparams[k]) << "step " << s << " piece " << k;
    }
    CKPT_ASSERT_OK((*gpu)->Synchronize());
    EXPECT_EQ(std::memcmp((*gpu)->master().data(), (*cpu)->master().data(), 4 * n), 0);
    EXPECT_EQ(std::memcmp((*gpu)->exp_avg_sq_bytes().data(), (*cpu)->exp_avg_sq_bytes().data(),
                          (*cpu)->exp_avg_sq_bytes().size()),
              0);
    EXPECT_EQ((*gpu)->param_steps(), (*cpu)->param_steps());
  }
  for (void* p : dgrads) cudaFree(p);
  for (void* p : dparams) cudaFree(p);
  cudaStreamDestroy(stream);
}

INSTANTIATE_TEST_SUITE_P(MomentsAndGate, CudaOverlapTest,
                         ::testing::Combine(::testing::Values(MomentDType::kF32,
                                                              MomentDType::kBF16),
                                            ::testing::Bool()));

uint64_t DeviceUsed() {
  size_t free = 0, total = 0;
  cudaMemGetInfo(&free, &total);
  return total - free;
}

// The engine's device memory is what ReleaseDevice gives back. (Measured that way because
// pinning 12 GB of host slabs makes the driver map them, which costs device memory of its own
// that belongs to the slabs, not the engine.)
TEST(CudaEngineTest, DeviceMemoryDoesNotGrowWithTheModelAndReleaseFreesIt) {
  SKIP_WITHOUT_DEVICE();
  cudaFree(nullptr);  // Create the context first; its memory is not the engine's.
  uint64_t held[2] = {0, 0}, reported[2] = {0, 0};
  // 4M parameters already fill every unit (16 MiB slabs, 8 MiB units); 1G parameters must not
  // need a byte more. (A model smaller than one unit gets smaller buffers: they are sized from
  // the units the layout cut.)
  const uint64_t sizes[2] = {uint64_t{1} << 22, uint64_t{1} << 30};
  for (int i = 0; i < 2; ++i) {
    StagedAdamWOptions o;
    o.params = {{"w", {sizes[i]}, DType::kBF16, 0}};
    o.groups = {ParamGroup{}};
    o.pieces = {{0, 0, sizes[i]}};
    o.engine = EngineKind::kCuda;
    std::vector<uint16_t> w(sizes[i], 0x3f00);
    auto opt = StagedAdamW::Create(o, std::as_bytes(std::span(w)));
    CKPT_ASSERT_OK(opt);
    const uint64_t with_engine = DeviceUsed();
    reported[i] = (*opt)->device_bytes();
    CKPT_ASSERT_OK((*opt)->ReleaseDevice());
    const uint64_t released = DeviceUsed();
    held[i] = with_engine - released;
    EXPECT_EQ((*opt)->device_bytes(), 0u);
    EXPECT_GE(held[i], reported[i]) << "every buffer the engine reports was returned";
    CKPT_ASSERT_OK((*opt)->RestoreDevice());
    EXPECT_EQ((*opt)->device_bytes(), reported[i]);
    EXPECT_EQ(DeviceUsed(), with_engine) << "restore allocates the same slots again";
  }
  std::printf(
      "engine device memory: %llu bytes for 4M params, %llu for 1G params (reported %llu, %llu)\n",
      static_cast<unsigned long long>(held[0]), static_cast<unsigned long long>(held[1]),
      static_cast<unsigned long long>(reported[0]), static_cast<unsigned long long>(reported[1]));
  EXPECT_EQ(held[0], held[1]);
  EXPECT_EQ(reported[0], reported[1]);
}

TEST(CudaEngineTest, StepAfterReleaseAndRestoreIsBitExact) {
  SKIP_WITHOUT_DEVICE();
  StagedAdamWOptions o = Options(EngineKind::kCuda, MomentDType::kF32, 64 << 10);
  State plain = RunEngine(o, DType::kBF16, 3);
  State released = RunEngine(o, DType::kBF16, 3, /*release_between=*/true);
  EXPECT_EQ(std::memcmp(plain.master.data(), released.master.data(), 4 * plain.master.size()), 0);
  EXPECT_EQ(plain.m, released.m);
  EXPECT_EQ(plain.v, released.v);
  EXPECT_EQ(plain.params, released.params);
}

TEST(CudaEngineTest, NonFiniteGradientsSkipTheStepWhenChecked) {
  SKIP_WITHOUT_DEVICE();
  StagedAdamWOptions o = Options(EngineKind::kCuda, MomentDType::kF32, 64 << 10);
  const uint64_t n = Size(o);
  auto opt = StagedAdamW::Create(o, Encode(Random(n, 1, 1.0f), DType::kBF16));
  CKPT_ASSERT_OK(opt);
  std::vector<float> before((*opt)->master().begin(), (*opt)->master().end());
  std::vector<float> g(n, 0.1f);
  g[77] = std::nanf("");
  void* dgrads = nullptr;
  void* dparams = nullptr;
  cudaStream_t stream;
  ASSERT_EQ(cudaMalloc(&dgrads, n * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dparams, n * 2), cudaSuccess);
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dgrads, g.data(), n * 4, cudaMemcpyHostToDevice), cudaSuccess);
  StepArgs args{dgrads, DType::kF32, 1.0f, dparams, /*check_finite=*/true};
  args.stream = CudaStreamView::Of(reinterpret_cast<CUstream_st*>(stream)).value();
  auto report = (*opt)->Step(args);
  CKPT_ASSERT_OK(report);
  EXPECT_TRUE(report->skipped);
  EXPECT_EQ(report->nonfinite, 1u);
  CKPT_ASSERT_OK((*opt)->Synchronize());
  EXPECT_EQ(std::memcmp((*opt)->master().data(), before.data(), 4 * n), 0);
  EXPECT_EQ((*opt)->groups()[0].step, 0u);
  // Without a stream the engine refuses rather than using the legacy default stream, and a
  // null handle makes no stream view (CudaStreamView::Legacy() names that stream).
  args.stream = std::nullopt;
  EXPECT_THAT((*opt)->Step(args), testing::StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(CudaStreamView::Of(nullptr).status(),
              testing::StatusIs(absl::StatusCode::kInvalidArgument));
  cudaFree(dgrads);
  cudaFree(dparams);
  cudaStreamDestroy(stream);
}

// ---- Muon on the CUDA engine (docs/design/muon.md).

// C = bf16(alpha A op(B) + beta D) on the host, the sums in FP32 in order k = 0, 1, ...
std::vector<uint16_t> ReferenceGemm(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b,
                                    bool trans_b, const std::vector<uint16_t>* d, int m, int n,
                                    int k, float alpha, float beta) {
  std::vector<uint16_t> c(static_cast<size_t>(m) * n);
  for (int i = 0; i < m; ++i) {
    for (int j = 0; j < n; ++j) {
      float sum = 0;
      for (int p = 0; p < k; ++p) {
        const uint16_t bv = trans_b ? b[static_cast<size_t>(j) * k + p]
                                    : b[static_cast<size_t>(p) * n + j];
        sum += formats::Bf16ToFloat(a[static_cast<size_t>(i) * k + p]) * formats::Bf16ToFloat(bv);
      }
      float v = alpha * sum;
      if (d != nullptr) v += beta * formats::Bf16ToFloat((*d)[static_cast<size_t>(i) * n + j]);
      c[static_cast<size_t>(i) * n + j] = formats::FloatToBf16(v);
    }
  }
  return c;
}

// Small integers (-3..3), whose products and sums are exact in FP32 in any order: the device's
// tensor-core result must then equal the host's bit for bit, whatever the tiling.
std::vector<uint16_t> SmallIntegers(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> pick(-3, 3);
  std::vector<uint16_t> v(n);
  for (uint16_t& x : v) x = formats::FloatToBf16(static_cast<float>(pick(rng)));
  return v;
}

// ckpt's kernel, and cuBLAS where the process loads it (the engine's choice: cublas_gemm.h).
TEST(CudaMuonTest, Bf16ProductsEqualExactSumsForEveryShapeAndTransposition) {
  SKIP_WITHOUT_DEVICE();
  std::string why;
  const internal::CublasGemm blas = internal::CublasGemm::Create(&why);
  if (!blas.valid()) std::cout << "cuBLAS not loaded (" << why << "): ckpt's kernel only\n";
  struct Shape {
    int m, n, k;
  };
  // Single elements, shapes that are not multiples of the tiles (or of 8, the vector loads'
  // width), several tiles each way, and long k's over few tiles, which split k into slices when
  // given a workspace (`with_d` false runs without one).
  for (const Shape sh : {Shape{1, 1, 1}, Shape{37, 100, 45}, Shape{130, 129, 257},
                         Shape{128, 128, 64}, Shape{5, 300, 1030}, Shape{260, 24, 16},
                         Shape{64, 64, 4096}, Shape{100, 90, 2001}}) {
    for (const bool trans_b : {false, true}) {
      for (const bool with_d : {false, true}) {
        SCOPED_TRACE(::testing::Message() << sh.m << " x " << sh.n << " x " << sh.k << " trans_b "
                                        << trans_b << " d " << with_d);
        const size_t as = static_cast<size_t>(sh.m) * sh.k, bs = static_cast<size_t>(sh.k) * sh.n,
                     cs = static_cast<size_t>(sh.m) * sh.n;
        const std::vector<uint16_t> a = SmallIntegers(as, 1), b = SmallIntegers(bs, 2),
                                    d = SmallIntegers(cs, 3);
        const float alpha = with_d ? 2.0f : 1.0f, beta = -3.0f;
        const std::vector<uint16_t> want =
            ReferenceGemm(a, b, trans_b, with_d ? &d : nullptr, sh.m, sh.n, sh.k, alpha, beta);
        uint16_t *da = nullptr, *db = nullptr, *dd = nullptr, *dc = nullptr;
        float* workspace = nullptr;
        const size_t workspace_floats = 8 * cs;
        ASSERT_EQ(cudaMalloc(&workspace, workspace_floats * 4), cudaSuccess);
        ASSERT_EQ(cudaMalloc(&da, as * 2), cudaSuccess);
        ASSERT_EQ(cudaMalloc(&db, bs * 2), cudaSuccess);
        ASSERT_EQ(cudaMalloc(&dd, cs * 2), cudaSuccess);
        ASSERT_EQ(cudaMalloc(&dc, cs * 2), cudaSuccess);
        ASSERT_EQ(cudaMemcpy(da, a.data(), as * 2, cudaMemcpyHostToDevice), cudaSuccess);
        ASSERT_EQ(cudaMemcpy(db, b.data(), bs * 2, cudaMemcpyHostToDevice), cudaSuccess);
        ASSERT_EQ(cudaMemcpy(dd, d.data(), cs * 2, cudaMemcpyHostToDevice), cudaSuccess);
        ASSERT_EQ(internal::LaunchGemmBf16(da, db, trans_b, with_d ? dd : nullptr, dc, sh.m, sh.n,
                                           sh.k, alpha, beta, with_d ? workspace : nullptr,
                                           workspace_floats, nullptr),
                  cudaSuccess);
        std::vector<uint16_t> got(cs);
        ASSERT_EQ(cudaMemcpy(got.data(), dc, cs * 2, cudaMemcpyDeviceToHost), cudaSuccess);
        EXPECT_EQ(got, want);
        if (blas.valid()) {
          const internal::GemmBackend cublas = blas.backend();
          ASSERT_EQ(cudaMemset(dc, 0xff, cs * 2), cudaSuccess);
          ASSERT_EQ(cublas.gemm(cublas.ctx, da, db, trans_b, with_d ? dd : nullptr, dc, sh.m, sh.n,
                                sh.k, alpha, beta, nullptr),
                    cudaSuccess);
          ASSERT_EQ(cudaMemcpy(got.data(), dc, cs * 2, cudaMemcpyDeviceToHost), cudaSuccess);
          EXPECT_EQ(got, want) << "cuBLAS";
        }
        cudaFree(da);
        cudaFree(db);
        cudaFree(dd);
        cudaFree(dc);
        cudaFree(workspace);
      }
    }
  }
  // C may not be D, and the sides must be positive.
  EXPECT_EQ(internal::LaunchGemmBf16(nullptr, nullptr, false, nullptr, nullptr, 0, 1, 1, 1, 0,
                                     nullptr, 0, nullptr),
            cudaErrorInvalidValue);
}

// Muon matrices of every orientation (tall ones are orthogonalised transposed), odd sizes and
// one of several tiles, and an AdamW vector, in one optimizer.
StagedAdamWOptions MuonOptions(EngineKind engine, MomentDType moments, bool nesterov,
                               MuonLrAdjust adjust) {
  StagedAdamWOptions o;
  o.params = {{"tall", {96, 40}, DType::kBF16, 0},  {"wide", {40, 96}, DType::kBF16, 0},
              {"odd", {33, 130}, DType::kBF16, 0},  {"bias", {1000}, DType::kBF16, 1},
              {"big", {300, 520}, DType::kBF16, 0}, {"square", {64, 64}, DType::kBF16, 0}};
  ParamGroup muon;
  muon.algorithm = Algorithm::kMuon;
  muon.lr = 0.02;
  muon.weight_decay = 0.1;
  muon.eps = 1e-7;
  muon.muon.nesterov = nesterov;
  muon.muon.adjust_lr = adjust;
  ParamGroup adamw;
  adamw.lr = 3e-3;
  o.groups = {muon, adamw};
  for (uint32_t i = 0; i < o.params.size(); ++i) o.pieces.push_back({i, 0, o.params[i].numel()});
  o.engine = engine;
  o.moment_dtype = moments;
  return o;
}

struct MuonCase {
  MomentDType moments;
  bool nesterov;
  MuonLrAdjust adjust;
  DType grads;
};

class CudaMuonParityTest : public ::testing::TestWithParam<MuonCase> {};

// The momentum is elementwise with the CPU's operations: bit for bit. The AdamW vector too. The
// orthogonalised update differs only by the order of FP32 sums inside each product (one BF16
// rounding apart in a few elements, spread by the iterations): each Muon master within
// 0.01 x lr' per step of the CPU engine's, and the weights exactly the masters rounded.
TEST_P(CudaMuonParityTest, MatchesTheCpuEngineWithinTheProductsRounding) {
  SKIP_WITHOUT_DEVICE();
  const MuonCase c = GetParam();
  constexpr int kSteps = 3;
  const State gpu =
      RunEngine(MuonOptions(EngineKind::kCuda, c.moments, c.nesterov, c.adjust), c.grads, kSteps);
  const StagedAdamWOptions cpu_options =
      MuonOptions(EngineKind::kCpu, c.moments, c.nesterov, c.adjust);
  const State cpu = RunEngine(cpu_options, c.grads, kSteps);
  EXPECT_EQ(gpu.m, cpu.m) << "the momentum is elementwise: bit for bit";
  EXPECT_EQ(gpu.v, cpu.v);
  const internal::MuonConstants k = internal::ComputeMuonConstants(cpu_options.groups[0]);
  uint64_t at = 0;
  double worst = 0;  // The largest difference, in units of lr'.
  for (const ParamSpec& p : cpu_options.params) {
    const uint64_t n = p.numel();
    const bool muon = p.group == 0;
    const double lr = muon ? internal::MuonAdjustedLr(k, p.shape[0], p.shape[1]) : 0;
    for (uint64_t i = at; i < at + n; ++i) {
      if (!muon) {
        ASSERT_EQ(std::memcmp(&gpu.master[i], &cpu.master[i], 4), 0) << p.name << " " << i - at;
        continue;
      }
      const double diff = std::fabs(static_cast<double>(gpu.master[i]) - cpu.master[i]);
      worst = std::max(worst, diff / lr);
      ASSERT_LE(diff, 0.01 * lr * kSteps) << p.name << " element " << i - at;
    }
    at += n;
  }
  RecordProperty("worst_diff_in_lr", std::to_string(worst));
  for (size_t i = 0; i < gpu.master.size(); ++i) {
    uint16_t h;
    std::memcpy(&h, gpu.params.data() + 2 * i, 2);
    ASSERT_EQ(h, formats::FloatToBf16(gpu.master[i])) << "weight " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, CudaMuonParityTest,
    ::testing::Values(
        MuonCase{MomentDType::kF32, true, MuonLrAdjust::kOriginal, DType::kF32},
        MuonCase{MomentDType::kF32, false, MuonLrAdjust::kMatchRmsAdamW, DType::kBF16},
        MuonCase{MomentDType::kBF16, true, MuonLrAdjust::kMatchRmsAdamW, DType::kF16},
        MuonCase{MomentDType::kBF16, false, MuonLrAdjust::kOriginal, DType::kF32}),
    [](const ::testing::TestParamInfo<MuonCase>& p) {
      return std::string(p.param.moments == MomentDType::kF32 ? "F32Moments" : "Bf16Moments") +
             (p.param.nesterov ? "Nesterov" : "Plain") +
             (p.param.adjust == MuonLrAdjust::kOriginal ? "Original" : "MatchRms") +
             std::string(formats::DTypeName(p.param.grads)) + "Grads";
    });

// An async save fences the step: its matrices go to the engine in batches, in other slots than
// a plain step's. The steps must equal plain ones bit for bit (the products sum in a fixed order
// whatever the slot), and the checkpoint must hold the state at the call.
TEST(CudaMuonTest, StepsFencedByAnAsyncSaveEqualPlainStepsAndSaveTheStateAtTheCall) {
  SKIP_WITHOUT_DEVICE();
  const StagedAdamWOptions o =
      MuonOptions(EngineKind::kCuda, MomentDType::kF32, true, MuonLrAdjust::kOriginal);
  const State plain = RunEngine(o, DType::kF32, 5);
  const State at_save = RunEngine(o, DType::kF32, 1);
  const uint64_t big_at = 96 * 40 + 40 * 96 + 33 * 130 + 1000, big = 300 * 520;
  const std::vector<float> want_big(at_save.master.begin() + static_cast<ptrdiff_t>(big_at),
                                    at_save.master.begin() + static_cast<ptrdiff_t>(big_at + big));
  for (uint64_t pool : {uint64_t{0}, uint64_t{1} << 30}) {
    std::vector<float> saved_big;
    const State fenced = RunCudaUnderAsyncSave(o, 5, pool, &saved_big, "big", big);
    EXPECT_EQ(std::memcmp(fenced.master.data(), plain.master.data(), 4 * plain.master.size()), 0)
        << "pool " << pool;
    EXPECT_EQ(fenced.m, plain.m);
    EXPECT_EQ(fenced.params, plain.params);
    EXPECT_EQ(std::memcmp(saved_big.data(), want_big.data(), want_big.size() * 4), 0)
        << "the checkpoint does not hold the state at the call (pool " << pool << ")";
  }
}

// The slots hold the largest matrix's state and scratch whatever unit_bytes says, and a
// Checkpointer-style release and restore gives the same steps.
TEST(CudaMuonTest, SlotsAreSizedByTheLargestMatrixAndSurviveReleaseAndRestore) {
  SKIP_WITHOUT_DEVICE();
  StagedAdamWOptions o = MuonOptions(EngineKind::kCuda, MomentDType::kF32, true,
                                     MuonLrAdjust::kOriginal);
  o.unit_bytes = 4096;  // Far below the largest matrix (300 x 520).
  auto opt = StagedAdamW::Create(o, Encode(Random(Size(o), 1, 1.0f), DType::kBF16));
  ASSERT_THAT(opt, IsOk());
  EXPECT_THAT((*opt)->engine_name(), ::testing::StartsWith("cuda-2slots-muon-"));
  const uint64_t largest = 300 * 520;
  // Less without ckpt's split products when cuBLAS runs them.
  const uint64_t scratch = internal::MuonScratchBytes(300, 520, false);
  const uint64_t scratch_own = internal::MuonScratchBytes(300, 520, true);
  // Master and momentum in and out for the largest matrix, and the scratch; the second moments'
  // buffers only for the AdamW units (a 1000-element vector here).
  const uint64_t slots = static_cast<uint64_t>(o.slot_count);
  EXPECT_GE((*opt)->device_bytes(), slots * (2 * largest * 8 + scratch));
  EXPECT_LT((*opt)->device_bytes(), slots * (2 * largest * 8 + scratch_own + 2 * 1024 * 4) + 64);
  const State plain = RunEngine(o, DType::kF32, 3);
  const State released = RunEngine(o, DType::kF32, 3, /*release_between=*/true);
  EXPECT_EQ(std::memcmp(plain.master.data(), released.master.data(), 4 * plain.master.size()), 0);
  EXPECT_EQ(plain.m, released.m);
  EXPECT_EQ(plain.params, released.params);
}

}  // namespace
}  // namespace ckpt::optimizer
