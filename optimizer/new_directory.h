// Output directories of the offline commands (ExportHf, Reshard into a new root): built under a
// hidden sibling name and renamed into place when complete, so that a reader sees the whole
// result or nothing, a failure or a crash leaves the target as it was (a crash: plus an inert
// hidden sibling), and two runs cannot mix their files.
#ifndef CKPT_OPTIMIZER_NEW_DIRECTORY_H_
#define CKPT_OPTIMIZER_NEW_DIRECTORY_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "ckpt/env.h"

namespace ckpt::optimizer::internal {

class NewDirectory {
 public:
  // Plans `target` as a new directory built at "<parent>/.<name>.<what>-<nonce>" (not created
  // here). kFailedPrecondition naming it when `target` exists and is not an empty directory;
  // errors of the parent as they come.
  static absl::StatusOr<NewDirectory> Plan(Env* env, const std::string& target,
                                           absl::string_view what);
  const std::string& staging() const { return staging_; }
  const std::string& target() const { return target_; }
  // Renames the staging directory onto the target (an empty directory there is replaced) and
  // syncs the parent; when that sync fails, renames it back (a rename not known durable is not
  // published). kFailedPrecondition when the target was filled meanwhile. On failure the
  // staging directory is left for Discard.
  absl::Status Publish(Env* env);
  // Removes the staging directory (best effort; a crash leaves it, inert).
  void Discard(Env* env);

 private:
  std::string target_, staging_;
};

// A random 64-bit nonce for hidden names (undo spills, staging directories). One generator
// behind a mutex: safe from any thread (and visible as such to ThreadSanitizer, which does not
// see inside Debian's uninstrumented Abseil seeding a generator per call).
uint64_t RandomNonce();

// kInvalidArgument when `path` (which need not exist yet) is `root` or lies below it: the
// offline commands never write into the store they read.
absl::Status CheckOutside(Env* env, const std::string& root, const std::string& path,
                          absl::string_view what);

}  // namespace ckpt::optimizer::internal

#endif  // CKPT_OPTIMIZER_NEW_DIRECTORY_H_
