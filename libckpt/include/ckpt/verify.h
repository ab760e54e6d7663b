// Verification of committed checkpoints: re-reads every byte and checks it against the
// checksums, as `ckpt-tool verify` does.
#ifndef CKPT_VERIFY_H_
#define CKPT_VERIFY_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "ckpt/env.h"

namespace ckpt {

// One damaged or missing thing, named by file, chunk (when it is one) and byte offset.
struct VerifyProblem {
  std::string file;
  std::optional<uint64_t> chunk;
  uint64_t offset = 0;
  std::string message;
};

struct StepVerifyReport {
  uint64_t step = 0;
  std::string dir;
  uint64_t bytes_checked = 0;
  uint64_t chunks_checked = 0;
  std::vector<VerifyProblem> problems;
  // The step directory was gone by the end of its check (retention removed it, or an operator
  // did): what went missing meanwhile is not damage, and problems is empty.
  bool removed = false;
};

struct StoreVerifyReport {
  std::optional<uint64_t> latest;
  std::vector<VerifyProblem> problems;  // About LATEST and the root itself.
  std::vector<StepVerifyReport> steps;
  bool ok() const;
};

// Called with bytes verified so far and the total to verify.
using VerifyProgress = std::function<void(uint64_t done_bytes, uint64_t total_bytes)>;

// Verifies one step directory: MANIFEST, every data file's header, size and chunks (checksum,
// header, decodability), and that no unexpected file is present. Damage is reported in the
// result, never as an error; the error is for a directory that cannot be listed.
absl::StatusOr<StepVerifyReport> VerifyStepDir(Env* env, const std::string& dir,
                                               const VerifyProgress& progress = nullptr);

// Verifies LATEST and the steps chosen: `step` when given, every step when `all`, else the step
// LATEST names. A step whose directory is gone once its check ends (a concurrent gc or a
// commit's retention) is reported `removed`, not damaged. kNotFound when `root` or the chosen
// step does not exist.
absl::StatusOr<StoreVerifyReport> VerifyStore(Env* env, const std::string& root,
                                              std::optional<uint64_t> step, bool all,
                                              const VerifyProgress& progress = nullptr);

}  // namespace ckpt

#endif  // CKPT_VERIFY_H_
