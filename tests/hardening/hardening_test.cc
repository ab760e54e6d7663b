// The hardening suite (issue #14): ckpt-tool run as an attacker or an unlucky operator would,
// on a fresh store per case. Each case plants something (a FIFO, a sparse 1 TiB file, a
// symbolic link, a newer format version, a bad option value), runs one command under a time
// limit, and asserts that it ends (never hangs: exit 124 is a failure), exits with the code
// docs/cli.md gives and a message naming the cause, and that every committed step's files are
// still there byte for byte (in place, or moved whole into quarantine/ where recovery proved a
// step damaged).
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "ckpt/base/status_macros.h"
#include "ckpt/checkpoint_store.h"
#include "ckpt/hf_checkpoint.h"
#include "tests/support/run_command.h"
#include "tests/support/status_matchers.h"
#include "tests/support/synthetic_state.h"
#include "tests/support/temp_dir.h"
#include "tests/support/tree_snapshot.h"

namespace ckpt {
namespace {

namespace fs = std::filesystem;
using testing::TreeSnapshot;

// What must hold of the committed steps after the command.
enum class Keep {
  kAll,            // The tree is exactly as before the command (LOCK aside).
  kStepsSomewhere  // Every file of steps 1-3 is in place or under quarantine/, same bytes.
};

struct Case {
  const char* name;
  // Plants the problem. `root` holds steps 1-3 (LATEST = 3); `dir` is a scratch directory.
  std::function<void(const std::string& root, const std::string& dir)> plant;
  const char* args;  // {root} and {dir} are replaced.
  int exit_code;
  const char* says;  // A substring of the output.
  Keep keep = Keep::kAll;
  const char* check = nullptr;  // A shell command that must succeed afterwards ({dir} replaced).
};

void Spit(const std::string& path, const std::string& bytes) {
  fs::remove(path);
  std::ofstream(path, std::ios::binary) << bytes;
}

void Fifo(const std::string& path) {
  fs::remove(path);
  ASSERT_EQ(::mkfifo(path.c_str(), 0644), 0) << path;
}

void Sparse(const std::string& path, uint64_t bytes) {
  Spit(path, "");
  fs::resize_file(path, bytes);
}

// A small valid HF model directory `dir`, with one tensor called `tensor`.
void HfModel(const std::string& dir, const std::string& tensor = "model.embed.weight") {
  static const float kValues[4] = {1, 2, 3, 4};
  CKPT_ASSERT_OK(WriteHfCheckpoint(
      dir, {{tensor, formats::StDType::kF32, {4}, std::as_bytes(std::span(kValues))}}));
}

// A safetensors header declaring one U8 tensor of `bytes` bytes, in a sparse file that long.
void HugeTensorFile(const std::string& path, uint64_t bytes) {
  std::string header = absl::StrCat(R"({"t":{"dtype":"U8","shape":[)", bytes,
                                    R"(],"data_offsets":[0,)", bytes, "]}}");
  header.append((8 - header.size() % 8) % 8, ' ');
  std::string prefix(8, '\0');
  for (int i = 0; i < 8; ++i) prefix[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  Spit(path, prefix + header);
  fs::resize_file(path, 8 + header.size() + bytes);
}

// The tool under test; CKPT_TOOL overrides it (e.g. to show that a case fails on an older
// build).
std::string Tool() {
  const char* override_path = std::getenv("CKPT_TOOL");
  return override_path != nullptr ? override_path : CKPT_TOOL_PATH;
}

std::string Step(const std::string& root, int step) {
  return root + "/step-0000000" + std::to_string(step);
}

class HardeningTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    root_ = tmp_.path() + "/store";
    dir_ = tmp_.path() + "/scratch";
    fs::create_directory(dir_);
    StoreOptions options;
    options.chunk_bytes = 1000;
    for (uint64_t step : {1, 2, 3})
      CKPT_ASSERT_OK(testing::SaveSyntheticStep(root_, options, 2, step));
  }

