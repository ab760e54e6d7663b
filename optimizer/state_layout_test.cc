// StateLayout names each parameter's state tensors and cuts any slab range into runs of its
// pieces; state_io writes a rank's state through them (whole, or a unit at a time, deferred) and
// reads it back: the weights are the masters rounded, moments stored in another dtype are
// converted, and both writers lay out the same values.
#include "optimizer/state_layout.h"

#include <cstring>
#include <random>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "ckpt/checkpoint_store.h"
#include "ckpt/env.h"
#include "ckpt/formats/convert.h"
#include "ckpt/formats/float_convert.h"
#include "optimizer/state_io.h"
#include "tests/support/status_matchers.h"

namespace ckpt::optimizer::internal {
namespace {

using formats::DType;
using testing::IsOk;

// Three parameters; this rank holds two pieces of "b" (out of order), all of "a", none of "c".
StateLayout Layout(DType model = DType::kBF16, DType moment = DType::kF32) {
  std::vector<ParamSpec> params = {{"a", {4, 5}, model, 0}, {"b", {30}, model, 0},
                                   {"c", {7}, model, 0}};
  std::vector<Piece> pieces = {{1, 20, 10}, {0, 0, 20}, {1, 0, 5}};
  return StateLayout(params, pieces, moment);
}

TEST(StateLayoutTest, NamesEveryStateTensorOfEveryParameter) {
  const StateLayout layout = Layout();
  std::vector<std::string> names;
  for (const ParamState& s : layout.states(1)) names.push_back(s.name);
  EXPECT_THAT(names, ::testing::ElementsAre("b", "optimizer.master.b", "optimizer.exp_avg.b",
                                            "optimizer.exp_avg_sq.b"));
  EXPECT_EQ(StateTensorName(kMasterKey, "x.y"), "optimizer.master.x.y");
  const std::vector<TensorSpec> d = layout.Declarations();
  ASSERT_EQ(d.size(), 12u);  // Per parameter: weights, master, exp_avg, exp_avg_sq.
  EXPECT_EQ(d[4].name, "b");
  EXPECT_EQ(d[4].dtype, DType::kBF16);
  EXPECT_EQ(d[5].dtype, DType::kF32);
  EXPECT_EQ(d[6].name, "optimizer.exp_avg.b");
  EXPECT_EQ(d[11].shape, std::vector<uint64_t>{7});
  EXPECT_EQ(Layout(DType::kF16, DType::kBF16).states(0)[3].dtype, DType::kBF16);
  EXPECT_EQ(layout.size(), 35u);
}

TEST(StateLayoutTest, RunsCutPiecesAtTheRangesEnds) {
  const StateLayout layout = Layout();
  EXPECT_THAT(layout.Runs(), ::testing::ElementsAre(StateRun{1, 20, 0, 10}, StateRun{0, 0, 10, 20},
                                                    StateRun{1, 0, 30, 5}));
  EXPECT_THAT(layout.Runs(7, 6),
              ::testing::ElementsAre(StateRun{1, 27, 7, 3}, StateRun{0, 0, 10, 3}));
  EXPECT_THAT(layout.Runs(10, 20), ::testing::ElementsAre(StateRun{0, 0, 10, 20}));
  EXPECT_THAT(layout.Runs(34, 1), ::testing::ElementsAre(StateRun{1, 4, 34, 1}));
  EXPECT_TRUE(layout.Runs(12, 0).empty());
}

TEST(StateLayoutTest, AnyRangesThatTileTheSlabsGiveEveryElementOnce) {
  const StateLayout layout = Layout();
  std::mt19937 gen(3);
  for (int round = 0; round < 200; ++round) {
    std::vector<int> seen(layout.size(), 0);
    for (uint64_t at = 0; at < layout.size();) {
      const uint64_t n = std::min<uint64_t>(layout.size() - at, 1 + gen() % 9);
      for (const StateRun& r : layout.Runs(at, n)) {
        ASSERT_GE(r.slab_offset, at);
        ASSERT_LE(r.slab_offset + r.count, at + n);
        // The run is where the piece puts it: same parameter, same tensor elements.
        for (const StateRun& whole : layout.Runs()) {
          if (r.slab_offset >= whole.slab_offset &&
              r.slab_offset < whole.slab_offset + whole.count) {
            EXPECT_EQ(r.param, whole.param);
            EXPECT_EQ(r.tensor_begin, whole.tensor_begin + (r.slab_offset - whole.slab_offset));
          }
        }
        for (uint64_t i = 0; i < r.count; ++i) ++seen[r.slab_offset + i];
      }
      at += n;
    }
    for (uint64_t i = 0; i < layout.size(); ++i) ASSERT_EQ(seen[i], 1) << "element " << i;
  }
}

class StateIoTest : public ::testing::Test {
 protected:
  StateIoTest() : env_(NewMemEnv()) {}

