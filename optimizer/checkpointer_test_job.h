// A data-parallel job of StagedAdamW ranks with their Checkpointers, as threads over one
// ThreadGroup and one store: the fixture of the Checkpointer tests (checkpointer_test.cc,
// async_save_test.cc).
#ifndef CKPT_OPTIMIZER_CHECKPOINTER_TEST_JOB_H_
#define CKPT_OPTIMIZER_CHECKPOINTER_TEST_JOB_H_

#include <algorithm>
#include <array>
#include <cstring>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "ckpt/base/status_macros.h"
#include "ckpt/formats/float_convert.h"
#include "ckpt/optimizer/checkpointer.h"
#include "ckpt/optimizer/layout.h"
#include "tests/support/fault_injection_env.h"
#include "tests/support/status_matchers.h"
#include "tests/support/toy_model.h"

namespace ckpt::optimizer::test_job {

using formats::DType;
using testing::IsOk;
using testing::StatusIs;
using testing::ToyGradient;
using testing::ToyGroupAt;
using testing::ToyGroups;
using testing::ToyInitialValue;
using testing::ToyModel;

constexpr char kRoot[] = "/store";

// One rank: its optimizer, weights and Checkpointer.
struct Rank {
  std::unique_ptr<StagedAdamW> opt;
  std::vector<uint16_t> weights;
  std::unique_ptr<Checkpointer> ckpt;
};

// A parameter's initial model-dtype weight bits at a flat index.
using InitFn = std::function<uint16_t(uint32_t param, uint64_t index)>;

// A data-parallel job of `dp` ranks over one store at `root`. The weights start from `init`,
// or from ToyInitialValue rounded to the model dtype. `amsgrad`: group 0 uses AMSGrad (group 1
// does not, so the optimizer keeps max_exp_avg_sq for parameters of both).
class Job {
 public:
  Job(Env* env, int dp, uint64_t bucket_elems, std::vector<ParamSpec> params = ToyModel(),
      MomentDType moments = MomentDType::kF32, CheckpointerOptions options = {},
      const std::string& root = kRoot, InitFn init = nullptr, bool amsgrad = false)
      : group_(dp), params_(std::move(params)), amsgrad_(amsgrad) {
    StoreOptions so;
    so.env = env;
    so.chunk_bytes = 1000;
    for (int r = 0; r < dp; ++r) {
      so.primary = r == 0;
      auto store = CheckpointStore::Open(root, so);
      EXPECT_THAT(store, IsOk());
      stores_.push_back(*std::move(store));
    }
    auto buckets = BuildBuckets(params_, {.bucket_elems = bucket_elems, .pad_to = 8}, dp);
    EXPECT_THAT(buckets, IsOk());
    const std::vector<std::vector<Piece>> pieces = RankPieces(*buckets, dp);
    for (int r = 0; r < dp; ++r) {
      StagedAdamWOptions o;
      o.params = params_;
      o.groups = ToyGroups();
      o.groups[0].amsgrad = amsgrad_;
      o.pieces = pieces[r];
      o.threads = 1;
      o.unit_bytes = 1024;  // Many units even on a toy model: the async save fences by unit.
      o.moment_dtype = moments;
      Rank rank;
      for (const Piece& p : o.pieces)
        for (uint64_t i = 0; i < p.count; ++i)
          rank.weights.push_back(init != nullptr ? init(p.param, p.begin + i)
                                 : params_[0].dtype == DType::kBF16
                                     ? formats::FloatToBf16(ToyInitialValue(p.param, p.begin + i))
                                     : formats::FloatToHalf(ToyInitialValue(p.param, p.begin + i)));
      auto opt = StagedAdamW::Create(o, std::as_bytes(std::span(rank.weights)));
      EXPECT_THAT(opt, IsOk());
      rank.opt = *std::move(opt);
      auto ck =
          Checkpointer::Create(rank.opt.get(), stores_[r].get(), group_.member(r), options);
      EXPECT_THAT(ck, IsOk());
      rank.ckpt = *std::move(ck);
      ranks_.push_back(std::move(rank));
    }
  }

  int size() const { return static_cast<int>(ranks_.size()); }
  Rank& rank(int r) { return ranks_[r]; }

