#include "optimizer/new_directory.h"

#include <mutex>

#include "absl/random/random.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "ckpt/base/status_macros.h"

namespace ckpt::optimizer::internal {
namespace {

std::string Basename(const std::string& path) {
  std::string p = path;
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  const size_t slash = p.rfind('/');
  return slash == std::string::npos ? p : p.substr(slash + 1);
}

// `path` resolved as far as it exists: its real path, or its parent's plus its name.
absl::StatusOr<std::string> Resolve(Env* env, const std::string& path) {
  absl::StatusOr<std::string> real = env->RealPath(path);
  if (real.ok()) return real;
  CKPT_ASSIGN_OR_RETURN(std::string parent, env->RealPath(Dirname(path)));
  return JoinPath(parent, Basename(path));
}

}  // namespace

uint64_t RandomNonce() {
  static std::mutex* mu = new std::mutex;
  static absl::BitGen* gen = new absl::BitGen;
  std::lock_guard<std::mutex> lock(*mu);
  return absl::Uniform<uint64_t>(*gen);
}

absl::StatusOr<NewDirectory> NewDirectory::Plan(Env* env, const std::string& target,
                                                absl::string_view what) {
  absl::StatusOr<bool> is_dir = env->IsDirectory(target);
  if (is_dir.ok()) {
    absl::StatusOr<std::vector<std::string>> children =
        *is_dir ? env->GetChildren(target) : absl::StatusOr<std::vector<std::string>>();
    if (!*is_dir || !children.ok() || !children->empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          target, " exists and is not an empty directory: ", what,
          " writes a new one (remove it, or name another)"));
    }
  } else if (!absl::IsNotFound(is_dir.status())) {
    return is_dir.status();
  }
  const std::string name = Basename(target);
  if (name.empty() || name == "." || name == ".." || name == "/") {
    return absl::InvalidArgumentError(absl::StrCat(target, ": name a new directory"));
  }
  NewDirectory d;
  d.target_ = target;
  d.staging_ = JoinPath(Dirname(target), absl::StrFormat(".%s.%s-%016x", name, what,
                                                          RandomNonce()));
  return d;
}

absl::Status NewDirectory::Publish(Env* env) {
  absl::Status renamed = env->RenameFile(staging_, target_);
  if (!renamed.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "publish ", target_, " (was it filled meanwhile, by another run?): ", renamed.message()));
  }
  absl::Status synced = env->SyncDir(Dirname(target_));
  if (!synced.ok()) {
    // The rename may or may not survive a crash: take it back, so that the caller's error
    // means nothing is there. If even that fails, the whole result stays at the target.
    env->RenameFile(target_, staging_).IgnoreError();  // The error below is the one reported.
  }
  return synced;
}

void NewDirectory::Discard(Env* env) {
  if (env->IsDirectory(staging_).ok()) {
    RemoveRecursively(env, staging_).IgnoreError();  // Best effort: inert, hidden garbage.
  }
}

absl::Status CheckOutside(Env* env, const std::string& root, const std::string& path,
                          absl::string_view what) {
  CKPT_ASSIGN_OR_RETURN(std::string r, env->RealPath(root));
  absl::StatusOr<std::string> p = Resolve(env, path);
  if (!p.ok()) return absl::OkStatus();  // Its parent does not exist: it cannot be in root.
  if (*p == r || absl::StartsWith(*p, r == "/" ? r : r + "/")) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " into ", path, ", which is inside the store it reads (", root, "): pick another"));
  }
  return absl::OkStatus();
}

}  // namespace ckpt::optimizer::internal
