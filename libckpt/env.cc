#include "ckpt/env.h"

#include <thread>

#include <mutex>
#include <string>

#include "absl/strings/str_cat.h"
#include "ckpt/base/coding.h"
#include "ckpt/base/status_macros.h"

namespace ckpt {
namespace {

struct DefaultEnvState {
  std::unique_ptr<Env> env;
  std::string fallback_reason;
};

DefaultEnvState& DefaultState() {
  // Probed once; intentionally leaked so the Env outlives every static destructor that uses it.
  static DefaultEnvState* state = [] {
    auto* s = new DefaultEnvState;
    absl::StatusOr<std::unique_ptr<Env>> uring = NewUringEnv();
    if (uring.ok()) {
      s->env = std::move(uring).value();
    } else {
      s->fallback_reason = std::string(uring.status().message());
      s->env = NewPosixEnv();
    }
    return s;
  }();
  return *state;
}

}  // namespace

Env* Env::Default() { return DefaultState().env.get(); }

namespace {

class StdEnvThread : public EnvThread {
 public:
  explicit StdEnvThread(std::function<void()> fn) : thread_(std::move(fn)) {}
  ~StdEnvThread() override { Join(); }
  void Join() override {
    if (thread_.joinable()) thread_.join();
  }

 private:
  std::thread thread_;
};

}  // namespace

std::unique_ptr<EnvThread> Env::StartThread(std::function<void()> fn) {
  return std::make_unique<StdEnvThread>(std::move(fn));
}

std::optional<uint64_t> Env::AvailableMemoryBytes() { return std::nullopt; }

std::string DefaultEnvFallbackReason() { return DefaultState().fallback_reason; }

std::string JoinPath(absl::string_view dir, absl::string_view name) {
  if (dir.empty()) return std::string(name);
  if (dir.back() == '/') return absl::StrCat(dir, name);
  return absl::StrCat(dir, "/", name);
}

std::string Dirname(absl::string_view path) {
  while (path.size() > 1 && path.back() == '/') path.remove_suffix(1);
  size_t slash = path.rfind('/');
  if (slash == absl::string_view::npos) return ".";
  if (slash == 0) return "/";
  return std::string(path.substr(0, slash));
}

absl::StatusOr<std::string> ReadFileToString(Env* env, const std::string& path, uint64_t max_bytes,
                                             const FileOptions& options) {
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<RandomAccessFile> file,
                        env->NewRandomAccessFile(path, options));
  // Checked before the allocation: a sparse 1 TiB file must not become a 1 TiB string.
  if (file->size() > max_bytes) {
    return absl::DataLossError(absl::StrCat(path, ": ", file->size(), " bytes, more than the ",
                                            max_bytes, " such a file may hold"));
  }
  std::string data(file->size(), '\0');
  CKPT_RETURN_IF_ERROR(
      file->Read(0, std::span<std::byte>(reinterpret_cast<std::byte*>(data.data()), data.size())));
  return data;
}

absl::Status WriteFileViaTmp(Env* env, const std::string& tmp, const std::string& path,
                             std::span<const std::span<const std::byte>> parts,
                             const FileOptions& options) {
  return WriteFileViaTmpWith(
      env, tmp, path,
      [&](WritableFile& file) {
        for (std::span<const std::byte> part : parts) CKPT_RETURN_IF_ERROR(file.Append(part));
        return absl::OkStatus();
      },
      options);
}

absl::Status WriteFileViaTmpWith(Env* env, const std::string& tmp, const std::string& path,
                                 const std::function<absl::Status(WritableFile&)>& write,
                                 const FileOptions& options) {
  // A regular file left at `tmp` is ours from a crash and is removed; anything else there (a
  // link, a FIFO, a directory) was planted, and is an error, not a target. The exclusive
  // create below fails rather than write through a name planted after this check.
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> stale =
      env->NewRandomAccessFile(tmp, FileOptions{.follow_symlinks = false});
  if (stale.ok()) {
    stale->reset();
    CKPT_RETURN_IF_ERROR(env->RemoveFile(tmp));
  } else if (!absl::IsNotFound(stale.status())) {
    return absl::FailedPreconditionError(absl::StrCat("write ", path,
                                                      ": refusing to use the temporary name ", tmp,
                                                      ", which ckpt did not "
                                                      "make: ",
                                                      stale.status().message()));
  }
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> file, env->NewWritableFile(tmp, options));
  absl::Status status = write(*file);
  if (status.ok()) status = file->Sync();
  status.Update(file->Close());
  if (status.ok()) status = env->RenameFile(tmp, path);
  // Best effort: a leftover tmp file is inert garbage, removed by the next write of `path`.
  if (!status.ok()) env->RemoveFile(tmp).IgnoreError();
  return status;
}

absl::Status WriteFileAtomically(Env* env, const std::string& path, absl::string_view data) {
  const std::span<const std::byte> parts[] = {AsBytes(data)};
  CKPT_RETURN_IF_ERROR(WriteFileViaTmp(env, absl::StrCat(path, ".tmp"), path, parts));
  return env->SyncDir(Dirname(path));
}

namespace {

absl::Status RemoveBelow(Env* env, const std::string& path, const FileInfo& top) {
  CKPT_ASSIGN_OR_RETURN(FileInfo info, env->Stat(path));
  if (!info.SameMountAs(top)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "remove ", path, ": is on another mount (a mount point), which ckpt never enters"));
  }
  if (info.type != FileInfo::Type::kDirectory) return env->RemoveFile(path);
  CKPT_ASSIGN_OR_RETURN(std::vector<std::string> children, env->GetChildren(path));
  for (const std::string& child : children) {
    CKPT_RETURN_IF_ERROR(RemoveBelow(env, JoinPath(path, child), top));
  }
  return env->RemoveDir(path);
}

}  // namespace

absl::Status RemoveRecursively(Env* env, const std::string& path) {
  // Judged against the parent, so that a mount point given as `path` is refused too.
  CKPT_ASSIGN_OR_RETURN(FileInfo parent, env->Stat(Dirname(path)));
  return RemoveBelow(env, path, parent);
}

}  // namespace ckpt