  // One step on every rank, at step number `s` of the run, with lr scaled by (s + 1) / 4, of
  // the parameters `stepped` names (StepArgs::stepped; empty: every parameter).
  void Step(int s, const std::vector<uint8_t>& stepped = {}) {
    for (Rank& rank : ranks_) {
      for (size_t g = 0; g < ToyGroups().size(); ++g) {
        ParamGroup group = ToyGroupAt(g, s);
        group.amsgrad = amsgrad_ && g == 0;
        ASSERT_THAT(rank.opt->SetGroup(g, group), IsOk());
      }
      std::vector<float> grads;
      for (const Piece& p : rank.opt->options().pieces)
        for (uint64_t i = 0; i < p.count; ++i)
          grads.push_back(ToyGradient(p.param, p.begin + i, s));
      StepArgs args{grads.data(), DType::kF32, 1.0f, rank.weights.data()};
      args.stepped = stepped;
      ASSERT_THAT(rank.opt->Step(args), IsOk());
    }
  }

  // Runs `fn(rank)` on every rank at once (the collectives need every rank) and returns each
  // rank's status.
  std::vector<absl::Status> OnEveryRank(const std::function<absl::Status(int)>& fn) {
    std::vector<absl::Status> out(ranks_.size());
    std::vector<std::thread> threads;
    for (int r = 0; r < size(); ++r) threads.emplace_back([&, r] { out[r] = fn(r); });
    for (std::thread& t : threads) t.join();
    return out;
  }
  std::vector<absl::Status> Save(uint64_t step) {
    return OnEveryRank([&](int r) {
      return ranks_[r].ckpt->Save(step, {{"sched", "at " + std::to_string(step)}});
    });
  }
  // SaveAsync on every rank at once; the handles of the ranks where it succeeded.
  std::vector<std::unique_ptr<PendingSave>> SaveAsync(uint64_t step,
                                                      std::vector<absl::Status>* status = nullptr) {
    std::vector<std::unique_ptr<PendingSave>> handles(ranks_.size());
    std::vector<absl::Status> st = OnEveryRank([&](int r) {
      auto h = ranks_[r].ckpt->SaveAsync(step, {{"sched", "at " + std::to_string(step)}});
      if (!h.ok()) return h.status();
      handles[r] = *std::move(h);
      return absl::OkStatus();
    });
    if (status != nullptr) *status = st;
    return handles;
  }
  std::vector<absl::Status> Finalize(std::vector<std::unique_ptr<PendingSave>>& handles) {
    return OnEveryRank([&](int r) { return handles[r]->Finalize(); });
  }
  // Load on every rank; each rank whose load succeeded then writes its weights from the masters,
  // as a trainer does (StagedAdamW::WriteModelWeights).
  std::vector<absl::Status> Load(std::optional<uint64_t> step) {
    return OnEveryRank([&](int r) {
      CKPT_RETURN_IF_ERROR(ranks_[r].ckpt->Load(step).status());
      return WriteWeights(r);
    });
  }
  absl::Status WriteWeights(int r) { return ranks_[r].opt->WriteModelWeights(ranks_[r].weights.data()); }

  // Every element's (master, exp_avg, exp_avg_sq) as floats, by (param, flat index), whatever
  // the layout and the moments' slab dtype.
  std::map<std::pair<uint32_t, uint64_t>, std::array<float, 3>> StateAsFloats() {
    std::map<std::pair<uint32_t, uint64_t>, std::array<float, 3>> out;
    for (Rank& rank : ranks_) {
      const StagedAdamW& opt = *rank.opt;
      auto moment = [&](std::span<const std::byte> bytes, uint64_t at) {
        if (opt.moment_bytes() == 4) {
          float f;
          std::memcpy(&f, bytes.data() + 4 * at, 4);
          return f;
        }
        uint16_t h;
        std::memcpy(&h, bytes.data() + 2 * at, 2);
        return formats::Bf16ToFloat(h);
      };
      uint64_t at = 0;
      for (const Piece& p : opt.options().pieces) {
        for (uint64_t i = 0; i < p.count; ++i, ++at) {
          out[{p.param, p.begin + i}] = {opt.master()[at], moment(opt.exp_avg_bytes(), at),
                                         moment(opt.exp_avg_sq_bytes(), at)};
        }
      }
    }
    return out;
  }

