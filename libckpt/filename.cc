#include "libckpt/filename.h"

#include "absl/random/random.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include <mutex>

namespace ckpt::internal {

std::string StepDirName(uint64_t step) { return absl::StrFormat("step-%08d", step); }

std::optional<uint64_t> ParseStepDirName(absl::string_view name) {
  if (!absl::ConsumePrefix(&name, "step-") || name.size() < 8) return std::nullopt;
  for (char c : name) {
    if (c < '0' || c > '9') return std::nullopt;
  }
  uint64_t step = 0;
  if (!absl::SimpleAtoi(name, &step)) return std::nullopt;
  if (StepDirName(step) != absl::StrCat("step-", name)) return std::nullopt;  // Canonical only.
  return step;
}

std::string DataFileName(uint32_t rank) { return absl::StrFormat("rank-%05d.data", rank); }
std::string PartFileName(uint32_t rank) { return absl::StrFormat("rank-%05d.part", rank); }

std::string StagingDirName(uint64_t step, absl::string_view nonce) {
  return absl::StrCat(kStagingPrefix, StepDirName(step), "-", nonce);
}

std::string DeletingDirName(uint64_t step, absl::string_view nonce) {
  return absl::StrCat(kDeletingPrefix, StepDirName(step), "-", nonce);
}

std::string UndoDirName(uint32_t rank, absl::string_view nonce) {
  return absl::StrCat(kUndoPrefix, absl::StrFormat("rank-%05d-", rank), nonce);
}

namespace {

bool IsRankFileName(absl::string_view name, absl::string_view suffix) {
  if (!absl::ConsumePrefix(&name, "rank-") || !absl::ConsumeSuffix(&name, suffix)) return false;
  if (name.size() < 5) return false;
  for (char c : name) {
    if (c < '0' || c > '9') return false;
  }
  return true;
}

}  // namespace

bool IsDataFileName(absl::string_view name) { return IsRankFileName(name, ".data"); }
bool IsPartFileName(absl::string_view name) { return IsRankFileName(name, ".part"); }

bool IsGarbageName(absl::string_view name) {
  return absl::StartsWith(name, kStagingPrefix) || absl::StartsWith(name, kDeletingPrefix) ||
         absl::StartsWith(name, kUndoPrefix) || name == absl::StrCat(kLatestName, ".tmp");
}

std::string NewNonce() {
  static std::mutex* mu = new std::mutex;
  static absl::BitGen* gen = new absl::BitGen;
  std::lock_guard<std::mutex> lock(*mu);
  return absl::StrFormat("%016x", absl::Uniform<uint64_t>(*gen));
}

}  // namespace ckpt::internal
