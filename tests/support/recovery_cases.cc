#include "tests/support/recovery_cases.h"

#include <sys/stat.h>

#include <filesystem>
#include <fstream>

#include "ckpt/base/status_macros.h"
#include "ckpt/checkpoint_store.h"
#include "ckpt/formats/chunk.h"
#include "tests/support/synthetic_state.h"

namespace ckpt::testing {
namespace {

namespace fs = std::filesystem;
using Kind = RecoveryAction::Kind;

constexpr char kStaging[] = ".staging-step-00000004-0123456789abcdef";
constexpr char kDeleting[] = ".deleting-step-00000001-0123456789abcdef";
constexpr char kUndo[] = ".undo-rank-00000-0123456789abcdef";

void Spit(const std::string& path, const std::string& bytes) {
  fs::remove(path);
  std::ofstream(path, std::ios::binary) << bytes;
}

StoreOptions Options() {
  static Env* posix = NewPosixEnv().release();  // Outlives every test; never deleted.
  StoreOptions options;
  options.env = posix;
  options.chunk_bytes = 1000;
  return options;
}

// Steps 4 (and 5) saved, then LATEST put back to 3: a commit whose LATEST update was lost, or
// a LATEST restored from an older copy.
void SaveUnpublished(const std::string& root, uint64_t last) {
  for (uint64_t step = 4; step <= last; ++step) {
    SaveSyntheticStep(root, Options(), 2, step).IgnoreError();  // Checked by the verdicts.
  }
  Spit(root + "/LATEST", formats::EncodeLatest(3));
}

// A staging directory as a crash leaves one: rank 0's data file whole, rank 1's part torn
// inside its header, a MANIFEST cut after 4 bytes, an empty data file just created.
void PlantOwnStaging(const std::string& root) {
  const std::string dir = root + "/" + kStaging;
  fs::create_directory(dir);
  fs::copy_file(root + "/step-00000003/rank-00000.data", dir + "/rank-00000.data");
  Spit(dir + "/rank-00001.part", "CKPTPA");
  Spit(dir + "/MANIFEST", "CKPT");
  Spit(dir + "/rank-00002.data", "");
}

std::vector<RecoveryCase> MakeCases() {
  std::vector<RecoveryCase> cases;
  cases.push_back({"CleanStore", [](const std::string&, const std::string&) {},
                   absl::StatusCode::kOk, {}, 3});
  cases.push_back({"OwnStagingDirectory",
                   [](const std::string& root, const std::string&) { PlantOwnStaging(root); },
                   absl::StatusCode::kOk,
                   {{kStaging, Kind::kRemove}}});
  cases.push_back({"OwnDeletingDirectory",
                   [](const std::string& root, const std::string&) {
                     fs::copy(root + "/step-00000001", root + "/" + kDeleting,
                              fs::copy_options::recursive);
                   },
                   absl::StatusCode::kOk,
                   {{kDeleting, Kind::kRemove}}});
  cases.push_back({"OwnUndoSpill",
                   [](const std::string& root, const std::string&) {
                     SaveSyntheticStep(root + "/" + kUndo, Options(), 1, 1).IgnoreError();
                   },
                   absl::StatusCode::kOk,
                   {{kUndo, Kind::kRemove}}});
  cases.push_back({"OwnLatestTmp",
                   [](const std::string& root, const std::string&) {
                     Spit(root + "/LATEST.tmp", formats::EncodeLatest(4).substr(0, 11));
                   },
                   absl::StatusCode::kOk,
                   {{"LATEST.tmp", Kind::kRemove}}});
  cases.push_back({"UserFileInStaging",
                   [](const std::string& root, const std::string&) {
                     PlantOwnStaging(root);
                     Spit(root + "/" + kStaging + "/notes.txt", "my notes");
                   },
                   absl::StatusCode::kOk,
                   {{kStaging, Kind::kQuarantine}}});
  cases.push_back({"ForeignHeaderInStaging",
                   [](const std::string& root, const std::string&) {
                     PlantOwnStaging(root);
                     Spit(root + "/" + kStaging + "/MANIFEST", "{\"mine\": true}");
                   },
                   absl::StatusCode::kOk,
                   {{kStaging, Kind::kQuarantine}}});
  cases.push_back({"SymlinkInDeletingDirectory",
                   [](const std::string& root, const std::string& scratch) {
                     fs::copy(root + "/step-00000001", root + "/" + kDeleting,
                              fs::copy_options::recursive);
                     Spit(scratch + "/precious", "precious");
                     fs::create_symlink(scratch + "/precious",
                                        root + "/" + kDeleting + "/rank-00009.data");
                   },
                   absl::StatusCode::kOk,
                   {{kDeleting, Kind::kQuarantine}}});
  cases.push_back({"UserDirectoryInUndoSpill",
                   [](const std::string& root, const std::string&) {
                     SaveSyntheticStep(root + "/" + kUndo, Options(), 1, 1).IgnoreError();
                     fs::create_directory(root + "/" + kUndo + "/my-results");
                   },
                   absl::StatusCode::kOk,
                   {{kUndo, Kind::kQuarantine}}});
  cases.push_back({"FileUnderADirectoryName",
                   [](const std::string& root, const std::string&) {
                     Spit(root + "/" + kDeleting, "a file, not ours");
                   },
                   absl::StatusCode::kOk,
                   {{kDeleting, Kind::kKeep}}});
  cases.push_back({"SymlinkUnderADirectoryName",
                   [](const std::string& root, const std::string& scratch) {
                     fs::create_directory_symlink(scratch, root + "/" + kUndo);
                   },
                   absl::StatusCode::kOk,
                   {{kUndo, Kind::kKeep}}});
  cases.push_back({"ForeignLatestTmp",
                   [](const std::string& root, const std::string&) {
                     Spit(root + "/LATEST.tmp", "a user's text");
                   },
                   absl::StatusCode::kOk,
                   {{"LATEST.tmp", Kind::kKeep}}});
  cases.push_back({"UnpublishedIntactSteps",
                   [](const std::string& root, const std::string&) { SaveUnpublished(root, 5); },
                   absl::StatusCode::kOk,
                   {{"step-00000004", Kind::kKeep}, {"step-00000005", Kind::kKeep}}});
  cases.push_back({"UnpublishedDamagedStep",
                   [](const std::string& root, const std::string&) {
                     SaveUnpublished(root, 4);
                     fs::resize_file(root + "/step-00000004/rank-00001.data", 4096 + 100);
                   },
                   absl::StatusCode::kOk,
                   {{"step-00000004", Kind::kQuarantine}}});
  cases.push_back({"UnpublishedStepOfANewerFormat",
                   [](const std::string& root, const std::string&) {
                     SaveUnpublished(root, 4);
                     RewriteManifestVersion(root + "/step-00000004/MANIFEST", 2).IgnoreError();
                   },
                   absl::StatusCode::kOk,
                   {{"step-00000004", Kind::kKeep}}});
  cases.push_back({"FileUnderAStepName",
                   [](const std::string& root, const std::string&) {
                     Spit(root + "/step-00000009", "not ours");
                   },
                   absl::StatusCode::kOk,
                   {{"step-00000009", Kind::kQuarantine}}});
  cases.push_back({"SymlinkUnderAStepName",
                   [](const std::string& root, const std::string& scratch) {
                     fs::copy(root + "/step-00000003", scratch + "/elsewhere",
                              fs::copy_options::recursive);
                     fs::create_directory_symlink(scratch + "/elsewhere", root + "/step-00000009");
                   },
                   absl::StatusCode::kOk,
                   {{"step-00000009", Kind::kQuarantine}}});
  cases.push_back({"DamagedLatest",
                   [](const std::string& root, const std::string&) {
                     Spit(root + "/LATEST", "garbage");
                   },
                   absl::StatusCode::kOk,
                   {{"LATEST", Kind::kSetLatest}}});
  cases.push_back({"MissingLatest",
                   [](const std::string& root, const std::string&) {
                     fs::remove(root + "/LATEST");
                   },
                   absl::StatusCode::kOk,
                   {{"LATEST", Kind::kSetLatest}}});
  cases.push_back({"LatestNamesADamagedStep",
                   [](const std::string& root, const std::string&) {
                     fs::resize_file(root + "/step-00000003/rank-00001.data", 4096 + 100);
                   },
                   absl::StatusCode::kOk,
                   {{"step-00000003", Kind::kQuarantine}, {"LATEST", Kind::kSetLatest}},
                   2});
  cases.push_back({"LatestNamesADamagedStepBelowIntactUnpublishedOnes",
                   [](const std::string& root, const std::string&) {
                     SaveUnpublished(root, 5);
                     fs::resize_file(root + "/step-00000003/rank-00001.data", 4096 + 100);
                   },
                   absl::StatusCode::kOk,
                   {{"step-00000004", Kind::kKeep},
                    {"step-00000005", Kind::kKeep},
                    {"step-00000003", Kind::kQuarantine},
                    {"LATEST", Kind::kSetLatest}},
                   2});
  cases.push_back({"LatestIsAFifo",
                   [](const std::string& root, const std::string&) {
                     fs::remove(root + "/LATEST");
                     ::mkfifo((root + "/LATEST").c_str(), 0644);
                   },
                   absl::StatusCode::kFailedPrecondition,
                   {},
                   std::nullopt});
  cases.push_back({"LatestNamesAStepOfANewerFormat",
                   [](const std::string& root, const std::string&) {
                     RewriteManifestVersion(root + "/step-00000003/MANIFEST", 2).IgnoreError();
                   },
                   absl::StatusCode::kFailedPrecondition,
                   {},
                   std::nullopt});
  cases.push_back({"NoIntactStep",
                   [](const std::string& root, const std::string&) {
                     for (const char* step : {"1", "2", "3"}) {
                       fs::resize_file(root + "/step-0000000" + step + "/rank-00001.data",
                                       4096 + 100);
                     }
                   },
                   absl::StatusCode::kDataLoss,
                   {},
                   std::nullopt});
  return cases;
}

}  // namespace

const std::vector<RecoveryCase>& RecoveryCases() {
  static const std::vector<RecoveryCase>* cases = new std::vector<RecoveryCase>(MakeCases());
  return *cases;
}

absl::Status PlantThreeSteps(const std::string& root) {
  for (uint64_t step : {1, 2, 3}) CKPT_RETURN_IF_ERROR(SaveSyntheticStep(root, Options(), 2, step));
  return absl::OkStatus();
}

}  // namespace ckpt::testing
