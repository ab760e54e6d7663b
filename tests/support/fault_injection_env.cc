#include "tests/support/fault_injection_env.h"

#include <algorithm>
#include <cerrno>
#include <random>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "ckpt/base/coding.h"
#include "ckpt/base/status_macros.h"
#include "libckpt/io_error.h"

namespace ckpt::testing {
namespace {

// The test Env reads back whatever its target holds.
constexpr uint64_t kNoSizeLimit = UINT64_MAX;
// The largest replaced or removed file whose durable contents are kept for DropUnsyncedData.
constexpr uint64_t kMaxSavedBytes = uint64_t{1} << 30;

std::string Normalize(absl::string_view path) {
  while (path.size() > 1 && path.back() == '/') path.remove_suffix(1);
  return std::string(path);
}

// `path` with prefix `from` replaced by `to`, or nullopt when `path` is not under `from`.
std::optional<std::string> Rebase(const std::string& path, const std::string& from,
                                  const std::string& to) {
  if (path == from) return to;
  if (absl::StartsWith(path, from + "/")) return to + path.substr(from.size());
  return std::nullopt;
}

}  // namespace

class FaultInjectionEnv::File : public WritableFile {
 public:
  File(FaultInjectionEnv* env, std::string path, std::unique_ptr<WritableFile> target,
       std::shared_ptr<FileState> state)
      : env_(env), path_(std::move(path)), target_(std::move(target)), state_(std::move(state)) {}

  absl::Status Append(std::span<const std::byte> data) override {
    std::lock_guard<std::recursive_mutex> lock(env_->mu_);
    CKPT_RETURN_IF_ERROR(env_->BeforeMutation(Op::kAppend, "append " + path_));
    ++env_->appends_;
    if (env_->tear_append_.has_value() && env_->appends_ == *env_->tear_append_) {
      env_->tear_append_.reset();
      std::span<const std::byte> kept = data.first(std::min(env_->tear_keep_, data.size()));
      CKPT_RETURN_IF_ERROR(target_->Append(kept));
      state_->size += kept.size();
      if (env_->tear_crash_) env_->crashed_ = true;
      return internal::IoError(EIO, "injected torn append " + path_);
    }
    absl::Status s = target_->Append(data);
    if (s.ok()) state_->size += data.size();
    env_->AfterMutation();
    return s;
  }
  // Under the Env's lock like every call: concurrent WriteAt calls take turns.
  absl::Status WriteAt(uint64_t offset, std::span<const std::byte> data) override {
    std::lock_guard<std::recursive_mutex> lock(env_->mu_);
    CKPT_RETURN_IF_ERROR(
        env_->BeforeMutation(Op::kAppend, absl::StrCat("write ", path_, " at offset ", offset)));
    ++env_->appends_;
    if (env_->tear_append_.has_value() && env_->appends_ == *env_->tear_append_) {
      env_->tear_append_.reset();
      const size_t keep = std::min(env_->tear_keep_, data.size()) / kWriteAtAlignment *
                          kWriteAtAlignment;
      if (keep > 0) {
        CKPT_RETURN_IF_ERROR(target_->WriteAt(offset, data.first(keep)));
        state_->size = std::max(state_->size, offset + keep);
      }
      if (env_->tear_crash_) env_->crashed_ = true;
      return internal::IoError(EIO, absl::StrCat("injected torn write ", path_, " at offset ",
                                                 offset));
    }
    absl::Status s = target_->WriteAt(offset, data);
    if (s.ok()) state_->size = std::max(state_->size, offset + data.size());
    env_->AfterMutation();
    return s;
  }
  absl::Status Sync() override {
    std::lock_guard<std::recursive_mutex> lock(env_->mu_);
    CKPT_RETURN_IF_ERROR(env_->BeforeMutation(Op::kSync, "sync " + path_));
    absl::Status s = target_->Sync();
    if (s.ok()) state_->synced = state_->size;
    env_->AfterMutation();
    return s;
  }
  absl::Status Close() override {
    std::lock_guard<std::recursive_mutex> lock(env_->mu_);
    CKPT_RETURN_IF_ERROR(env_->CheckAlive("close " + path_));
    return target_->Close();
  }
  uint64_t size() const override { return target_->size(); }