  // The whole state by (param, flat index), whatever the layout: weights, masters, moments,
  // and every group's hyper-parameters and step.
  std::string Gather() {
    std::map<std::pair<uint32_t, uint64_t>, std::string> by_element;
    std::string groups;
    for (Rank& rank : ranks_) {
      uint64_t at = 0;
      for (const Piece& p : rank.opt->options().pieces) {
        for (uint64_t i = 0; i < p.count; ++i, ++at) {
          std::string& e = by_element[{p.param, p.begin + i}];
          e.append(reinterpret_cast<const char*>(&rank.weights[at]), 2);
          e.append(reinterpret_cast<const char*>(&rank.opt->master()[at]), 4);
          const size_t mb = rank.opt->moment_bytes();
          e.append(reinterpret_cast<const char*>(rank.opt->exp_avg_bytes().data() + at * mb), mb);
          e.append(reinterpret_cast<const char*>(rank.opt->exp_avg_sq_bytes().data() + at * mb),
                   mb);
          if (rank.opt->has_max_exp_avg_sq()) {
            e.append(
                reinterpret_cast<const char*>(rank.opt->max_exp_avg_sq_bytes().data() + at * mb),
                mb);
          }
        }
      }
      std::string mine;
      for (const ParamGroup& g : rank.opt->groups()) {
        absl::StrAppend(&mine, g.lr, "/", g.beta1, "/", g.beta2, "/", g.eps, "/", g.weight_decay,
                        "/", g.step, g.amsgrad ? "/amsgrad" : "", ";");
      }
      for (uint64_t step : rank.opt->param_steps()) absl::StrAppend(&mine, step, ",");
      if (groups.empty()) groups = mine;
      EXPECT_EQ(groups, mine) << "ranks disagree on their groups";
    }
    std::string out = groups;
    for (const auto& [key, bytes] : by_element) out += bytes;
    return out;
  }

 private:
  ThreadGroup group_;
  std::vector<ParamSpec> params_;
  bool amsgrad_;
  std::vector<std::unique_ptr<CheckpointStore>> stores_;
  std::vector<Rank> ranks_;
};

inline void ExpectAllOk(const std::vector<absl::Status>& statuses) {
  for (size_t r = 0; r < statuses.size(); ++r) EXPECT_THAT(statuses[r], IsOk()) << "rank " << r;
}
inline void ExpectAll(const std::vector<absl::Status>& statuses, absl::StatusCode code) {
  for (size_t r = 0; r < statuses.size(); ++r)
    EXPECT_THAT(statuses[r], StatusIs(code)) << "rank " << r;
}

// Step `step` of the store at `root` in `env`, through a read-only handle (which the reader
// does not need once open).
inline std::unique_ptr<CheckpointReader> OpenStep(Env* env, const std::string& root,
                                                  uint64_t step) {
  StoreOptions so;
  so.env = env;
  so.read_only = true;
  auto store = CheckpointStore::Open(root, so);
  EXPECT_THAT(store, IsOk());
  auto reader = (*store)->OpenStep(step);
  EXPECT_THAT(reader, IsOk());
  return *std::move(reader);
}

// The entries of the store's root directory, sorted.
inline std::vector<std::string> RootEntries(Env* env, const std::string& root = kRoot) {
  auto names = env->GetChildren(root);
  EXPECT_THAT(names, IsOk());
  std::sort(names->begin(), names->end());
  return *names;
}

// Every rank either loads, or ends exactly as before the load, or (when the rollback itself
// failed) is poisoned; a poisoned job refuses to step. `arm` injects the failure, `load` runs
// the load on every rank; returns whether any rank failed.
inline bool LoadUnderFault(testing::FaultInjectionEnv& env, Job& job,
                           const std::function<std::vector<absl::Status>()>& load,
                           const std::function<void()>& arm, const std::string& before,
                           const std::string& loaded) {
  arm();
  std::vector<absl::Status> st = load();
  env.Disarm();
  bool failed = false, poisoned = false;
  for (int r = 0; r < job.size(); ++r) {
    failed |= !st[r].ok();
    poisoned |= job.rank(r).opt->lifecycle() == Lifecycle::kPoisoned;
    EXPECT_EQ(st[r].ok(), st[0].ok()) << "ranks disagree on the outcome";
  }
  // (EXPECT_TRUE: the states are kilobytes of binary, useless in a failure message.)
  if (!failed) {
    EXPECT_TRUE(job.Gather() == loaded) << "a successful load did not load";
  } else if (!poisoned) {
    EXPECT_TRUE(job.Gather() == before) << "a failed load changed the state: " << st[0];
  } else {
    for (int r = 0; r < job.size(); ++r) {
      Rank& rank = job.rank(r);
      if (rank.opt->lifecycle() != Lifecycle::kPoisoned) continue;
      std::vector<float> grads(rank.opt->size());
      EXPECT_THAT(rank.opt->Step({grads.data(), DType::kF32, 1.0f, rank.weights.data()}),
                  StatusIs(absl::StatusCode::kFailedPrecondition));
    }
  }
  return failed;
}

}  // namespace ckpt::optimizer::test_job

#endif  // CKPT_OPTIMIZER_CHECKPOINTER_TEST_JOB_H_
