#include "ckpt/bench/reshard_bench.h"

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "ckpt/base/status_macros.h"
#include "ckpt/bench/store_bench.h"
#include "ckpt/checkpoint_store.h"
#include "ckpt/coordinator.h"
#include "ckpt/formats/float_convert.h"
#include "ckpt/formats/optimizer_record.h"
#include "ckpt/optimizer/layout.h"
#include "ckpt/optimizer/reshard.h"
#include "optimizer/state_layout.h"

namespace ckpt::bench {
namespace {

using formats::DType;
using optimizer::ParamSpec;
using optimizer::Piece;

constexpr uint64_t kTensorElems = uint64_t{1} << 24;
// Elements per write: whole 4 MiB chunks of both the BF16 weights and the FP32 state.
constexpr uint64_t kBatchElems = uint64_t{1} << 22;

float Value(uint32_t tensor, uint64_t i) {
  return static_cast<float>(static_cast<int64_t>((i * 2654435761u + tensor * 40503u) % 2001) -
                            1000) *
         1e-3f;
}

uint64_t PeakRssBytes() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<uint64_t>(usage.ru_maxrss) * 1024;
}

}  // namespace

absl::Status WriteSyntheticOptimizerStep(Env* env, const std::string& root, uint64_t params,
                                         int ranks, uint64_t step) {
  if (params == 0 || ranks < 1) {
    return absl::InvalidArgumentError("a synthetic step needs parameters and ranks");
  }
  std::vector<ParamSpec> specs;
  for (uint64_t at = 0; at < params; at += kTensorElems) {
    specs.push_back({absl::StrCat("layers.", specs.size(), ".weight"),
                     {std::min(kTensorElems, params - at)},
                     DType::kBF16,
                     0});
  }
  CKPT_ASSIGN_OR_RETURN(std::vector<optimizer::Bucket> buckets,
                        optimizer::BuildBuckets(specs, {}, ranks));
  const std::vector<std::vector<Piece>> pieces = optimizer::RankPieces(buckets, ranks);
  const std::string record = optimizer::internal::LayoutRecord(
      specs, {optimizer::ParamGroup{}}, std::vector<uint64_t>(specs.size(), 0),
      optimizer::MomentDType::kF32, ranks);
  StoreOptions so;
  so.env = env;
  ThreadGroup group(ranks);
  CKPT_ASSIGN_OR_RETURN(std::vector<std::unique_ptr<CheckpointStore>> stores,
                        OpenStoresOnThreads(root, so, group));
  std::vector<absl::Status> status(ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      absl::StatusOr<std::unique_ptr<SaveTransaction>> txn =
          stores[r]->BeginSave(step, group.member(r));
      if (!txn.ok()) {
        status[r] = txn.status();
        return;
      }
      absl::Status s = [&]() -> absl::Status {
        const optimizer::internal::StateLayout layout(specs, pieces[r], DType::kF32);
        for (const TensorSpec& t : layout.Declarations()) {
          CKPT_RETURN_IF_ERROR((*txn)->DeclareTensor(t));
        }
        std::vector<uint16_t> weights;
        std::vector<float> state;
        for (const Piece& piece : pieces[r]) {
          for (int kind = 0; kind < 4; ++kind) {
            const std::string& name = layout.states(piece.param)[kind].name;
            for (uint64_t at = 0; at < piece.count; at += kBatchElems) {
              const uint64_t n = std::min(kBatchElems, piece.count - at);
              const uint64_t begin = piece.begin + at;
              if (kind == 0) {
                weights.resize(n);
                for (uint64_t i = 0; i < n; ++i)
                  weights[i] = formats::FloatToBf16(Value(piece.param, begin + i));
                CKPT_RETURN_IF_ERROR(
                    (*txn)->WritePiece(name, begin, n, std::as_bytes(std::span(weights))));
                continue;
              }
              state.resize(n);
              for (uint64_t i = 0; i < n; ++i) {
                const float v = Value(piece.param, begin + i);
                state[i] = kind == 1 ? v : kind == 2 ? 0.1f * v : v * v;
              }
              CKPT_RETURN_IF_ERROR(
                  (*txn)->WritePiece(name, begin, n, std::as_bytes(std::span(state))));
            }
          }
        }
        return (*txn)->WriteBlob(formats::kOptimizerRecordBlob,
                                 std::as_bytes(std::span(record)));
      }();
      if (!s.ok()) (*txn)->stream().MarkFailed(s);
      status[r] = (*txn)->Commit();
    });
  }
  for (std::thread& t : threads) t.join();
  for (const absl::Status& s : status) CKPT_RETURN_IF_ERROR(s);
  return absl::OkStatus();
}

absl::StatusOr<ReshardFigures> RunReshardBench(const ReshardBenchOptions& options) {
  if (options.params == 0 || options.ranks < 1 || options.dp < 1) {
    return absl::InvalidArgumentError("bench reshard needs parameters and ranks");
  }
  Env* env = Env::Default();
  const std::string src = JoinPath(options.dir, "ckpt-bench-reshard-src");
  const std::string dst = JoinPath(options.dir, "ckpt-bench-reshard-dst");
  for (const std::string& root : {src, dst}) {
    RemoveRecursively(env, root).IgnoreError();  // Best effort: a previous run's.
  }
  ReshardFigures fig;
  fig.state_bytes = options.params * 14;
  CKPT_RETURN_IF_ERROR(WriteSyntheticOptimizerStep(env, src, options.params, options.ranks, 1));
  {
    StoreOptions so;
    so.read_only = true;
    CKPT_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointStore> store, CheckpointStore::Open(src, so));
    CKPT_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> step, store->OpenStep(1));
    optimizer::ReshardOptions ro;
    ro.dp = options.dp;
    const auto start = std::chrono::steady_clock::now();
    CKPT_RETURN_IF_ERROR(optimizer::Reshard(*step, dst, ro).status());
    fig.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    fig.peak_rss_bytes = PeakRssBytes();
    CKPT_ASSIGN_OR_RETURN(fig.read_bound_gbps,
                          RawReadStepGbps(nullptr, JoinPath(src, StepDirectoryName(1)),
                                          store->options().read_threads));
  }
  CKPT_ASSIGN_OR_RETURN(fig.write_bound_gbps,
                        RawWriteBoundGbps(nullptr, options.dir, fig.state_bytes));
  fig.gbps = static_cast<double>(fig.state_bytes) / fig.seconds / 1e9;
  fig.bound_gbps = 1.0 / (1.0 / fig.read_bound_gbps + 1.0 / fig.write_bound_gbps);
  for (const std::string& root : {src, dst}) {
    RemoveRecursively(env, root).IgnoreError();  // Best effort: bench output.
  }
  return fig;
}

}  // namespace ckpt::bench
