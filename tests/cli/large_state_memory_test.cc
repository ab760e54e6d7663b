// The operator commands stay in bounded memory whatever the size: export-hf and reshard of a
// 4 GiB optimizer checkpoint (307M parameters, 14 bytes each) each peak under 256 MiB of
// resident memory, measured as the child process's ru_maxrss, and their outputs are right
// (verify passes; diff finds the reshard equal to the source; sampled elements of the export
// equal the source's weights). Label slow: it writes about 9 GB.
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_split.h"
#include "ckpt/bench/reshard_bench.h"
#include "ckpt/checkpoint_store.h"
#include "ckpt/hf_checkpoint.h"
#include "tests/support/status_matchers.h"
#include "tests/support/temp_dir.h"

namespace ckpt {
namespace {

constexpr uint64_t kParams = 307'000'000;  // 4.0 GiB of state.
constexpr uint64_t kLimitBytes = uint64_t{256} << 20;

struct Child {
  int exit_code = -1;
  uint64_t peak_rss_bytes = 0;
};

// Runs ckpt-tool with `args` (split on spaces), its output to this test's; waits for it and
// takes its peak resident set from wait4.
Child RunTool(const std::string& args) {
  std::vector<std::string> parts = absl::StrSplit(args, ' ', absl::SkipEmpty());
  parts.insert(parts.begin(), CKPT_TOOL_PATH);
  std::vector<char*> argv;
  for (std::string& p : parts) argv.push_back(p.data());
  argv.push_back(nullptr);
  std::fflush(stdout);
  const pid_t pid = fork();
  if (pid == 0) {
    execv(argv[0], argv.data());
    _exit(127);
  }
  Child out;
  int status = 0;
  rusage usage{};
  if (pid > 0 && wait4(pid, &status, 0, &usage) == pid) {
    out.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    out.peak_rss_bytes = static_cast<uint64_t>(usage.ru_maxrss) * 1024;
  }
  return out;
}

TEST(LargeStateMemoryTest, ExportHfAndReshardOf4GiBStayUnder256MiB) {
  testing::ScopedTempDir tmp;
  const std::string src = tmp.path() + "/src";
  ASSERT_THAT(bench::WriteSyntheticOptimizerStep(Env::Default(), src, kParams, 2, 1),
              testing::IsOk());

  const Child exported = RunTool("export-hf " + src + " " + tmp.path() + "/hf --json");
  ASSERT_EQ(exported.exit_code, 0);
  std::printf("export-hf of 4.0 GiB of state: peak RSS %.1f MiB (limit 256 MiB)\n",
              static_cast<double>(exported.peak_rss_bytes) / (1 << 20));
  EXPECT_LT(exported.peak_rss_bytes, kLimitBytes);
  EXPECT_EQ(RunTool("verify " + tmp.path() + "/hf").exit_code, 0);
  {
    StoreOptions so;
    so.read_only = true;
    auto store = CheckpointStore::Open(src, so);
    ASSERT_THAT(store, testing::IsOk());
    auto step = (*store)->OpenStep(1);
    ASSERT_THAT(step, testing::IsOk());
    auto hf = HfCheckpointReader::Open(tmp.path() + "/hf");
    ASSERT_THAT(hf, testing::IsOk());
    EXPECT_EQ((*hf)->tensors().size(), (kParams + (1 << 24) - 1) >> 24);
    for (const HfTensor& t : (*hf)->tensors()) {
      for (uint64_t at : {uint64_t{0}, t.numel / 2, t.numel - 1000}) {
        std::vector<std::byte> a(2000), b(2000);
        ASSERT_THAT((*hf)->ReadBytes(t.name, at, 1000, a), testing::IsOk());
        ASSERT_THAT((*step)->ReadRange(t.name, at, 1000, b), testing::IsOk());
        ASSERT_EQ(a, b) << t.name << " at " << at;
      }
    }
  }
  std::filesystem::remove_all(tmp.path() + "/hf");

  const Child resharded = RunTool("reshard " + src + " " + tmp.path() + "/dst --dp 3 --json");
  ASSERT_EQ(resharded.exit_code, 0);
  std::printf("reshard of 4.0 GiB of state from 2 to 3 ranks: peak RSS %.1f MiB (limit 256 MiB)\n",
              static_cast<double>(resharded.peak_rss_bytes) / (1 << 20));
  EXPECT_LT(resharded.peak_rss_bytes, kLimitBytes);
  EXPECT_EQ(RunTool("diff " + src + " " + tmp.path() + "/dst").exit_code, 0);
}

}  // namespace
}  // namespace ckpt