  testing::ScopedTempDir tmp_;
  std::string root_, dir_;
};

// Every file of steps 1-3 in `before` is in `after` at its place or under one
// quarantine/<step>-<nonce>/, byte for byte.
std::string LostStepFile(const TreeSnapshot& before, const TreeSnapshot& after) {
  for (const auto& [path, what] : before) {
    if (!absl::StartsWith(path, "step-") || path.find('/') == std::string::npos) continue;
    auto here = after.find(path);
    if (here != after.end() && here->second == what) continue;
    const std::string step = path.substr(0, path.find('/'));
    bool found = false;
    for (const auto& [p, w] : after) {
      found = found || (absl::StartsWith(p, "quarantine/" + step + "-") &&
                        absl::EndsWith(p, path.substr(step.size())) && w == what);
    }
    if (!found) return path;
  }
  return "";
}

TEST_P(HardeningTest, EndsInTimeWithAClearErrorAndKeepsEveryCommittedStep) {
  const Case& c = GetParam();
  c.plant(root_, dir_);
  const TreeSnapshot planted = testing::SnapshotTree(root_);
  const std::string args = absl::StrReplaceAll(c.args, {{"{root}", root_}, {"{dir}", dir_}});
  // `timeout` ends a hang with 124 (and -k kills what ignores SIGTERM): a failure, not a wait.
  testing::CommandResult r =
      testing::RunCommand(absl::StrCat("timeout -k 5 60 ", Tool(), " ", args));
  EXPECT_NE(r.exit_code, 124) << "hung: " << args;
  EXPECT_EQ(r.exit_code, c.exit_code) << args << "\n" << r.output;
  EXPECT_THAT(r.output, ::testing::HasSubstr(c.says)) << args;
  EXPECT_THAT(r.output, ::testing::Not(::testing::HasSubstr("terminate called"))) << args;
  const TreeSnapshot after = testing::SnapshotTree(root_);
  if (c.keep == Keep::kAll) {
    EXPECT_EQ(testing::DescribeDifference(planted, after), "") << args;
  } else {
    EXPECT_EQ(LostStepFile(planted, after), "") << args;
  }
  if (c.check != nullptr) {
    const std::string check = absl::StrReplaceAll(c.check, {{"{dir}", dir_}});
    EXPECT_EQ(testing::RunCommand(check).exit_code, 0) << check;
  }
}

const Case kCases[] = {
    // 1. Recovery never deletes a step it cannot read.
    {"NewerManifestVersionIsRefusedNotDeleted",
     [](const std::string& root, const std::string&) {
       CKPT_ASSERT_OK(testing::RewriteManifestVersion(Step(root, 3) + "/MANIFEST", 2));
     },
     "gc {root} --keep-last 10", 2, "manifest format version 2 is not supported"},
    {"SymlinkedStepDirectoryIsRefusedNotDeleted",
     [](const std::string& root, const std::string& dir) {
       fs::rename(Step(root, 3), dir + "/step-3");
       fs::create_directory_symlink(dir + "/step-3", Step(root, 3));
     },
     "gc {root} --keep-last 10", 2, "not a directory"},
    {"SymlinkedDataFileIsRefusedNotDeleted",
     [](const std::string& root, const std::string& dir) {
       fs::rename(Step(root, 3) + "/rank-00000.data", dir + "/data");
       fs::create_symlink(dir + "/data", Step(root, 3) + "/rank-00000.data");
     },
     "gc {root} --keep-last 10", 2, "symbolic link"},
    {"DamagedManifestFieldIsQuarantinedNotDeleted",
     [](const std::string& root, const std::string&) {
       std::ifstream in(Step(root, 3) + "/MANIFEST", std::ios::binary);
       std::string m(std::istreambuf_iterator<char>(in), {});
       m[m.size() / 2] ^= 0x08;
       Spit(Step(root, 3) + "/MANIFEST", m);
     },
     "gc {root} --keep-last 10", 0, "moved an entry into quarantine/step-00000003-",
     Keep::kStepsSomewhere},
    {"DryRunGcChangesNothingEvenWithADamagedLatest",
     [](const std::string& root, const std::string&) {
       fs::create_directory(root + "/.staging-step-00000004-0123456789abcdef");
       Spit(root + "/LATEST", "garbage");
     },
     "gc {root} --keep-last 1 --dry-run", 0, "recovery would: LATEST := step 3"},
    {"DryRunGcOfAHealthyStoreRemovesNoStagingDirectory",
     [](const std::string& root, const std::string&) {
       fs::create_directory(root + "/.staging-step-00000004-0123456789abcdef");
     },
     "gc {root} --keep-last 1 --dry-run", 0, "would delete 2 step(s): 1, 2"},
    // 2. FIFOs never block.
    {"FifoLatestInspect",
     [](const std::string& root, const std::string&) { Fifo(root + "/LATEST"); }, "inspect {root}",
     1, "FIFO"},
    {"FifoLatestVerify",
     [](const std::string& root, const std::string&) { Fifo(root + "/LATEST"); },
     "verify {root} --all", 1, "FIFO"},
    {"FifoLatestGc", [](const std::string& root, const std::string&) { Fifo(root + "/LATEST"); },
     "gc {root} --keep-last 10", 2, "FIFO"},
    {"FifoManifestVerify",
     [](const std::string& root, const std::string&) { Fifo(Step(root, 3) + "/MANIFEST"); },
     "verify {root}", 1, "FIFO"},
    {"FifoManifestInspect",
     [](const std::string& root, const std::string&) { Fifo(Step(root, 3) + "/MANIFEST"); },
     "inspect {root}", 1, "FIFO"},
    {"FifoDataFileGc",
     [](const std::string& root, const std::string&) { Fifo(Step(root, 3) + "/rank-00001.data"); },
     "gc {root} --keep-last 10", 2, "FIFO"},
    {"FifoDataFileOfAnOlderStepVerify",
     [](const std::string& root, const std::string&) { Fifo(Step(root, 1) + "/rank-00001.data"); },
     "verify {root} --all", 1, "FIFO"},
    {"FifoHfShardVerify",
     [](const std::string&, const std::string& dir) {
       HfModel(dir + "/model");
       Fifo(dir + "/model/model.safetensors");
     },
     "verify {dir}/model", 2, "FIFO"},
    {"FifoHfShardReshard",
     [](const std::string&, const std::string& dir) {
       HfModel(dir + "/model");
       Fifo(dir + "/model/model.safetensors");
     },
     "hf-reshard {dir}/model {dir}/out", 2, "FIFO"},
    // 3. Huge files are refused before anything is allocated.
    {"SparseTebibyteLatestInspect",
     [](const std::string& root, const std::string&) {
       Sparse(root + "/LATEST", uint64_t{1} << 40);
     },
     "inspect {root}", 1, "1099511627776 bytes"},
    {"SparseTebibyteLatestGcFallsBackToTheNewestStep",
     [](const std::string& root, const std::string&) {
       Sparse(root + "/LATEST", uint64_t{1} << 40);
     },
     "gc {root} --keep-last 10", 0, "LATEST := step 3", Keep::kStepsSomewhere},
    {"SparseTebibyteManifestVerify",
     [](const std::string& root, const std::string&) {
       Sparse(Step(root, 3) + "/MANIFEST", uint64_t{1} << 40);
     },
     "verify {root}", 1, "1099511627776 bytes"},
    {"SparseTebibyteHfIndexVerify",
     [](const std::string&, const std::string& dir) {
       HfModel(dir + "/model");
       Sparse(dir + "/model/model.safetensors.index.json", uint64_t{1} << 40);
     },
     "verify {dir}/model", 1, "1099511627776 bytes"},
    {"HfReshardOfATebibyteTensorSaysMemory",
     [](const std::string&, const std::string& dir) {
       HugeTensorFile(dir + "/huge.safetensors", uint64_t{1} << 40);
     },
     "hf-reshard {dir}/huge.safetensors {dir}/out", 2, "of memory"},
    {"BenchAdamwNegativeParams", [](const std::string&, const std::string&) {},
     "bench adamw --params -1", 2, "--params: must be a whole number from 1 to"},
    {"BenchAdamwAbsurdParams", [](const std::string&, const std::string&) {},
     "bench adamw --params 1000000000000000", 2, "of memory"},
    // 4. No write through a link we did not make.
    {"PlantedTmpSymlinkInHfReshardDestination",
     [](const std::string&, const std::string& dir) {
       HfModel(dir + "/model");
       fs::create_directory(dir + "/out");
       Spit(dir + "/victim", "precious");
       fs::create_symlink(dir + "/victim", dir + "/out/.model.safetensors.tmp");
     },
     "hf-reshard {dir}/model {dir}/out", 2, "did not make", Keep::kAll,
     "grep -qx precious {dir}/victim"},
    {"DanglingLockSymlink",
     [](const std::string& root, const std::string& dir) {
       fs::remove(root + "/LOCK");
       fs::create_symlink(dir + "/created-by-ckpt", root + "/LOCK");
     },
     "gc {root} --keep-last 10", 2, "symbolic link", Keep::kAll, "test ! -e {dir}/created-by-ckpt"},
    // 6 (user paths). Directories given as links work, the same in every command.
    {"RootGivenAsSymlinkInspect",
     [](const std::string& root, const std::string& dir) {
       fs::create_directory_symlink(root, dir + "/link");
     },
     "inspect {dir}/link", 0, "<- LATEST"},
    {"RootGivenAsSymlinkVerify",
     [](const std::string& root, const std::string& dir) {
       fs::create_directory_symlink(root, dir + "/link");
     },
     "verify {dir}/link --all", 0, "step 3: OK"},
    {"RootGivenAsSymlinkGc",
     [](const std::string& root, const std::string& dir) {
       fs::create_directory_symlink(root, dir + "/link");
     },
     "gc {dir}/link --keep-last 10", 0, "deleted 0 step(s)"},
    {"HfModelDirectoryGivenAsSymlink",
     [](const std::string&, const std::string& dir) {
       HfModel(dir + "/model");
       fs::create_directory_symlink(dir + "/model", dir + "/link");
     },
     "verify {dir}/link", 0, "valid (1 tensors"},
    {"HfReshardDestinationGivenAsSymlink",
     [](const std::string&, const std::string& dir) {
       HfModel(dir + "/model");
       fs::create_directory(dir + "/real-out");
       fs::create_directory_symlink(dir + "/real-out", dir + "/out");
     },
     "hf-reshard {dir}/model {dir}/out", 0, "wrote 1 tensors", Keep::kAll,
     "test -f {dir}/real-out/model.safetensors"},
    // 5. CLI values are checked.
    {"NegativeKeepEvery", [](const std::string&, const std::string&) {},
     "gc {root} --keep-last 1 --keep-every -1", 2,
     "--keep-every: must be a whole number from 0 to 18446744073709551615, got \"-1\""},
    {"KeepLastZeroNamesThePlainRange", [](const std::string&, const std::string&) {},
     "gc {root} --keep-last 0", 2, "from 1 to 18446744073709551615, got \"0\""},
    {"NegativeStep", [](const std::string&, const std::string&) {}, "inspect {root} --step -1", 2,
     "--step: must be a whole number"},
    {"UnknownSubcommandIsNamed", [](const std::string&, const std::string&) {}, "frobnicate", 2,
     "unknown subcommand \"frobnicate\""},
    {"UnknownFlagIsNamed", [](const std::string&, const std::string&) {}, "inspect {root} --frob",
     2, "--frob"},
    {"BenchSafetensorsSizeZeroIsRefused", [](const std::string&, const std::string&) {},
     "bench safetensors --dir {dir} --size 0", 2, "--size 0 is less than"},
    // 6. Reporting.
    {"InspectReportsADamagedLatest",
     [](const std::string& root, const std::string&) { Spit(root + "/LATEST", "garbage"); },
     "inspect {root}", 1, "WARNING"},
    {"InspectReportsADanglingLatest",
     [](const std::string& root, const std::string&) {
       Spit(root + "/LATEST", formats::EncodeLatest(99));
     },
     "inspect {root}", 1, "names step 99, which does not exist"},
    {"VerifyAllGoesOnPastAStepItCannotCheck",
     [](const std::string& root, const std::string&) { Spit(root + "/step-00000009", "x"); },
     "verify {root} --all", 1, "step 3: OK"},
    {"CkptRootHoldingAModelIsVerifiedAsACkptRoot",
     [](const std::string& root, const std::string&) { HfModel(root); }, "verify {root}", 0,
     "holds both a ckpt store and an HF model"},
    {"RegularFileGivenAsARootIsNamed",
     [](const std::string&, const std::string& dir) { Spit(dir + "/notes.txt", "hello"); },
     "inspect {dir}/notes.txt", 2, "neither a .safetensors file nor a directory"},
    {"ControlBytesInTensorNamesAreEscaped",
     [](const std::string&, const std::string& dir) { HfModel(dir + "/model", "evil\x1b[2Jname"); },
     "inspect {dir}/model", 0, "evil\\x1b[2Jname"},
    {"C1AndBidiControlsInTensorNamesAreEscaped",
     [](const std::string&, const std::string& dir) {
       HfModel(dir + "/model", "csi\xc2\x9b" "2J-rlo\xe2\x80\xae" "exe.txt-caf\xc3\xa9");
     },
     "inspect {dir}/model", 0, "csi\\u009b2J-rlo\\u202eexe.txt-caf\xc3\xa9"},
    {"BytesThatAreNotUtf8InPathsAreEscaped",  // Tensor names are UTF-8 by the format.
     [](const std::string&, const std::string&) {}, "inspect {dir}/bad\x9b\xff" "name", 2,
     "bad\\x9b\\xffname"},
};

INSTANTIATE_TEST_SUITE_P(Cases, HardeningTest, ::testing::ValuesIn(kCases),
                         [](const ::testing::TestParamInfo<Case>& p) {
                           return std::string(p.param.name);
                         });

TEST(HardeningVerifyTest, HundredThousandTensorHeaderVerifiesWithinTheLimit) {
  testing::ScopedTempDir tmp;
  std::string header = "{";
  for (int i = 0; i < 100000; ++i) {
    absl::StrAppend(&header, i ? "," : "", "\"t", i, R"(":{"dtype":"U8","shape":[1],)",
                    R"("data_offsets":[)", i, ",", i + 1, "]}");
  }
  header += "}";
  header.append((8 - header.size() % 8) % 8, ' ');
  std::string prefix(8, '\0');
  for (int i = 0; i < 8; ++i) prefix[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  const std::string path = tmp.path() + "/many.safetensors";
  Spit(path, prefix + header + std::string(100000, '\0'));
  // Tests never assert on time; the limit only turns a quadratic parse (33 s here) into a
  // failure instead of a slow pass. The figure (0.3 s) is quoted in docs/cli.md.
  testing::CommandResult r =
      testing::RunCommand(absl::StrCat("timeout 20 ", Tool(), " verify ", path));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, ::testing::HasSubstr("valid (100000 tensors"));
}

// A zstd bomb: one chunk of 33 KB that decompresses to 1 GiB. Every command that reads it in
// batches (diff, export-hf, reshard) used to decode the whole chunk again per batch (diff 166 s,
// export-hf and reshard 43 s each, against verify's 1.3 s); now each decodes it once per
// reader. Tests never assert on time: the limit only turns the quadratic behaviour into a
// failure. The figures are printed for the notes.
TEST(HardeningBombTest, ACompressedChunkIsDecodedOncePerCommand) {
  testing::ScopedTempDir tmp;
  const std::string root = tmp.path() + "/bomb";
  {
    StoreOptions options;
    options.chunk_bytes = uint64_t{1} << 30;
    options.codec = formats::Codec::kZstd;
    options.zstd_level = 1;
    auto store = CheckpointStore::Open(root, options);
    CKPT_ASSERT_OK(store);
    auto txn = (*store)->BeginSave(1);
    CKPT_ASSERT_OK(txn);
    const uint64_t elems = uint64_t{1} << 28;
    CKPT_ASSERT_OK((*txn)->DeclareTensor({"w", formats::DType::kF32, {elems}}));
    std::vector<std::byte> zeros(elems * 4);
    CKPT_ASSERT_OK((*txn)->WritePiece("w", 0, elems, zeros));
    CKPT_ASSERT_OK((*txn)->Commit());
  }
  auto timed = [&](const std::string& args, double* seconds) {
    const auto start = std::chrono::steady_clock::now();
    testing::CommandResult r =
        testing::RunCommand(absl::StrCat("timeout -k 5 300 ", Tool(), " ", args));
    *seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_EQ(r.exit_code, 0) << args << "\n" << r.output;
  };
  double verify = 0, diff = 0, exported = 0, resharded = 0;
  timed("verify " + root, &verify);
  timed("diff " + root + " " + root, &diff);
  timed("export-hf " + root + " " + tmp.path() + "/hf", &exported);
  timed("reshard " + root + " " + tmp.path() + "/dp2 --dp 2", &resharded);
  std::printf("zstd bomb (1 GiB in one chunk): verify %.2f s, diff %.2f s (%.2fx), export-hf "
              "%.2f s (%.2fx), reshard %.2f s (%.2fx)\n",
              verify, diff, diff / verify, exported, exported / verify, resharded,
              resharded / verify);
}

}  // namespace
}  // namespace ckpt
