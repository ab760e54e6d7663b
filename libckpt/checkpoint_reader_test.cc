#include "ckpt/checkpoint_reader.h"

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "ckpt/base/status_macros.h"
#include "ckpt/checkpoint_store.h"
#include "ckpt/env.h"
#include "ckpt/formats/chunk.h"
#include "ckpt/formats/manifest.h"
#include "tests/support/status_matchers.h"
#include "tests/support/synthetic_state.h"

namespace ckpt {
namespace {

using testing::IsOk;
using testing::StatusIs;

constexpr char kRoot[] = "/store";
constexpr int kRanks = 3;  // "w" (3000 floats) is cut at 1000 and 2000.
constexpr uint64_t kMaxFileBytes = uint64_t{1} << 30;

class CheckpointReaderTest : public ::testing::Test {
 protected:
  CheckpointReaderTest() : env_(NewMemEnv()) {
    options_.env = env_.get();
    options_.chunk_bytes = 1000;  // 250 floats a chunk: each rank's piece spans four.
  }

  absl::Status Save(uint64_t step) {
    return testing::SaveSyntheticStep(kRoot, options_, kRanks, step);
  }
  static std::string StepDir(uint64_t step) { return JoinPath(kRoot, StepDirectoryName(step)); }
  absl::StatusOr<std::unique_ptr<CheckpointReader>> Open(uint64_t step) {
    return CheckpointReader::Open(StepDir(step), options_);
  }

  // Elements [begin, begin + count) of "w" as read, and as saved at `step`.
  static absl::StatusOr<std::vector<float>> ReadWeights(const CheckpointReader& reader,
                                                        uint64_t begin, uint64_t count) {
    std::vector<float> out(count);
    CKPT_RETURN_IF_ERROR(
        reader.ReadRange("w", begin, count, std::as_writable_bytes(std::span(out))));
    return out;
  }
  static std::vector<float> Weights(uint64_t step, uint64_t begin, uint64_t count) {
    std::vector<float> w = testing::WeightsAt(step);
    return std::vector<float>(w.begin() + begin, w.begin() + begin + count);
  }
  // Expects the read of [begin, begin + count) to succeed and equal what `step` saved.
  static void ExpectWeights(const CheckpointReader& reader, uint64_t step, uint64_t begin,
                            uint64_t count) {
    absl::StatusOr<std::vector<float>> got = ReadWeights(reader, begin, count);
    ASSERT_THAT(got, IsOk()) << begin << "+" << count;
    EXPECT_EQ(*got, Weights(step, begin, count)) << begin << "+" << count;
  }

  // The piece of "w" that `rank` saved, or null.
  static const formats::PieceInfo* WeightPiece(const CheckpointReader& reader, uint32_t rank) {
    absl::StatusOr<const formats::TensorInfo*> w = reader.FindTensor("w");
    if (!w.ok()) return nullptr;
    const formats::Manifest& m = reader.manifest();
    for (const formats::PieceInfo& p : m.pieces) {
      if (&m.tensors[p.tensor] == *w && p.rank == rank) return &p;
    }
    return nullptr;
  }

  // Replaces the file at `path` with edit(its bytes).
  absl::Status Rewrite(const std::string& path, const std::function<void(std::string*)>& edit) {
    CKPT_ASSIGN_OR_RETURN(std::string bytes, ReadFileToString(env_.get(), path, kMaxFileBytes));
    edit(&bytes);
    return WriteFileAtomically(env_.get(), path, bytes);
  }
  absl::Status FlipByte(const std::string& path, uint64_t offset) {
    return Rewrite(path, [offset](std::string* b) { b->at(offset) ^= 0x20; });
  }

