// One behavioural suite run against every Env (STYLE.md §3).
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "ckpt/base/coding.h"
#include "ckpt/env.h"
#include "libckpt/aligned_buffer.h"
#include "tests/support/fault_injection_env.h"
#include "tests/support/status_matchers.h"
#include "tests/support/temp_dir.h"

namespace ckpt {
namespace {

using ::ckpt::testing::IsOk;
using ::ckpt::testing::StatusIs;
using ::testing::UnorderedElementsAre;

struct EnvFactory {
  std::string name;
  bool on_disk;
  std::function<absl::StatusOr<std::unique_ptr<Env>>()> make;
};

class EnvConformanceTest : public ::testing::TestWithParam<EnvFactory> {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Env>> env = GetParam().make();
    if (!env.ok()) GTEST_SKIP() << GetParam().name << " unavailable here: " << env.status();
    env_ = std::move(env).value();
    root_ = GetParam().on_disk ? tmp_.path() : "/mem";
    if (!GetParam().on_disk) CKPT_ASSERT_OK(env_->CreateDir(root_));
  }
  std::string Path(const std::string& name) { return JoinPath(root_, name); }
  void Write(const std::string& path, const std::string& data, FileOptions options = {}) {
    auto file = env_->NewWritableFile(path, options);
    CKPT_ASSERT_OK(file);
    CKPT_ASSERT_OK((*file)->Append(AsBytes(data)));
    CKPT_ASSERT_OK((*file)->Sync());
    CKPT_ASSERT_OK((*file)->Close());
  }

