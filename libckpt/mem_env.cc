// MemEnv: a file system in a map, for fast tests. Every operation is durable at once (crash
// behaviour is FaultInjectionEnv's job). Paths are compared as strings after stripping trailing
// slashes; "/" and "." always exist. Safe for concurrent use.
#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "ckpt/base/status_macros.h"
#include "ckpt/env.h"
#include "libckpt/io_error.h"

namespace ckpt {
namespace {

struct FileData {
  std::mutex mu;
  std::string bytes;
};

struct Node {
  bool is_dir = false;
  std::shared_ptr<FileData> file;  // Null for directories.
};

std::string Normalize(absl::string_view path) {
  while (path.size() > 1 && path.back() == '/') path.remove_suffix(1);
  return std::string(path);
}

class MemWritableFile : public WritableFile {
 public:
  MemWritableFile(std::string path, std::shared_ptr<FileData> file)
      : path_(std::move(path)), file_(std::move(file)) {}
  absl::Status Append(std::span<const std::byte> data) override {
    if (closed_) return absl::FailedPreconditionError(path_ + ": file already closed");
    std::lock_guard<std::mutex> lock(file_->mu);
    if (positional_) {
      return absl::FailedPreconditionError(path_ + ": Append on a file written by WriteAt");
    }
    appended_ = true;
    file_->bytes.append(reinterpret_cast<const char*>(data.data()), data.size());
    size_ += data.size();
    return absl::OkStatus();
  }
  absl::Status WriteAt(uint64_t offset, std::span<const std::byte> data) override {
    if (closed_) return absl::FailedPreconditionError(path_ + ": file already closed");
    std::lock_guard<std::mutex> lock(file_->mu);
    CKPT_RETURN_IF_ERROR(
        internal::CheckWriteAt(path_, offset, data.data(), data.size(), appended_));
    positional_ = true;
    const uint64_t end = offset + data.size();
    if (file_->bytes.size() < end) file_->bytes.resize(end, '\0');
    std::memcpy(file_->bytes.data() + offset, data.data(), data.size());
    size_ = std::max(size_, end);
    return absl::OkStatus();
  }
  absl::Status Sync() override {
    if (closed_) return absl::FailedPreconditionError(path_ + ": file already closed");
    return absl::OkStatus();
  }
  absl::Status Close() override {
    if (closed_) return absl::FailedPreconditionError(path_ + ": file already closed");
    closed_ = true;
    return absl::OkStatus();
  }
  uint64_t size() const override {
    std::lock_guard<std::mutex> lock(file_->mu);
    return size_;
  }

 private:
  std::string path_;
  std::shared_ptr<FileData> file_;
  uint64_t size_ = 0;         // Guarded by file_->mu, as the two flags.
  bool appended_ = false;     // Written by Append: WriteAt refuses.
  bool positional_ = false;   // Written by WriteAt: Append refuses.
  bool closed_ = false;
};

class MemRandomAccessFile : public RandomAccessFile {
 public:
  MemRandomAccessFile(std::string path, std::string snapshot)
      : path_(std::move(path)), bytes_(std::move(snapshot)) {}
  absl::Status Read(uint64_t offset, std::span<std::byte> out) const override {
    if (offset > bytes_.size() || out.size() > bytes_.size() - offset) {
      return absl::DataLossError(absl::StrCat("read ", path_, ": file of ", bytes_.size(),
                                              " bytes ends before offset ", offset + out.size()));
    }
    std::memcpy(out.data(), bytes_.data() + offset, out.size());
    return absl::OkStatus();
  }
  uint64_t size() const override { return bytes_.size(); }

 private:
  std::string path_;
  std::string bytes_;  // Contents when opened; committed files never change afterwards.
};

class MemEnv;

class MemFileLock : public FileLock {
 public:
  MemFileLock(MemEnv* env, std::string path) : env_(env), path_(std::move(path)) {}
  ~MemFileLock() override;

 private:
  MemEnv* env_;
  std::string path_;
};

class MemEnv : public Env {
 public:
  absl::StatusOr<std::unique_ptr<WritableFile>> NewWritableFile(const std::string& raw_path,
                                                                const FileOptions&) override {
    std::string path = Normalize(raw_path);
    std::lock_guard<std::mutex> lock(mu_);
    CKPT_RETURN_IF_ERROR(CheckParentLocked(path));
    if (nodes_.count(path)) {
      return absl::AlreadyExistsError(
          absl::StrCat("create ", path, ": the name is taken; not overwriting it"));
    }
    auto file = std::make_shared<FileData>();
    nodes_[path] = Node{false, file};
    return std::unique_ptr<WritableFile>(new MemWritableFile(path, file));
  }