  // Copies every file of step `from`'s directory into a new directory named for step `to`.
  absl::Status CopyStepDir(uint64_t from, uint64_t to) {
    CKPT_RETURN_IF_ERROR(env_->CreateDir(StepDir(to)));
    CKPT_ASSIGN_OR_RETURN(std::vector<std::string> names, env_->GetChildren(StepDir(from)));
    for (const std::string& name : names) {
      CKPT_ASSIGN_OR_RETURN(
          std::string bytes,
          ReadFileToString(env_.get(), JoinPath(StepDir(from), name), kMaxFileBytes));
      CKPT_RETURN_IF_ERROR(WriteFileAtomically(env_.get(), JoinPath(StepDir(to), name), bytes));
    }
    return absl::OkStatus();
  }

  std::unique_ptr<Env> env_;
  StoreOptions options_;
};

TEST_F(CheckpointReaderTest, RangeAcrossRanksAndChunksReadsBackExactly) {
  CKPT_ASSERT_OK(Save(4));
  auto reader = Open(4);
  CKPT_ASSERT_OK(reader);
  ASSERT_EQ((*reader)->manifest().world_size, static_cast<uint32_t>(kRanks));
  EXPECT_EQ((*reader)->step(), 4u);
  // [700, 2400) starts in rank 0's third chunk and ends in rank 2's second.
  ExpectWeights(**reader, 4, 700, 1700);
  ExpectWeights(**reader, 4, 0, testing::kWeightElems);
}

TEST_F(CheckpointReaderTest, SingleElementsAtPieceAndChunkEdgesReadBackExactly) {
  CKPT_ASSERT_OK(Save(4));
  auto reader = Open(4);
  CKPT_ASSERT_OK(reader);
  for (uint64_t begin : std::vector<uint64_t>{0, 249, 250, 999, 1000, 1999, 2000, 2999}) {
    ExpectWeights(**reader, 4, begin, 1);
  }
}

TEST_F(CheckpointReaderTest, RangeOutsideTensorIsInvalidArgument) {
  CKPT_ASSERT_OK(Save(1));
  auto reader = Open(1);
  CKPT_ASSERT_OK(reader);
  EXPECT_THAT(ReadWeights(**reader, testing::kWeightElems - 10, 11),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ReadWeights(**reader, testing::kWeightElems + 1, 0),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST_F(CheckpointReaderTest, OutputOfWrongSizeIsInvalidArgument) {
  CKPT_ASSERT_OK(Save(1));
  auto reader = Open(1);
  CKPT_ASSERT_OK(reader);
  std::vector<float> out(10);
  EXPECT_THAT((*reader)->ReadRange("w", 0, 11, std::as_writable_bytes(std::span(out))),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST_F(CheckpointReaderTest, UnknownTensorIsNotFound) {
  CKPT_ASSERT_OK(Save(1));
  auto reader = Open(1);
  CKPT_ASSERT_OK(reader);
  std::vector<float> out(1);
  EXPECT_THAT((*reader)->ReadRange("nope", 0, 1, std::as_writable_bytes(std::span(out))),
              StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT((*reader)->FindTensor("nope"), StatusIs(absl::StatusCode::kNotFound));
}

TEST_F(CheckpointReaderTest, ReadBlobReturnsEachRanksBytes) {
  CKPT_ASSERT_OK(Save(3));
  auto reader = Open(3);
  CKPT_ASSERT_OK(reader);
  for (int rank = 0; rank < kRanks; ++rank) {
    auto blob = (*reader)->ReadBlob("sched", static_cast<uint32_t>(rank));
    CKPT_ASSERT_OK(blob);
    EXPECT_EQ(*blob, testing::SchedulerBlobAt(3, rank)) << rank;
  }
}

TEST_F(CheckpointReaderTest, ReadBlobOfUnknownNameOrRankIsNotFound) {
  CKPT_ASSERT_OK(Save(3));
  auto reader = Open(3);
  CKPT_ASSERT_OK(reader);
  EXPECT_THAT((*reader)->ReadBlob("nope", 0), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT((*reader)->ReadBlob("sched", kRanks), StatusIs(absl::StatusCode::kNotFound));
}

TEST_F(CheckpointReaderTest, FlippedChunkByteFailsReadsOfThatChunkOnly) {
  CKPT_ASSERT_OK(Save(2));
  std::string path;
  uint64_t chunk_elems = 0;
  {
    auto reader = Open(2);
    CKPT_ASSERT_OK(reader);
    const formats::PieceInfo* p = WeightPiece(**reader, 0);
    ASSERT_NE(p, nullptr);
    ASSERT_GT(p->chunk_count, 1u);
    ASSERT_EQ(p->begin, 0u);
    const formats::DataFileInfo& f = (*reader)->manifest().files[p->file];
    path = JoinPath(StepDir(2), f.name);
    chunk_elems = p->chunk_elems;
    CKPT_ASSERT_OK(FlipByte(path, f.chunks[p->first_chunk].offset + formats::kChunkHeaderBytes));
  }
  auto reader = Open(2);
  CKPT_ASSERT_OK(reader);
  EXPECT_THAT(ReadWeights(**reader, 0, 10), StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_THAT(ReadWeights(**reader, chunk_elems - 1, 2), StatusIs(absl::StatusCode::kDataLoss));
  // The error names the file, and the tensor and elements the chunk holds.
  const std::string message(ReadWeights(**reader, 0, 10).status().message());
  EXPECT_THAT(message, ::testing::HasSubstr(path));
  EXPECT_THAT(message, ::testing::HasSubstr(absl::StrCat("(tensor \"w\", elements [0, ",
                                                         chunk_elems, "))")));
  ExpectWeights(**reader, 2, chunk_elems, 10);
  ExpectWeights(**reader, 2, 1000, 10);  // Rank 1's file.
}

TEST_F(CheckpointReaderTest, DataFileOfWrongSizeIsRefusedAtOpen) {
  CKPT_ASSERT_OK(Save(2));
  CKPT_ASSERT_OK(
      Rewrite(JoinPath(StepDir(2), "rank-00001.data"), [](std::string* b) { b->push_back('x'); }));
  EXPECT_THAT(Open(2), StatusIs(absl::StatusCode::kDataLoss));
}

TEST_F(CheckpointReaderTest, ManifestNamingAnotherStepIsRefusedAtOpen) {
  CKPT_ASSERT_OK(Save(1));
  CKPT_ASSERT_OK(CopyStepDir(1, 7));
  EXPECT_THAT(Open(7), StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_THAT(Open(1), IsOk());
}

TEST_F(CheckpointReaderTest, DirectoryWithoutManifestIsNotFound) {
  CKPT_ASSERT_OK(Save(1));
  CKPT_ASSERT_OK(env_->RemoveFile(JoinPath(StepDir(1), "MANIFEST")));
  EXPECT_THAT(Open(1), StatusIs(absl::StatusCode::kNotFound));
}

TEST_F(CheckpointReaderTest, ZstdChunksReadBackExactly) {
  options_.codec = formats::Codec::kZstd;
  CKPT_ASSERT_OK(Save(5));
  auto reader = Open(5);
  CKPT_ASSERT_OK(reader);
  const formats::PieceInfo* p = WeightPiece(**reader, 1);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ((*reader)->manifest().files[p->file].chunks[p->first_chunk].codec,
            formats::Codec::kZstd);
  ExpectWeights(**reader, 5, 0, testing::kWeightElems);
  ExpectWeights(**reader, 5, 1100, 300);
}

TEST_F(CheckpointReaderTest, ACompressedChunkReadInBatchesIsDecodedOnce) {
  options_.codec = formats::Codec::kZstd;
  options_.chunk_bytes = 1 << 20;  // Each rank's 1000 floats of "w" are one chunk.
  CKPT_ASSERT_OK(Save(5));
  auto reader = Open(5);
  CKPT_ASSERT_OK(reader);
  // Rank 1's chunk of 1000 floats, read 10 elements at a time.
  for (uint64_t begin = 1000; begin < 2000; begin += 10) ExpectWeights(**reader, 5, begin, 10);
  EXPECT_EQ((*reader)->decoded_bytes(), 1000u * 4) << "decoded again for every batch";
  // Two chunks read in part, alternately: each read continues its own chunk's stream.
  for (uint64_t begin = 0; begin < 1000; begin += 100) {
    ExpectWeights(**reader, 5, begin, 100);
    ExpectWeights(**reader, 5, 1000 + begin, 100);
  }
  EXPECT_EQ((*reader)->decoded_bytes(), 3000u * 4);
  // A read behind its chunk's stream decodes that chunk again from its start.
  ExpectWeights(**reader, 5, 1500, 10);
  ExpectWeights(**reader, 5, 1200, 10);
  EXPECT_EQ((*reader)->decoded_bytes(), 3000u * 4 + 510 * 4 + 210 * 4);
}

// ReadRanges reads many ranges (of one chunk, of several ranks, given out of order) in one
// pipeline: each lands where ReadRange would put it, and a compressed chunk serving several
// ranges is decoded once, front to back, whatever order the ranges came in.
TEST_F(CheckpointReaderTest, ReadRangesDeliversEachRangeAndDecodesAChunkOnce) {
  options_.codec = formats::Codec::kZstd;
  options_.chunk_bytes = 1 << 20;  // Each rank's 1000 floats of "w" are one chunk.
  CKPT_ASSERT_OK(Save(5));
  auto reader = Open(5);
  CKPT_ASSERT_OK(reader);
  const std::vector<std::pair<uint64_t, uint64_t>> wanted = {
      {1500, 10}, {1000, 100}, {2990, 10}, {1200, 300}, {0, 1}};
  std::vector<std::vector<float>> out;
  std::vector<CheckpointReader::RangeRead> ranges;
  for (const auto& [begin, count] : wanted) out.emplace_back(count, -1.0f);
  for (size_t i = 0; i < wanted.size(); ++i) {
    ranges.push_back({"w", wanted[i].first, wanted[i].second,
                      std::as_writable_bytes(std::span<float>(out[i]))});
  }
  CKPT_ASSERT_OK((*reader)->ReadRanges(ranges));
  for (size_t i = 0; i < wanted.size(); ++i) {
    EXPECT_EQ(out[i], Weights(5, wanted[i].first, wanted[i].second)) << "range " << i;
  }
  // Rank 1's chunk is decoded up to element 1510 once (not once per range); rank 2's up to its
  // end and rank 0's for one element.
  EXPECT_EQ((*reader)->decoded_bytes(), (510u + 1000u + 1u) * 4);
  ranges.push_back({"nope", 0, 1, {}});
  EXPECT_THAT((*reader)->ReadRanges(ranges), testing::StatusIs(absl::StatusCode::kNotFound));
}

// Counts the reads of the files it opens, and fails with EIO every read that covers the byte
// at FailReadsOf's offset (a bad sector).
class ReadCountingEnv : public EnvWrapper {
 public:
  explicit ReadCountingEnv(Env* target) : EnvWrapper(target) {}
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> NewRandomAccessFile(
      const std::string& path, const FileOptions& options) override {
    CKPT_ASSIGN_OR_RETURN(std::unique_ptr<RandomAccessFile> f,
                          EnvWrapper::NewRandomAccessFile(path, options));
    return std::unique_ptr<RandomAccessFile>(new Counted(std::move(f), this));
  }
  int reads() const { return reads_.load(); }
  void FailReadsOf(uint64_t offset) { bad_ = offset; }

 private:
  class Counted : public RandomAccessFile {
   public:
    Counted(std::unique_ptr<RandomAccessFile> f, ReadCountingEnv* env)
        : f_(std::move(f)), env_(env) {}
    absl::Status Read(uint64_t offset, std::span<std::byte> out) const override {
      env_->reads_.fetch_add(1);
      const uint64_t bad = env_->bad_.load();
      if (bad >= offset && bad - offset < out.size()) {
        return absl::UnknownError(absl::StrCat("injected EIO at offset ", bad));
      }
      return f_->Read(offset, out);
    }
    uint64_t size() const override { return f_->size(); }

   private:
    std::unique_ptr<RandomAccessFile> f_;
    ReadCountingEnv* env_;
  };
  std::atomic<int> reads_{0};
  std::atomic<uint64_t> bad_{UINT64_MAX};
};

// 3000 tensors of 100 floats, one chunk (one 4 KiB extent) each: a read of every tensor but each
// third is a few requests of megabytes, the unread chunks between read ones skipped over; each
// chunk is still checked on its own, and a bad one that no range reads fails nothing.
TEST_F(CheckpointReaderTest, SmallChunksNearEachOtherAreReadInFewRequests) {
  constexpr int kTensors = 3000;
  ReadCountingEnv counting(env_.get());
  options_.env = &counting;
  std::vector<std::vector<float>> saved(kTensors, std::vector<float>(100));
  {
    auto store = CheckpointStore::Open(kRoot, options_);
    CKPT_ASSERT_OK(store);
    auto opened = (*store)->BeginSave(7);
    CKPT_ASSERT_OK(opened);
    SaveTransaction* txn = opened->get();
    for (int t = 0; t < kTensors; ++t) {
      const std::string name = absl::StrCat("t", t);
      for (int i = 0; i < 100; ++i) saved[t][i] = static_cast<float>(t * 1000 + i);
      CKPT_ASSERT_OK(txn->DeclareTensor({name, formats::DType::kF32, {100}}));
      CKPT_ASSERT_OK(txn->WritePiece(name, 0, 100, std::as_bytes(std::span(saved[t]))));
    }
    CKPT_ASSERT_OK(txn->Commit());
  }
  auto read_all_but_each_third = [&](const CheckpointReader& reader,
                                     std::vector<std::vector<float>>* out) {
    std::vector<CheckpointReader::RangeRead> ranges;
    out->assign(kTensors, std::vector<float>(100, -1.0f));
    for (int t = 0; t < kTensors; ++t) {
      if (t % 3 == 2) continue;
      ranges.push_back({absl::StrCat("t", t), 0, 100,
                        std::as_writable_bytes(std::span((*out)[t]))});
    }
    return reader.ReadRanges(ranges);
  };
  std::string path;
  uint64_t skipped_chunk_offset = 0, read_chunk_offset = 0;
  {
    auto opened = Open(7);
    CKPT_ASSERT_OK(opened);
    const CheckpointReader* reader = opened->get();
    const int before = counting.reads();
    std::vector<std::vector<float>> out;
    CKPT_ASSERT_OK(read_all_but_each_third(*reader, &out));
    // 3000 extents of 4 KiB (12 MiB, 8 MiB of them read): in requests of up to 4 MiB.
    EXPECT_LE(counting.reads() - before, 4);
    for (int t = 0; t < kTensors; ++t) {
      EXPECT_EQ(out[t], t % 3 == 2 ? std::vector<float>(100, -1.0f) : saved[t]) << t;
    }
    const formats::Manifest& m = reader->manifest();
    path = JoinPath(StepDir(7), m.files[0].name);
    auto chunk_of = [&](int t) {
      for (const formats::PieceInfo& p : m.pieces) {
        if (m.tensors[p.tensor].name == absl::StrCat("t", t)) {
          return m.files[p.file].chunks[p.first_chunk].offset;
        }
      }
      return uint64_t{0};
    };
    skipped_chunk_offset = chunk_of(1502);  // In the middle of a merged request, never read.
    read_chunk_offset = chunk_of(1504);
  }
  // An unreadable sector in a chunk no range asks for: the merged read fails, the chunks are
  // read again alone, and everything asked for arrives; a read of that chunk itself fails.
  counting.FailReadsOf(skipped_chunk_offset + formats::kChunkHeaderBytes);
  {
    auto reader = Open(7);
    CKPT_ASSERT_OK(reader);
    std::vector<std::vector<float>> out;
    CKPT_ASSERT_OK(read_all_but_each_third(**reader, &out));
    EXPECT_EQ(out[1501], saved[1501]);
    EXPECT_EQ(out[1503], saved[1503]);
    std::vector<float> one(100);
    EXPECT_THAT((*reader)->ReadRange("t1502", 0, 100, std::as_writable_bytes(std::span(one))),
                StatusIs(absl::StatusCode::kUnknown));
  }
  counting.FailReadsOf(UINT64_MAX);
  CKPT_ASSERT_OK(FlipByte(path, skipped_chunk_offset + formats::kChunkHeaderBytes));
  {
    auto reader = Open(7);
    CKPT_ASSERT_OK(reader);
    std::vector<std::vector<float>> out;
    CKPT_ASSERT_OK(read_all_but_each_third(**reader, &out));
    EXPECT_EQ(out[1504], saved[1504]);
  }
  CKPT_ASSERT_OK(FlipByte(path, read_chunk_offset + formats::kChunkHeaderBytes));
  auto reader = Open(7);
  CKPT_ASSERT_OK(reader);
  std::vector<std::vector<float>> out;
  const absl::Status bad = read_all_but_each_third(**reader, &out);
  EXPECT_THAT(bad, StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_THAT(std::string(bad.message()),
              ::testing::HasSubstr(absl::StrCat("at offset ", read_chunk_offset)));
}

// A range streamed in several WritePiece calls, each of whole chunks but the last, is recorded
// as one piece; a call that does not continue it (another tensor, a gap, a partial chunk
// before it) starts a new one. Every element reads back either way.
TEST_F(CheckpointReaderTest, AdjacentWritesOfWholeChunksBecomeOnePiece) {
  auto store = CheckpointStore::Open(kRoot, options_);
  ASSERT_THAT(store, IsOk());
  auto txn = (*store)->BeginSave(9);
  ASSERT_THAT(txn, IsOk());
  std::vector<float> w(2000);
  for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>(i);
  const auto part = [&](size_t begin, size_t count) {
    return std::as_bytes(std::span(w).subspan(begin, count));
  };
  ASSERT_THAT((*txn)->DeclareTensor({"a", formats::DType::kF32, {2000}}), IsOk());
  ASSERT_THAT((*txn)->DeclareTensor({"b", formats::DType::kF32, {2000}}), IsOk());
  // "a": 500 + 250 + 100 continue one piece (250 floats a chunk); 900 after a partial chunk is new.
  ASSERT_THAT((*txn)->WritePiece("a", 0, 500, part(0, 500)), IsOk());
  ASSERT_THAT((*txn)->WritePiece("a", 500, 250, part(500, 250)), IsOk());
  ASSERT_THAT((*txn)->WritePiece("a", 750, 100, part(750, 100)), IsOk());
  ASSERT_THAT((*txn)->WritePiece("a", 850, 1150, part(850, 1150)), IsOk());
  // "b" after "a" starts its own piece; a gap starts another.
  ASSERT_THAT((*txn)->WritePiece("b", 0, 250, part(0, 250)), IsOk());
  ASSERT_THAT((*txn)->WritePiece("b", 300, 250, part(300, 250)), IsOk());
  ASSERT_THAT((*txn)->Commit(), IsOk());
  auto reader = Open(9);
  ASSERT_THAT(reader, IsOk());
  std::vector<std::tuple<std::string, uint64_t, uint64_t>> pieces;
  for (const formats::PieceInfo& p : (*reader)->manifest().pieces) {
    pieces.emplace_back((*reader)->manifest().tensors[p.tensor].name, p.begin, p.count);
  }
  using P = std::tuple<std::string, uint64_t, uint64_t>;
  EXPECT_EQ(pieces, (std::vector<P>{P{"a", 0, 850}, P{"a", 850, 1150}, P{"b", 0, 250},
                                    P{"b", 300, 250}}));
  std::vector<float> back(2000);
  ASSERT_THAT((*reader)->ReadRange("a", 0, 2000, std::as_writable_bytes(std::span(back))), IsOk());
  EXPECT_EQ(back, w);
}

}  // namespace
}  // namespace ckpt
