// WriteHfCheckpoint under the standard crash test: after a crash at any mutating call and the
// loss of everything unsynced, every file under a final name is a complete, valid safetensors
// file (temporary names, Sync before rename, SyncDir after), and a finished write survives.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "ckpt/base/coding.h"
#include "ckpt/formats/safetensors.h"
#include "ckpt/hf_checkpoint.h"
#include "tests/support/fault_injection_env.h"
#include "tests/support/status_matchers.h"

namespace ckpt {
namespace {

using formats::StDType;

std::vector<float> Values(size_t n, float base) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = base + static_cast<float>(i);
  return v;
}

TEST(HfWriteCrashTest, NoTornFileUnderAFinalNameAtAnyCrashPoint) {
  const std::vector<float> a = Values(3000, 1), b = Values(2000, 7), c = Values(1000, 9);
  const std::vector<HfTensorData> tensors = {
      {"a", StDType::kF32, {3000}, std::as_bytes(std::span(a))},
      {"b", StDType::kF32, {2000}, std::as_bytes(std::span(b))},
      {"c", StDType::kF32, {1000}, std::as_bytes(std::span(c))}};
  auto run = [&](std::optional<uint64_t> crash_after, uint64_t* calls) {
    auto mem = NewMemEnv();
    testing::FaultInjectionEnv fault(mem.get());
    CKPT_EXPECT_OK(WriteHfCheckpoint("/model", {tensors[0]}, {.env = &fault}));  // The old export.
    CKPT_EXPECT_OK(fault.DropUnsyncedData());
    const uint64_t before = fault.mutating_calls();
    if (crash_after.has_value()) fault.CrashAfter(*crash_after);
    absl::Status written =
        WriteHfCheckpoint("/model", tensors, {.env = &fault, .max_shard_bytes = 10000});
    *calls = fault.mutating_calls() - before;
    CKPT_EXPECT_OK(fault.DropUnsyncedData());
    auto names = mem->GetChildren("/model");
    CKPT_EXPECT_OK(names);
    for (const std::string& name : *names) {
      if (!absl::EndsWith(name, ".safetensors") || absl::StartsWith(name, ".")) continue;
      auto bytes = ReadFileToString(mem.get(), "/model/" + name, UINT64_MAX);
      CKPT_EXPECT_OK(bytes);
      EXPECT_THAT(formats::ParseSafetensors(AsBytes(*bytes), name), testing::IsOk()) << name;
    }
    if (written.ok()) {
      auto reader = HfCheckpointReader::Open("/model", {.env = mem.get()});
      CKPT_EXPECT_OK(reader);
      if (reader.ok()) {
        EXPECT_EQ((*reader)->tensors().size(), 3u);
      }
    }
    return written;
  };
  uint64_t n = 0;
  CKPT_ASSERT_OK(run(std::nullopt, &n));
  ASSERT_GT(n, 10u);
  for (uint64_t k = 0; k <= n; ++k) {
    SCOPED_TRACE(::testing::Message() << "crash after mutating call " << k << " of " << n);
    uint64_t calls = 0;
    run(k, &calls).IgnoreError();  // The crash makes most of them fail.
  }
}

}  // namespace
}  // namespace ckpt