 private:
  FaultInjectionEnv* env_;
  std::string path_;
  std::unique_ptr<WritableFile> target_;
  std::shared_ptr<FileState> state_;
};

FaultInjectionEnv::FaultInjectionEnv(Env* target) : EnvWrapper(target) {}
FaultInjectionEnv::~FaultInjectionEnv() = default;

void FaultInjectionEnv::FailNth(uint64_t n, int errnum, Op op) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  failures_.push_back({(op == Op::kAny ? calls_ : per_op_calls_[op]) + n, errnum, op});
}

void FaultInjectionEnv::TearNthAppend(uint64_t n, size_t keep_bytes, bool crash) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  tear_append_ = appends_ + n;
  tear_keep_ = keep_bytes;
  tear_crash_ = crash;
}

void FaultInjectionEnv::CrashAfter(uint64_t k) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  crash_after_ = calls_ + k;
  if (k == 0) crashed_ = true;
}

void FaultInjectionEnv::Disarm() {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  failures_.clear();
  tear_append_.reset();
  crash_after_.reset();
  read_failures_.clear();
}

void FaultInjectionEnv::SetAvailableMemory(std::optional<uint64_t> bytes) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  available_memory_ = bytes;
}

std::optional<uint64_t> FaultInjectionEnv::AvailableMemoryBytes() {
  {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    if (available_memory_.has_value()) return *available_memory_;
  }
  return EnvWrapper::AvailableMemoryBytes();
}

uint64_t FaultInjectionEnv::mutating_calls() const {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  return calls_;
}

bool FaultInjectionEnv::crashed() const {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  return crashed_;
}

absl::Status FaultInjectionEnv::CheckAlive(const std::string& what) const {
  if (crashed_) return internal::IoError(EIO, "simulated crash before " + what);
  return absl::OkStatus();
}

absl::Status FaultInjectionEnv::BeforeMutation(Op op, const std::string& what) {
  CKPT_RETURN_IF_ERROR(CheckAlive(what));
  ++calls_;
  uint64_t op_calls = ++per_op_calls_[op];
  for (auto it = failures_.begin(); it != failures_.end(); ++it) {
    if ((it->op == Op::kAny && it->n == calls_) || (it->op == op && it->n == op_calls)) {
      int errnum = it->errnum;
      failures_.erase(it);
      AfterMutation();
      return internal::IoError(errnum, "injected failure: " + what);
    }
  }
  return absl::OkStatus();
}

void FaultInjectionEnv::FailReadOpens(const std::string& path_suffix, int errnum, int skip) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  read_failures_.push_back({path_suffix, errnum, skip});
}

void FaultInjectionEnv::AfterMutation() {
  if (crash_after_.has_value() && calls_ >= *crash_after_) crashed_ = true;
}

std::optional<std::string> FaultInjectionEnv::DurableContents(const std::string& path) {
  absl::StatusOr<bool> is_dir = target()->IsDirectory(path);
  if (!is_dir.ok() || *is_dir) return std::nullopt;
  // A file too large to keep in memory (a sparse one a test planted) is not restorable.
  absl::StatusOr<std::string> bytes = ReadFileToString(target(), path, kMaxSavedBytes);
  if (!bytes.ok()) return std::nullopt;
  auto it = files_.find(path);
  if (it != files_.end() && bytes->size() > it->second->synced) bytes->resize(it->second->synced);
  return *bytes;
}

void FaultInjectionEnv::MovePaths(const std::string& from, const std::string& to) {
  // The replaced destination's state is gone with it.
  for (auto it = files_.begin(); it != files_.end();) {
    it = Rebase(it->first, to, to).has_value() ? files_.erase(it) : std::next(it);
  }
  std::map<std::string, std::shared_ptr<FileState>> moved;
  for (auto it = files_.begin(); it != files_.end();) {
    if (std::optional<std::string> p = Rebase(it->first, from, to)) {
      moved[*p] = it->second;
      it = files_.erase(it);
    } else {
      ++it;
    }
  }
  files_.merge(moved);
  for (DirOp& op : pending_) {
    if (std::optional<std::string> p = Rebase(op.path, from, to)) op.path = *p;
    if (std::optional<std::string> p = Rebase(op.src, from, to)) op.src = *p;
  }
}