  // A store with a tiny chunk, so that pieces span several chunks and blocks.
  std::unique_ptr<CheckpointStore> Store(const std::string& root) {
    StoreOptions o;
    o.env = env_.get();
    o.chunk_bytes = 16;
    return CheckpointStore::Open(root, o).value();
  }
  // Slabs of `layout`: masters with fractions that BF16 must round, moments of the layout's
  // dtype made from their own values.
  void Fill(const StateLayout& layout) {
    const size_t n = layout.size(), msize = formats::DTypeSize(layout.moment_dtype());
    master_.resize(n);
    for (size_t i = 0; i < n; ++i) master_[i] = 1.0f + static_cast<float>(i) / 3.0f;
    std::vector<float> m(n), v(n);
    for (size_t i = 0; i < n; ++i) {
      m[i] = 0.25f * static_cast<float>(i) - 1.0f;
      v[i] = static_cast<float>(i * i) / 7.0f;
    }
    exp_avg_.resize(n * msize);
    exp_avg_sq_.resize(n * msize);
    formats::Convert(DType::kF32, std::as_bytes(std::span(m)), layout.moment_dtype(),
                     exp_avg_);
    formats::Convert(DType::kF32, std::as_bytes(std::span(v)), layout.moment_dtype(),
                     exp_avg_sq_);
  }
  StateBytes From() const {
    return {reinterpret_cast<const std::byte*>(master_.data()), exp_avg_.data(),
            exp_avg_sq_.data()};
  }

  std::unique_ptr<Env> env_;
  std::vector<float> master_;
  std::vector<std::byte> exp_avg_, exp_avg_sq_;
};

TEST_F(StateIoTest, WrittenWholeOrUnitByUnitTheStepHoldsTheSameStateAndReadsBack) {
  const StateLayout layout = Layout();
  Fill(layout);
  std::unique_ptr<CheckpointStore> store = Store("/s");
  {
    auto txn = store->BeginSave(1).value();
    for (const TensorSpec& t : layout.Declarations()) ASSERT_THAT(txn->DeclareTensor(t), IsOk());
    ASSERT_THAT(WriteState(*txn, layout, From(), 16), IsOk());
    ASSERT_THAT(txn->Commit(), IsOk());
  }
  {
    // Units of 6 elements, as an async save queues them.
    auto txn = store->BeginSave(2).value();
    for (const TensorSpec& t : layout.Declarations()) ASSERT_THAT(txn->DeclareTensor(t), IsOk());
    std::vector<std::byte> weights[2];
    uint64_t ticket = 0;
    for (uint64_t at = 0, u = 0; at < layout.size(); at += 6, ++u) {
      const uint64_t n = std::min<uint64_t>(6, layout.size() - at);
      weights[u % 2].resize(2 * n);
      const StateBytes from = {From().master + 4 * at, From().exp_avg + 4 * at,
                               From().exp_avg_sq + 4 * at};
      auto queued = QueueState(*txn, layout, at, n, from, weights[u % 2]);
      ASSERT_THAT(queued, IsOk());
      ASSERT_THAT(txn->stream().WaitWritten(*queued), IsOk());  // Before the buffer is used again.
      ticket = *queued;
    }
    ASSERT_THAT(txn->stream().WaitWritten(ticket), IsOk());
    ASSERT_THAT(txn->Commit(), IsOk());
  }
  for (uint64_t step : {1, 2}) {
    auto reader = store->OpenStep(step).value();
    for (const StateRun& r : layout.Runs()) {
      std::vector<uint16_t> w(r.count);
      ASSERT_THAT(reader->ReadRange(layout.states(r.param)[0].name, r.tensor_begin,
                                    r.count, std::as_writable_bytes(std::span(w))),
                  IsOk());
      for (uint64_t i = 0; i < r.count; ++i) {
        EXPECT_EQ(w[i], formats::FloatToBf16(master_[r.slab_offset + i]))
            << "step " << step << " weights of param " << r.param;
      }
    }
    std::vector<float> master(layout.size());
    std::vector<std::byte> m(exp_avg_.size()), v(exp_avg_sq_.size());
    ASSERT_THAT(ReadState(*reader, layout,
                          {reinterpret_cast<std::byte*>(master.data()), m.data(), v.data()}),
                IsOk());
    EXPECT_EQ(master, master_) << "step " << step;
    EXPECT_EQ(m, exp_avg_) << "step " << step;
    EXPECT_EQ(v, exp_avg_sq_) << "step " << step;
  }
}

TEST_F(StateIoTest, MomentsStoredInAnotherDtypeAreConvertedOnRead) {
  const StateLayout f32 = Layout(DType::kF32, DType::kF32);
  Fill(f32);
  std::unique_ptr<CheckpointStore> store = Store("/m");
  auto txn = store->BeginSave(1).value();
  for (const TensorSpec& t : f32.Declarations()) ASSERT_THAT(txn->DeclareTensor(t), IsOk());
  ASSERT_THAT(WriteState(*txn, f32, From(), 16), IsOk());
  ASSERT_THAT(txn->Commit(), IsOk());
  // Read into BF16 moments: each is the F32 moment rounded.
  const StateLayout bf16 = Layout(DType::kF32, DType::kBF16);
  std::vector<float> master(f32.size());
  std::vector<uint16_t> m(f32.size()), v(f32.size());
  ASSERT_THAT(ReadState(*store->OpenStep(1).value(), bf16,
                        {reinterpret_cast<std::byte*>(master.data()),
                         reinterpret_cast<std::byte*>(m.data()),
                         reinterpret_cast<std::byte*>(v.data())}),
              IsOk());
  EXPECT_EQ(master, master_);
  for (size_t i = 0; i < m.size(); ++i) {
    float want;
    std::memcpy(&want, exp_avg_.data() + 4 * i, 4);
    ASSERT_EQ(m[i], formats::FloatToBf16(want)) << "element " << i;
  }
}

}  // namespace
}  // namespace ckpt::optimizer::internal