  absl::StatusOr<std::unique_ptr<RandomAccessFile>> NewRandomAccessFile(
      const std::string& raw_path, const FileOptions&) override {
    std::string path = Normalize(raw_path);
    std::shared_ptr<FileData> file;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = nodes_.find(path);
      if (it == nodes_.end())
        return absl::NotFoundError(absl::StrCat("open ", path, ": no such file"));
      if (it->second.is_dir)
        return absl::FailedPreconditionError(absl::StrCat("open ", path, ": is a directory"));
      file = it->second.file;
    }
    std::lock_guard<std::mutex> lock(file->mu);
    return std::unique_ptr<RandomAccessFile>(new MemRandomAccessFile(path, file->bytes));
  }

  absl::Status RenameFile(const std::string& raw_src, const std::string& raw_dst) override {
    std::string src = Normalize(raw_src), dst = Normalize(raw_dst);
    std::lock_guard<std::mutex> lock(mu_);
    auto it = nodes_.find(src);
    if (it == nodes_.end())
      return absl::NotFoundError(absl::StrCat("rename ", src, ": no such file"));
    CKPT_RETURN_IF_ERROR(CheckParentLocked(dst));
    if (src == dst) return absl::OkStatus();
    auto dst_it = nodes_.find(dst);
    if (dst_it != nodes_.end()) {
      if (dst_it->second.is_dir != it->second.is_dir ||
          (dst_it->second.is_dir && HasChildrenLocked(dst))) {
        return absl::FailedPreconditionError(
            absl::StrCat("rename ", src, " to ", dst, ": target exists"));
      }
    }
    Node node = it->second;
    if (node.is_dir) {
      // Move the whole subtree.
      std::string prefix = src + "/";
      std::vector<std::pair<std::string, Node>> moved;
      for (auto c = nodes_.lower_bound(prefix);
           c != nodes_.end() && absl::StartsWith(c->first, prefix);) {
        moved.emplace_back(dst + "/" + c->first.substr(prefix.size()), c->second);
        c = nodes_.erase(c);
      }
      for (auto& [p, n] : moved) nodes_[p] = n;
    }
    nodes_.erase(src);
    nodes_[dst] = node;
    return absl::OkStatus();
  }

  absl::Status RemoveFile(const std::string& raw_path) override {
    std::string path = Normalize(raw_path);
    std::lock_guard<std::mutex> lock(mu_);
    auto it = nodes_.find(path);
    if (it == nodes_.end())
      return absl::NotFoundError(absl::StrCat("remove ", path, ": no such file"));
    if (it->second.is_dir)
      return absl::FailedPreconditionError(absl::StrCat("remove ", path, ": is a directory"));
    nodes_.erase(it);
    return absl::OkStatus();
  }

  absl::Status CreateDir(const std::string& raw_path) override {
    std::string path = Normalize(raw_path);
    std::lock_guard<std::mutex> lock(mu_);
    if (path == "/" || path == "." || nodes_.count(path)) {
      return absl::AlreadyExistsError(absl::StrCat("mkdir ", path, ": exists"));
    }
    CKPT_RETURN_IF_ERROR(CheckParentLocked(path));
    nodes_[path] = Node{true, nullptr};
    return absl::OkStatus();
  }

  absl::Status RemoveDir(const std::string& raw_path) override {
    std::string path = Normalize(raw_path);
    std::lock_guard<std::mutex> lock(mu_);
    auto it = nodes_.find(path);
    if (it == nodes_.end())
      return absl::NotFoundError(absl::StrCat("rmdir ", path, ": no such directory"));
    if (!it->second.is_dir)
      return absl::FailedPreconditionError(absl::StrCat("rmdir ", path, ": not a directory"));
    if (HasChildrenLocked(path))
      return absl::FailedPreconditionError(absl::StrCat("rmdir ", path, ": directory not empty"));
    nodes_.erase(it);
    return absl::OkStatus();
  }

  absl::Status SyncDir(const std::string& raw_path) override {
    std::string path = Normalize(raw_path);
    std::lock_guard<std::mutex> lock(mu_);
    if (!IsDirLocked(path))
      return absl::NotFoundError(absl::StrCat("sync directory ", path, ": no such directory"));
    return absl::OkStatus();
  }