  testing::ScopedTempDir tmp_;
  std::unique_ptr<Env> env_;
  std::string root_;
};

TEST_P(EnvConformanceTest, WrittenBytesReadBack) {
  Write(Path("a"), "hello world");
  auto data = ReadFileToString(env_.get(), Path("a"), 1 << 20);
  CKPT_ASSERT_OK(data);
  EXPECT_EQ(*data, "hello world");
  auto size = env_->GetFileSize(Path("a"));
  CKPT_ASSERT_OK(size);
  EXPECT_EQ(*size, 11u);
}

TEST_P(EnvConformanceTest, LargeUnalignedAppendsRoundTripWithDirectIo) {
  std::string data;
  for (int i = 0; i < 3 * 1024 * 1024 + 123; ++i)
    data.push_back(static_cast<char>(i * 7 + i / 4096));
  auto file = env_->NewWritableFile(Path("big"), FileOptions{.direct_io = true});
  CKPT_ASSERT_OK(file);
  // Odd-sized appends exercise buffering, partial flushes and the padded tail.
  size_t pos = 0;
  for (size_t step = 1; pos < data.size(); step = step * 3 + 1) {
    size_t n = std::min(step, data.size() - pos);
    CKPT_ASSERT_OK((*file)->Append(AsBytes(absl::string_view(data).substr(pos, n))));
    pos += n;
    if (step == 1) CKPT_ASSERT_OK((*file)->Sync());  // A sync mid-stream, on an unaligned size.
  }
  CKPT_ASSERT_OK((*file)->Sync());
  CKPT_ASSERT_OK((*file)->Close());
  EXPECT_EQ((*file)->size(), data.size());
  auto reader = env_->NewRandomAccessFile(Path("big"), FileOptions{.direct_io = true});
  CKPT_ASSERT_OK(reader);
  EXPECT_EQ((*reader)->size(), data.size());
  auto aligned = internal::AlignedBuffer::Create(1 << 20);
  CKPT_ASSERT_OK(aligned);
  CKPT_ASSERT_OK((*reader)->Read(1 << 20, aligned->span()));
  EXPECT_EQ(AsStringView(aligned->span()), absl::string_view(data).substr(1 << 20, 1 << 20));
  std::string tail(200, '\0');
  CKPT_ASSERT_OK((*reader)->Read(data.size() - 200, std::as_writable_bytes(std::span(tail))));
  EXPECT_EQ(tail, data.substr(data.size() - 200));
}

TEST_P(EnvConformanceTest, ConcurrentWriteAtOutOfOrderLaysOutEveryBlock) {
  // 24 extents of 1 to 3 blocks, each filled with its own byte, written by 4 threads in an
  // order unlike the file's: the file is every extent at its offset, whatever the order.
  constexpr int kExtents = 24;
  std::vector<uint64_t> offset(kExtents + 1, 0);
  for (int i = 0; i < kExtents; ++i) offset[i + 1] = offset[i] + (1 + i % 3) * kWriteAtAlignment;
  auto file = env_->NewWritableFile(Path("blocks"), FileOptions{.direct_io = true});
  CKPT_ASSERT_OK(file);
  std::vector<internal::AlignedBuffer> extents;
  for (int i = 0; i < kExtents; ++i) {
    auto b = internal::AlignedBuffer::Create(offset[i + 1] - offset[i]);
    CKPT_ASSERT_OK(b);
    std::memset(b->data(), 'a' + i, b->size());
    extents.push_back(std::move(b).value());
  }
  std::vector<std::thread> threads;
  std::vector<absl::Status> results(4);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = kExtents - 1 - t; i >= 0; i -= 4) {
        results[t].Update((*file)->WriteAt(offset[i], extents[i].span()));
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (const absl::Status& r : results) CKPT_ASSERT_OK(r);
  EXPECT_EQ((*file)->size(), offset[kExtents]);
  CKPT_ASSERT_OK((*file)->Sync());
  CKPT_ASSERT_OK((*file)->Close());
  auto data = ReadFileToString(env_.get(), Path("blocks"), 1 << 20);
  CKPT_ASSERT_OK(data);
  ASSERT_EQ(data->size(), offset[kExtents]);
  for (int i = 0; i < kExtents; ++i) {
    EXPECT_EQ(data->substr(offset[i], offset[i + 1] - offset[i]),
              std::string(offset[i + 1] - offset[i], static_cast<char>('a' + i)))
        << "extent " << i;
  }
}

TEST_P(EnvConformanceTest, WriteAtRefusesUnalignedWritesAndAFileWrittenByAppend) {
  auto aligned = internal::AlignedBuffer::Create(2 * kWriteAtAlignment);
  CKPT_ASSERT_OK(aligned);
  auto file = env_->NewWritableFile(Path("w"), FileOptions{.direct_io = true});
  CKPT_ASSERT_OK(file);
  const std::span<const std::byte> block = aligned->span().first(kWriteAtAlignment);
  EXPECT_THAT((*file)->WriteAt(100, block), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT((*file)->WriteAt(0, aligned->span().first(100)),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT((*file)->WriteAt(0, aligned->span().subspan(8, kWriteAtAlignment)),
              StatusIs(absl::StatusCode::kInvalidArgument));
  // A gap before the first write reads as zeros; Append may not follow.
  std::memset(aligned->data(), 'z', kWriteAtAlignment);
  CKPT_ASSERT_OK((*file)->WriteAt(kWriteAtAlignment, block));
  EXPECT_THAT((*file)->Append(AsBytes("x")), StatusIs(absl::StatusCode::kFailedPrecondition));
  CKPT_ASSERT_OK((*file)->Close());
  auto data = ReadFileToString(env_.get(), Path("w"), 1 << 20);
  CKPT_ASSERT_OK(data);
  EXPECT_EQ(*data, std::string(kWriteAtAlignment, '\0') + std::string(kWriteAtAlignment, 'z'));

  auto appended = env_->NewWritableFile(Path("a"), FileOptions{.direct_io = true});
  CKPT_ASSERT_OK(appended);
  CKPT_ASSERT_OK((*appended)->Append(AsBytes("x")));
  EXPECT_THAT((*appended)->WriteAt(kWriteAtAlignment, block),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  CKPT_ASSERT_OK((*appended)->Close());
}

TEST_P(EnvConformanceTest, ReadPastEndIsDataLoss) {
  Write(Path("short"), "abc");
  auto reader = env_->NewRandomAccessFile(Path("short"), FileOptions{});
  CKPT_ASSERT_OK(reader);
  std::string out(4, '\0');
  EXPECT_THAT((*reader)->Read(0, std::as_writable_bytes(std::span(out))),
              StatusIs(absl::StatusCode::kDataLoss));
}

TEST_P(EnvConformanceTest, MissingFileIsNotFound) {
  EXPECT_THAT(env_->NewRandomAccessFile(Path("nope"), FileOptions{}),
              StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(env_->GetFileSize(Path("nope")), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(env_->RemoveFile(Path("nope")), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(env_->NewWritableFile(Path("nodir/x"), FileOptions{}),
              StatusIs(absl::StatusCode::kNotFound));
}

TEST_P(EnvConformanceTest, RenameReplacesAtomically) {
  Write(Path("x"), "old");
  Write(Path("x.tmp"), "new");
  CKPT_ASSERT_OK(env_->RenameFile(Path("x.tmp"), Path("x")));
  CKPT_ASSERT_OK(env_->SyncDir(root_));
  EXPECT_EQ(*ReadFileToString(env_.get(), Path("x"), 1 << 20), "new");
  EXPECT_THAT(env_->GetFileSize(Path("x.tmp")), StatusIs(absl::StatusCode::kNotFound));
}

TEST_P(EnvConformanceTest, DirectoriesListRenameAndRemove) {
  CKPT_ASSERT_OK(env_->CreateDir(Path("d")));
  EXPECT_THAT(env_->CreateDir(Path("d")), StatusIs(absl::StatusCode::kAlreadyExists));
  Write(Path("d/f1"), "1");
  Write(Path("d/f2"), "2");
  auto children = env_->GetChildren(Path("d"));
  CKPT_ASSERT_OK(children);
  EXPECT_THAT(*children, UnorderedElementsAre("f1", "f2"));
  EXPECT_THAT(env_->RemoveDir(Path("d")), StatusIs(absl::StatusCode::kFailedPrecondition));
  CKPT_ASSERT_OK(env_->RenameFile(Path("d"), Path("e")));
  EXPECT_EQ(*ReadFileToString(env_.get(), Path("e/f2"), 1 << 20), "2");
  EXPECT_TRUE(*env_->IsDirectory(Path("e")));
  EXPECT_FALSE(*env_->IsDirectory(Path("e/f1")));
  CKPT_ASSERT_OK(RemoveRecursively(env_.get(), Path("e")));
  EXPECT_THAT(env_->IsDirectory(Path("e")), StatusIs(absl::StatusCode::kNotFound));
  CKPT_ASSERT_OK(env_->SyncDir(root_));
}

TEST_P(EnvConformanceTest, StatReportsTypeSizeAndOneMountForOneTree) {
  CKPT_ASSERT_OK(env_->CreateDir(Path("s")));
  Write(Path("s/f"), "12345");
  auto dir = env_->Stat(Path("s"));
  auto file = env_->Stat(Path("s/f"));
  CKPT_ASSERT_OK(dir);
  CKPT_ASSERT_OK(file);
  EXPECT_EQ(dir->type, FileInfo::Type::kDirectory);
  EXPECT_EQ(file->type, FileInfo::Type::kRegular);
  EXPECT_EQ(file->size_bytes, 5u);
  EXPECT_TRUE(file->SameMountAs(*dir));
  EXPECT_THAT(env_->Stat(Path("s/missing")), StatusIs(absl::StatusCode::kNotFound));
}

TEST_P(EnvConformanceTest, LockStaysExclusiveWhenItsFileIsRemovedOrReplaced) {
  auto lock = env_->LockFile(Path("LOCK"));
  CKPT_ASSERT_OK(lock);
  CKPT_ASSERT_OK(env_->RemoveFile(Path("LOCK")));
  EXPECT_THAT(env_->LockFile(Path("LOCK")), StatusIs(absl::StatusCode::kFailedPrecondition));
  lock->reset();
  CKPT_EXPECT_OK(env_->LockFile(Path("LOCK")));
}

TEST_P(EnvConformanceTest, LockIsExclusiveUntilReleased) {
  auto lock = env_->LockFile(Path("LOCK"));
  CKPT_ASSERT_OK(lock);
  EXPECT_THAT(env_->LockFile(Path("LOCK")), StatusIs(absl::StatusCode::kFailedPrecondition));
  lock->reset();
  CKPT_EXPECT_OK(env_->LockFile(Path("LOCK")));
}

TEST_P(EnvConformanceTest, WriteFileAtomicallyLeavesNoTemp) {
  CKPT_ASSERT_OK(WriteFileAtomically(env_.get(), Path("LATEST"), "v1"));
  CKPT_ASSERT_OK(WriteFileAtomically(env_.get(), Path("LATEST"), "v2"));
  EXPECT_EQ(*ReadFileToString(env_.get(), Path("LATEST"), 1 << 20), "v2");
  EXPECT_THAT(*env_->GetChildren(root_), UnorderedElementsAre("LATEST"));
}

// The disk-backed Envs read MemAvailable (Linux): some memory, no more than the machine has.
// In-memory Envs do not know (nullopt), and a wrapper says what its target says.
TEST_P(EnvConformanceTest, AvailableMemoryIsTheKernelsEstimateOnDisk) {
  const std::optional<uint64_t> available = env_->AvailableMemoryBytes();
  if (!GetParam().on_disk) {
    EXPECT_EQ(available, std::nullopt);
    return;
  }
  ASSERT_TRUE(available.has_value());
  EXPECT_GT(*available, uint64_t{0});
  const uint64_t physical =
      static_cast<uint64_t>(sysconf(_SC_PHYS_PAGES)) * static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  EXPECT_LE(*available, physical);
}

TEST_P(EnvConformanceTest, UseAfterCloseFails) {
  auto file = env_->NewWritableFile(Path("c"), FileOptions{});
  CKPT_ASSERT_OK(file);
  CKPT_ASSERT_OK((*file)->Close());
  EXPECT_THAT((*file)->Append(AsBytes("x")), StatusIs(absl::StatusCode::kFailedPrecondition));
}

std::unique_ptr<Env> FaultOverMemEnv() {
  struct Owning : testing::FaultInjectionEnv {
    explicit Owning(std::unique_ptr<Env> target)
        : FaultInjectionEnv(target.get()), mem(std::move(target)) {}
    std::unique_ptr<Env> mem;
  };
  return std::make_unique<Owning>(NewMemEnv());
}

INSTANTIATE_TEST_SUITE_P(
    AllEnvs, EnvConformanceTest,
    ::testing::Values(
        EnvFactory{"Posix", true,
                   [] { return absl::StatusOr<std::unique_ptr<Env>>(NewPosixEnv()); }},
        EnvFactory{"Uring", true, [] { return NewUringEnv(); }},
        EnvFactory{"Mem", false, [] { return absl::StatusOr<std::unique_ptr<Env>>(NewMemEnv()); }},
        EnvFactory{"FaultInjection", false,
                   [] { return absl::StatusOr<std::unique_ptr<Env>>(FaultOverMemEnv()); }}),
    [](const ::testing::TestParamInfo<EnvFactory>& p) { return p.param.name; });

}  // namespace
}  // namespace ckpt
