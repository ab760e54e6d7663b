// A small, fully determined checkpoint state per step, saved by R ranks as threads, and the
// checks that a store holds exactly that state. Shared by the store, crash and CLI tests.
#ifndef CKPT_TESTS_SUPPORT_SYNTHETIC_STATE_H_
#define CKPT_TESTS_SUPPORT_SYNTHETIC_STATE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "ckpt/checkpoint_store.h"
#include "ckpt/env.h"

namespace ckpt::testing {

inline constexpr uint64_t kWeightElems = 3000;  // Tensor "w", F32, cut across ranks.
inline constexpr uint64_t kBiasElems = 37;      // Tensor "b", BF16, held by rank 0.

// The values of "w" at `step`.
std::vector<float> WeightsAt(uint64_t step);
// Blob "sched" of `rank` at `step`.
std::string SchedulerBlobAt(uint64_t step, int rank);

// Saves `step` with `ranks` ranks as threads of this process (rank 0 through a primary handle
// on `root`, the others through non-primary handles). Returns rank 0's outcome, and checks
// that every rank saw the same one. `options` supplies env, chunk size and codec.
absl::Status SaveSyntheticStep(const std::string& root, const StoreOptions& options, int ranks,
                               uint64_t step);

// Opens `root` as primary (running recovery) and returns the step LATEST names, after checking
// that the whole state of that step reads back exactly, that every step verifies and that no
// staging directory survived. A non-OK status describes the first mismatch.
absl::StatusOr<std::optional<uint64_t>> CheckStoreConsistent(const std::string& root,
                                                             const StoreOptions& options);

// Rewrites the format version of the MANIFEST at `path` (a file on the real file system) and
// re-seals its checksum, as a writer of that version would have written it.
absl::Status RewriteManifestVersion(const std::string& path, uint32_t version);

}  // namespace ckpt::testing

#endif  // CKPT_TESTS_SUPPORT_SYNTHETIC_STATE_H_
