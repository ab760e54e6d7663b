// A data-parallel job under mpirun: StagedAdamW on every rank (Megatron layout for the MPI world
// size), checkpoints through Checkpointer and MpiCoordinator. Driven by run_mpi_test.sh.
//
//   mpi_job --root DIR [--load] --steps-from A --steps-to B [--save S] [--dump FILE]
//           [--kill-rank R]
// --load loads LATEST first; steps A..B-1 run (gradients and the learning rate depend only on
// the step, the parameter and the flat index, so every layout computes the same bits); --save
// saves step S afterwards; --dump writes this rank's elements as sorted-able lines
// "param index weight master exp_avg exp_avg_sq" (hex bytes) to FILE.rank<r>, plus the groups;
// --kill-rank R makes rank R SIGKILL itself at the commit vote of the save (after its data file
// and part are written): half-way through a save.
#include <mpi.h>
#include <signal.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "ckpt/checkpoint_store.h"
#include "ckpt/formats/float_convert.h"
#include "ckpt/mpi_coordinator.h"
#include "ckpt/optimizer/checkpointer.h"
#include "ckpt/optimizer/layout.h"
#include "tests/support/toy_model.h"

namespace ckpt {
namespace {

using formats::DType;
using optimizer::ParamGroup;

// Kills this process at the n-th AllGather after Arm(n).
class KillingCoordinator : public Coordinator {
 public:
  explicit KillingCoordinator(Coordinator* inner) : inner_(inner) {}
  void Arm(int n) { kill_at_ = calls_ + n; }
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  absl::StatusOr<std::vector<std::string>> AllGather(absl::string_view mine) override {
    if (++calls_ == kill_at_) ::raise(SIGKILL);
    return inner_->AllGather(mine);
  }

 private:
  Coordinator* inner_;
  int kill_at_ = -1;
  int calls_ = 0;
};

std::string Hex(const void* p, size_t n) {
  std::string out;
  for (size_t i = 0; i < n; ++i)
    absl::StrAppend(&out, absl::Hex(static_cast<const uint8_t*>(p)[i], absl::kZeroPad2));
  return out;
}

int Fail(const absl::Status& s, int rank) {
  std::fprintf(stderr, "rank %d: %s\n", rank, s.ToString().c_str());
  return 1;
}

int Run(int argc, char** argv) {
  std::string root, dump;
  bool load = false;
  int from = 0, to = 0, kill_rank = -1;
  std::optional<uint64_t> save;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&] { return i + 1 < argc ? std::string(argv[++i]) : std::string(); };
    uint64_t v = 0;
    if (a == "--root")
      root = next();
    else if (a == "--load")
      load = true;
    else if (a == "--steps-from")
      from = std::stoi(next());
    else if (a == "--steps-to")
      to = std::stoi(next());
    else if (a == "--save" && absl::SimpleAtoi(next(), &v))
      save = v;
    else if (a == "--dump")
      dump = next();
    else if (a == "--kill-rank")
      kill_rank = std::stoi(next());
    else
      return std::fprintf(stderr, "unknown flag %s\n", a.c_str()), 2;
  }
  auto mpi = NewMpiCoordinator();
  if (!mpi.ok()) return Fail(mpi.status(), -1);
  const int rank = (*mpi)->rank(), dp = (*mpi)->size();
  KillingCoordinator coord(mpi->get());
  StoreOptions so;
  so.primary = rank == 0;
  so.chunk_bytes = 4096;
  if (rank == 0) {  // The primary creates and recovers the root before the others read it.
    auto s = CheckpointStore::Open(root, so);
    if (!s.ok()) return Fail(s.status(), rank);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  auto store = CheckpointStore::Open(root, so);
  if (!store.ok()) return Fail(store.status(), rank);
  auto buckets =
      optimizer::BuildBuckets(testing::ToyModel(), {.bucket_elems = 1000, .pad_to = 8}, dp);
  if (!buckets.ok()) return Fail(buckets.status(), rank);
  optimizer::StagedAdamWOptions o;
  o.params = testing::ToyModel();
  o.groups = testing::ToyGroups();
  o.pieces = optimizer::RankPieces(*buckets, dp)[static_cast<size_t>(rank)];
  o.threads = 1;
  std::vector<uint16_t> weights;
  for (const optimizer::Piece& p : o.pieces)
    for (uint64_t i = 0; i < p.count; ++i)
      weights.push_back(formats::FloatToBf16(testing::ToyInitialValue(p.param, p.begin + i)));
  auto opt = optimizer::StagedAdamW::Create(o, std::as_bytes(std::span(weights)));
  if (!opt.ok()) return Fail(opt.status(), rank);
  auto ckpt = optimizer::Checkpointer::Create(opt->get(), store->get(), &coord);
  if (!ckpt.ok()) return Fail(ckpt.status(), rank);
  if (load) {
    auto loaded = (*ckpt)->Load(std::nullopt);
    if (!loaded.ok()) return Fail(loaded.status(), rank);
    if (auto st = (*opt)->WriteModelWeights(weights.data()); !st.ok()) return Fail(st, rank);
    if (rank == 0)
      std::printf("loaded step %llu saved by %u ranks into %d\n",
                  static_cast<unsigned long long>(loaded->step), loaded->saved_world_size, dp);
  }
  for (int s = from; s < to; ++s) {
    for (size_t g = 0; g < testing::ToyGroups().size(); ++g) {
      if (auto st = (*opt)->SetGroup(g, testing::ToyGroupAt(g, s)); !st.ok()) return Fail(st, rank);
    }
    std::vector<float> grads;
    for (const optimizer::Piece& p : o.pieces)
      for (uint64_t i = 0; i < p.count; ++i)
        grads.push_back(testing::ToyGradient(p.param, p.begin + i, s));
    auto r = (*opt)->Step({grads.data(), DType::kF32, 1.0f, weights.data()});
    if (!r.ok()) return Fail(r.status(), rank);
  }
  if (save.has_value()) {
    // Save's collectives: the clean vote, BeginSave's broadcast, then the commit vote (third).
    if (rank == kill_rank) coord.Arm(3);
    if (auto s = (*ckpt)->Save(*save, {{"position", std::to_string(to)}}); !s.ok()) {
      return Fail(s, rank);
    }
    if (rank == 0)
      std::printf("saved step %llu from %d ranks\n", static_cast<unsigned long long>(*save), dp);
  }
  if (!dump.empty()) {
    std::ofstream out(absl::StrCat(dump, ".rank", rank));
    uint64_t at = 0;
    for (const optimizer::Piece& p : o.pieces) {
      for (uint64_t i = 0; i < p.count; ++i, ++at) {
        out << p.param << " " << p.begin + i << " " << Hex(&weights[at], 2) << " "
            << Hex(&(*opt)->master()[at], 4) << " "
            << Hex((*opt)->exp_avg_bytes().data() + 4 * at, 4) << " "
            << Hex((*opt)->exp_avg_sq_bytes().data() + 4 * at, 4) << "\n";
      }
    }
    for (const ParamGroup& g : (*opt)->groups()) {
      out << "group " << Hex(&g.lr, 8) << " " << g.step << "\n";
    }
  }
  return 0;
}

}  // namespace
}  // namespace ckpt

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rc = ckpt::Run(argc, argv);
  MPI_Finalize();
  return rc;
}