absl::StatusOr<std::unique_ptr<WritableFile>> FaultInjectionEnv::NewWritableFile(
    const std::string& raw_path, const FileOptions& options) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  const std::string path = Normalize(raw_path);
  CKPT_RETURN_IF_ERROR(BeforeMutation(Op::kOpen, "create " + path));
  const bool existed = target()->IsDirectory(path).ok();
  absl::StatusOr<std::unique_ptr<WritableFile>> file = target()->NewWritableFile(path, options);
  if (file.ok()) {
    auto state = std::make_shared<FileState>();
    files_[path] = state;
    if (!existed) pending_.push_back({DirOp::kCreate, path, "", false, std::nullopt});
    AfterMutation();
    return std::unique_ptr<WritableFile>(new File(this, path, std::move(file).value(), state));
  }
  AfterMutation();
  return file.status();
}

absl::StatusOr<std::unique_ptr<RandomAccessFile>> FaultInjectionEnv::NewRandomAccessFile(
    const std::string& path, const FileOptions& options) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  CKPT_RETURN_IF_ERROR(CheckAlive("open " + path));
  for (ReadFailure& f : read_failures_) {
    if (!absl::EndsWith(path, f.suffix)) continue;
    if (f.skip > 0) {
      --f.skip;
      continue;
    }
    return internal::IoError(f.errnum, absl::StrCat("injected failure: open ", path));
  }
  return target()->NewRandomAccessFile(path, options);
}

absl::Status FaultInjectionEnv::RenameFile(const std::string& raw_src, const std::string& raw_dst) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  const std::string src = Normalize(raw_src), dst = Normalize(raw_dst);
  CKPT_RETURN_IF_ERROR(BeforeMutation(Op::kRename, "rename " + src + " to " + dst));
  std::optional<std::string> replaced = DurableContents(dst);
  absl::StatusOr<bool> is_dir = target()->IsDirectory(src);
  absl::Status s = target()->RenameFile(src, dst);
  if (s.ok()) {
    MovePaths(src, dst);
    pending_.push_back({DirOp::kRename, dst, src, is_dir.ok() && *is_dir, replaced});
  }
  AfterMutation();
  return s;
}

absl::Status FaultInjectionEnv::RemoveFile(const std::string& raw_path) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  const std::string path = Normalize(raw_path);
  CKPT_RETURN_IF_ERROR(BeforeMutation(Op::kRemove, "remove " + path));
  std::optional<std::string> saved = DurableContents(path);
  absl::Status s = target()->RemoveFile(path);
  if (s.ok()) {
    files_.erase(path);
    pending_.push_back({DirOp::kRemove, path, "", false, saved});
  }
  AfterMutation();
  return s;
}

absl::Status FaultInjectionEnv::CreateDir(const std::string& raw_path) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  const std::string path = Normalize(raw_path);
  CKPT_RETURN_IF_ERROR(BeforeMutation(Op::kCreateDir, "mkdir " + path));
  absl::Status s = target()->CreateDir(path);
  if (s.ok()) pending_.push_back({DirOp::kCreate, path, "", true, std::nullopt});
  AfterMutation();
  return s;
}

absl::Status FaultInjectionEnv::RemoveDir(const std::string& raw_path) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  const std::string path = Normalize(raw_path);
  CKPT_RETURN_IF_ERROR(BeforeMutation(Op::kRemoveDir, "rmdir " + path));
  absl::Status s = target()->RemoveDir(path);
  if (s.ok()) pending_.push_back({DirOp::kRemove, path, "", true, std::nullopt});
  AfterMutation();
  return s;
}

