// The undo spill of a load costs at most one chunk plus 16 MiB of memory beyond a load that needs
// no spill, at 1 GiB of optimizer state on a real file system: the spill is written straight from
// the slabs, never through a second copy of the state (its two writer threads hold a chunk-sized
// buffer each, up to 6 MiB with 2 MiB pages, within the slack). Measured with the process's peak resident
// set (getrusage), so this test has a binary of its own: nothing else may have raised the peak.
#include <sys/resource.h>

#include <cstdio>
#include <memory>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "ckpt/coordinator.h"
#include "ckpt/formats/float_convert.h"
#include "ckpt/optimizer/checkpointer.h"
#include "tests/support/status_matchers.h"
#include "tests/support/temp_dir.h"

namespace ckpt::optimizer {
namespace {

using testing::IsOk;

uint64_t PeakRssBytes() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<uint64_t>(usage.ru_maxrss) * 1024;  // Linux reports KiB.
}

TEST(SpillMemoryTest, UndoSpillOfOneGibibyteCostsAtMostOneChunkPlus16MiB) {
  constexpr uint64_t kChunkBytes = uint64_t{4} << 20;
  constexpr uint64_t kSlack = uint64_t{16} << 20;
  // 12 bytes of state per parameter (FP32 masters and moments): 1 GiB of state.
  constexpr uint64_t kParams = (uint64_t{1} << 30) / 12;
  testing::ScopedTempDir dir;
  StoreOptions so;
  so.chunk_bytes = kChunkBytes;
  auto store = CheckpointStore::Open(dir.path() + "/store", so);
  ASSERT_THAT(store, IsOk());

  StagedAdamWOptions o;
  o.params = {{"w", {kParams}, formats::DType::kBF16, 0}};
  o.groups = {ParamGroup{.lr = 1e-3, .weight_decay = 0.01}};
  o.pieces = {Piece{0, 0, kParams}};
  o.threads = 2;
  std::vector<uint16_t> weights(kParams, formats::FloatToBf16(0.5f));
  auto opt = StagedAdamW::Create(o, std::as_bytes(std::span(weights)));
  ASSERT_THAT(opt, IsOk());
  SingleProcessCoordinator solo;
  auto ckpt = Checkpointer::Create(opt->get(), store->get(), &solo);
  ASSERT_THAT(ckpt, IsOk());
  std::vector<float> grads(kParams, 0.25f);
  auto step = [&] {
    ASSERT_THAT((*opt)->Step({grads.data(), formats::DType::kF32, 1.0f, weights.data()}), IsOk());
  };

  step();
  ASSERT_THAT((*ckpt)->Save(1), IsOk());
  step();
  ASSERT_THAT((*ckpt)->Save(2), IsOk());
  // The state equals step 2, so loading step 1 rolls back from step 2 if need be: no spill. It
  // warms everything a load uses (the read pipeline keeps its buffers), so the next load's peak
  // differs from this one's only by what the spill adds.
  auto free_undo = (*ckpt)->Load(1);
  ASSERT_THAT(free_undo, IsOk());
  ASSERT_FALSE(free_undo->undo_spilled);
  const std::vector<float> master_at_1((*opt)->master().begin(), (*opt)->master().end());
  step();  // Unsaved: the next load must spill the state first.
  const uint64_t before = PeakRssBytes();
  ASSERT_GT(before, uint64_t{1} << 30) << "the state is not resident";
  auto spilled = (*ckpt)->Load(1);
  ASSERT_THAT(spilled, IsOk());
  ASSERT_TRUE(spilled->undo_spilled);
  const uint64_t after = PeakRssBytes();
  std::printf("peak RSS %.1f MiB before the spilling load, %.1f MiB after: +%.1f MiB "
              "(allowed: one chunk + 16 MiB = %.1f MiB)\n",
              before / 1048576.0, after / 1048576.0, (after - before) / 1048576.0,
              (kChunkBytes + kSlack) / 1048576.0);
  EXPECT_LE(after - before, kChunkBytes + kSlack);
  EXPECT_TRUE(std::equal(master_at_1.begin(), master_at_1.end(), (*opt)->master().begin()))
      << "the load after the spill did not restore step 1";
}

}  // namespace
}  // namespace ckpt::optimizer