  absl::StatusOr<std::vector<std::string>> GetChildren(const std::string& raw_dir) override {
    std::string dir = Normalize(raw_dir);
    std::lock_guard<std::mutex> lock(mu_);
    if (!IsDirLocked(dir))
      return absl::NotFoundError(absl::StrCat("list ", dir, ": no such directory"));
    std::string prefix = dir == "/" ? "/" : dir + "/";
    std::vector<std::string> out;
    for (auto it = nodes_.lower_bound(prefix);
         it != nodes_.end() && absl::StartsWith(it->first, prefix); ++it) {
      std::string rest = it->first.substr(prefix.size());
      if (!rest.empty() && rest.find('/') == std::string::npos) out.push_back(rest);
    }
    return out;
  }

  absl::StatusOr<uint64_t> GetFileSize(const std::string& raw_path) override {
    std::string path = Normalize(raw_path);
    std::shared_ptr<FileData> file;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = nodes_.find(path);
      if (it == nodes_.end())
        return absl::NotFoundError(absl::StrCat("stat ", path, ": no such file"));
      if (it->second.is_dir) return uint64_t{0};
      file = it->second.file;
    }
    std::lock_guard<std::mutex> lock(file->mu);
    return static_cast<uint64_t>(file->bytes.size());
  }

  absl::StatusOr<bool> IsDirectory(const std::string& raw_path) override {
    std::string path = Normalize(raw_path);
    std::lock_guard<std::mutex> lock(mu_);
    if (path == "/" || path == ".") return true;
    auto it = nodes_.find(path);
    if (it == nodes_.end())
      return absl::NotFoundError(absl::StrCat("stat ", path, ": no such file"));
    return it->second.is_dir;
  }

  // MemEnv has no links and one mount.
  absl::StatusOr<FileInfo> Stat(const std::string& raw_path) override {
    std::string path = Normalize(raw_path);
    std::shared_ptr<FileData> file;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (IsDirLocked(path)) return FileInfo{.type = FileInfo::Type::kDirectory};
      auto it = nodes_.find(path);
      if (it == nodes_.end())
        return absl::NotFoundError(absl::StrCat("stat ", path, ": no such file"));
      file = it->second.file;
    }
    std::lock_guard<std::mutex> lock(file->mu);
    return FileInfo{.type = FileInfo::Type::kRegular,
                    .size_bytes = static_cast<uint64_t>(file->bytes.size())};
  }

  absl::StatusOr<std::unique_ptr<FileLock>> LockFile(const std::string& raw_path) override {
    std::string path = Normalize(raw_path);
    std::lock_guard<std::mutex> lock(mu_);
    CKPT_RETURN_IF_ERROR(CheckParentLocked(path));
    if (!locked_.insert(path).second) {
      return absl::FailedPreconditionError(
          absl::StrCat("lock ", path, ": held by another store handle or process"));
    }
    if (!nodes_.count(path)) nodes_[path] = Node{false, std::make_shared<FileData>()};
    return std::unique_ptr<FileLock>(new MemFileLock(this, path));
  }

  // MemEnv has no links: a path that exists is its own real path.
  absl::StatusOr<std::string> RealPath(const std::string& raw_path) override {
    std::string path = Normalize(raw_path);
    std::lock_guard<std::mutex> lock(mu_);
    if (!IsDirLocked(path) && !nodes_.count(path)) {
      return absl::NotFoundError(absl::StrCat("resolve ", path, ": no such file"));
    }
    return path;
  }

  void Unlock(const std::string& path) {
    std::lock_guard<std::mutex> lock(mu_);
    locked_.erase(path);
  }

 private:
  bool IsDirLocked(const std::string& path) const {
    if (path == "/" || path == ".") return true;
    auto it = nodes_.find(path);
    return it != nodes_.end() && it->second.is_dir;
  }
  bool HasChildrenLocked(const std::string& dir) const {
    std::string prefix = dir + "/";
    auto it = nodes_.lower_bound(prefix);
    return it != nodes_.end() && absl::StartsWith(it->first, prefix);
  }
  absl::Status CheckParentLocked(const std::string& path) const {
    std::string parent = Dirname(path);
    if (!IsDirLocked(parent)) {
      return absl::NotFoundError(
          absl::StrCat(path, ": parent directory ", parent, " does not exist"));
    }
    return absl::OkStatus();
  }

  std::mutex mu_;
  std::map<std::string, Node> nodes_;
  std::set<std::string> locked_;
};

MemFileLock::~MemFileLock() { env_->Unlock(path_); }

}  // namespace

std::unique_ptr<Env> NewMemEnv() { return std::make_unique<MemEnv>(); }

}  // namespace ckpt
