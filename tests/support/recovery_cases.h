// The recovery table (docs/design/recovery.md) as data: every case of what a root can hold,
// with what recovery must do to each entry. libckpt/recovery_test.cc runs each through
// PlanRecovery and Open; tests/cli/recovery_cli_test.cc through `ckpt-tool gc --dry-run` and
// `gc`; a test checks that the table in the doc names exactly these cases.
#ifndef CKPT_TESTS_SUPPORT_RECOVERY_CASES_H_
#define CKPT_TESTS_SUPPORT_RECOVERY_CASES_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "ckpt/recovery.h"

namespace ckpt::testing {

struct RecoveryCase {
  const char* name;
  // Plants the case in `root`, which holds steps 1-3 saved by two ranks (LATEST = 3) on the
  // real file system; `scratch` is an empty directory outside the root.
  std::function<void(const std::string& root, const std::string& scratch)> plant;
  // What Open (and the dry run) return.
  absl::StatusCode code = absl::StatusCode::kOk;
  // Each entry named, and what recovery does to it; entries not named must not be touched.
  std::vector<std::pair<std::string, RecoveryAction::Kind>> verdicts;
  // The step LATEST names after recovery.
  std::optional<uint64_t> latest_after = 3;
};

// Every case of the table, in the doc's order.
const std::vector<RecoveryCase>& RecoveryCases();

// Saves steps 1-3 into `root` (two ranks, small chunks) through a PosixEnv.
absl::Status PlantThreeSteps(const std::string& root);

}  // namespace ckpt::testing

#endif  // CKPT_TESTS_SUPPORT_RECOVERY_CASES_H_