absl::Status FaultInjectionEnv::SyncDir(const std::string& raw_path) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  const std::string dir = Normalize(raw_path);
  CKPT_RETURN_IF_ERROR(BeforeMutation(Op::kSyncDir, "sync directory " + dir));
  absl::Status s = target()->SyncDir(dir);
  if (s.ok()) {
    std::erase_if(pending_, [&](const DirOp& op) {
      return Dirname(op.path) == dir && (op.kind != DirOp::kRename || Dirname(op.src) == dir);
    });
  }
  AfterMutation();
  return s;
}

absl::StatusOr<std::vector<std::string>> FaultInjectionEnv::GetChildren(const std::string& dir) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  CKPT_RETURN_IF_ERROR(CheckAlive("list " + dir));
  return target()->GetChildren(dir);
}

absl::StatusOr<uint64_t> FaultInjectionEnv::GetFileSize(const std::string& path) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  CKPT_RETURN_IF_ERROR(CheckAlive("stat " + path));
  return target()->GetFileSize(path);
}

absl::StatusOr<bool> FaultInjectionEnv::IsDirectory(const std::string& path) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  CKPT_RETURN_IF_ERROR(CheckAlive("stat " + path));
  return target()->IsDirectory(path);
}

absl::StatusOr<FileInfo> FaultInjectionEnv::Stat(const std::string& path) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  CKPT_RETURN_IF_ERROR(CheckAlive("stat " + path));
  return target()->Stat(path);
}

absl::StatusOr<std::unique_ptr<FileLock>> FaultInjectionEnv::LockFile(const std::string& path) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  CKPT_RETURN_IF_ERROR(CheckAlive("lock " + path));
  return target()->LockFile(path);
}

absl::Status FaultInjectionEnv::Truncate(const std::string& path, uint64_t size) {
  CKPT_ASSIGN_OR_RETURN(std::string bytes, ReadFileToString(target(), path, kNoSizeLimit));
  if (bytes.size() <= size) return absl::OkStatus();
  bytes.resize(size);
  return Restore(path, bytes);
}

absl::Status FaultInjectionEnv::Restore(const std::string& path, const std::string& contents) {
  // NewWritableFile never replaces a name: the old contents go first.
  absl::Status removed = target()->RemoveFile(path);
  if (!removed.ok() && !absl::IsNotFound(removed)) return removed;
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> file,
                        target()->NewWritableFile(path, FileOptions{}));
  absl::Status s = file->Append(AsBytes(contents));
  s.Update(file->Close());
  return s;
}

absl::Status FaultInjectionEnv::DropUnsyncedData(std::optional<uint64_t> seed) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  std::mt19937_64 rng(seed.value_or(0));
  for (const auto& [path, state] : files_) {
    if (!target()->IsDirectory(path).ok() || state->size <= state->synced) continue;
    uint64_t keep = state->synced;
    if (seed.has_value()) {
      keep += std::uniform_int_distribution<uint64_t>(0, state->size - state->synced)(rng);
    }
    CKPT_RETURN_IF_ERROR(Truncate(path, keep));
  }
  for (auto it = pending_.rbegin(); it != pending_.rend(); ++it) {
    const DirOp& op = *it;
    const bool exists = target()->IsDirectory(op.path).ok();
    switch (op.kind) {
      case DirOp::kCreate:
        if (exists) CKPT_RETURN_IF_ERROR(RemoveRecursively(target(), op.path));
        break;
      case DirOp::kRemove:
        // An entry whose directory is gone for good stays gone with it.
        if (exists || !target()->IsDirectory(Dirname(op.path)).ok()) break;
        if (op.is_dir) {
          CKPT_RETURN_IF_ERROR(target()->CreateDir(op.path));
        } else if (op.saved.has_value()) {
          CKPT_RETURN_IF_ERROR(Restore(op.path, *op.saved));
        }
        break;
      case DirOp::kRename:
        if (exists) CKPT_RETURN_IF_ERROR(target()->RenameFile(op.path, op.src));
        if (op.saved.has_value()) CKPT_RETURN_IF_ERROR(Restore(op.path, *op.saved));
        break;
    }
  }
  files_.clear();
  pending_.clear();
  failures_.clear();
  tear_append_.reset();
  crash_after_.reset();
  read_failures_.clear();
  crashed_ = false;
  return absl::OkStatus();
}

}  // namespace ckpt::testing
