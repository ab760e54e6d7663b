// The recogniser of what ckpt wrote (own_files.h). Two rules, one per kind of directory ckpt
// deletes:
//   garbage (staging, deleting and undo directories; recovery's step 2): every entry below has
//     one of ckpt's names and kinds and starts with ckpt's header for that name; a prefix of
//     it counts, since a crash cuts a file at its last Sync (OwnTreeProblem);
//   a committed step (retention): exactly its MANIFEST and the data files that MANIFEST lists,
//     as regular files with ckpt's headers; a commit removes the parts before the rename, so
//     nothing else is ever there (CommittedStepProblem).
// Neither follows a link or enters another mount: Env::Stat never follows, and an entry whose
// device or mount id differs from the root's is a mount point. For a committed step the whole
// tree is searched for a mount point before anything foreign is reported, so that retention
// knows, before it renames anything, whether moving the step would move someone's mount.
#include "libckpt/store/own_files.h"

#include <algorithm>
#include <set>
#include <vector>

#include "absl/strings/str_cat.h"
#include "ckpt/base/coding.h"
#include "ckpt/base/status_macros.h"
#include "ckpt/formats/chunk.h"
#include "ckpt/formats/manifest.h"
#include "libckpt/filename.h"

namespace ckpt::internal {
namespace {

using Type = FileInfo::Type;

// Own trees are shallow: a staging directory holds files, an undo spill a store of steps.
constexpr int kMaxOwnDepth = 4;
// How deep retention looks for a mount point below a step that holds a foreign directory;
// deeper than this it cannot tell, and leaves the step in place.
constexpr int kMaxMountSearchDepth = 64;

// The first entry below the directory `dir` (named relative to the step as `rel`/<name>) on
// another mount than `mount`, or "" when there is none. Links are not followed.
absl::StatusOr<std::string> FindMountBelow(Env* env, const std::string& dir,
                                           const std::string& rel, const FileInfo& mount,
                                           int depth) {
  if (depth > kMaxMountSearchDepth) {
    return absl::FailedPreconditionError(absl::StrCat(
        dir, ": nested deeper than ", kMaxMountSearchDepth,
        " levels, so ckpt cannot tell whether a mount point lies below it"));
  }
  CKPT_ASSIGN_OR_RETURN(std::vector<std::string> names, env->GetChildren(dir));
  std::sort(names.begin(), names.end());
  for (const std::string& name : names) {
    const std::string child = JoinPath(dir, name);
    const std::string child_rel = rel.empty() ? name : JoinPath(rel, name);
    CKPT_ASSIGN_OR_RETURN(FileInfo info, env->Stat(child));
    if (!info.SameMountAs(mount)) return child_rel;
    if (info.type != Type::kDirectory) continue;
    CKPT_ASSIGN_OR_RETURN(std::string below,
                          FindMountBelow(env, child, child_rel, mount, depth + 1));
    if (!below.empty()) return below;
  }
  return std::string();
}

StepProblem Foreign(absl::string_view entry, absl::string_view why) {
  return StepProblem{StepProblem::Kind::kForeign, std::string(entry), std::string(why)};
}

// The data files `dir`'s MANIFEST lists, or the problem that keeps them from being shown.
absl::StatusOr<std::set<std::string>> ListedDataFiles(Env* env, const std::string& dir,
                                                      StepProblem* problem) {
  const std::string path = JoinPath(dir, kManifestName);
  absl::StatusOr<FileInfo> info = env->Stat(path);
  if (absl::IsNotFound(info.status())) {
    *problem = Foreign(kManifestName, "holds no MANIFEST, so what it holds cannot be shown");
    return std::set<std::string>();
  }
  CKPT_RETURN_IF_ERROR(info.status());
  if (info->type != Type::kRegular) {
    *problem = Foreign(kManifestName, "its MANIFEST is not a regular file, as ckpt writes it");
    return std::set<std::string>();
  }
  CKPT_ASSIGN_OR_RETURN(std::string bytes,
                        ReadFileToString(env, path, formats::kMaxManifestBytes,
                                         FileOptions{.follow_symlinks = false}));
  absl::StatusOr<formats::Manifest> manifest = formats::ParseManifest(AsBytes(bytes), path);
  if (absl::IsDataLoss(manifest.status()) || absl::IsUnimplemented(manifest.status())) {
    *problem = Foreign(kManifestName, absl::StrCat("its MANIFEST does not parse, so what it "
                                                   "holds cannot be shown: ",
                                                   manifest.status().message()));
    return std::set<std::string>();
  }
  CKPT_RETURN_IF_ERROR(manifest.status());
  std::set<std::string> listed;
  for (const formats::DataFileInfo& f : manifest->files) listed.insert(f.name);
  return listed;
}

// The problem of one entry of a committed step directory (kNone when it is ckpt's).
absl::StatusOr<StepProblem> EntryProblem(Env* env, const std::string& dir, const std::string& name,
                                         const std::set<std::string>& listed) {
  if (name == kManifestName) return StepProblem{};  // Judged by ListedDataFiles.
  const std::string path = JoinPath(dir, name);
  CKPT_ASSIGN_OR_RETURN(FileInfo info, env->Stat(path));
  absl::string_view what;
  switch (info.type) {
    case Type::kSymlink:
      what = "a symbolic link";
      break;
    case Type::kDirectory:
      what = "a directory; ckpt makes none inside a step";
      break;
    case Type::kOther:
      what = "a FIFO, socket or device";
      break;
    case Type::kRegular:
      if (!listed.count(name)) what = "a file the step's MANIFEST does not list";
      break;
  }
  std::string header;
  if (what.empty()) {
    CKPT_ASSIGN_OR_RETURN(header, HeaderProblem(env, path, info, formats::kDataFileMagic, false));
    if (header.empty()) return StepProblem{};
    what = "it does not start with ckpt's data file header";
  }
  return Foreign(name, absl::StrCat("holds ", name, ", which ckpt did not write (", what, ")"));
}

}  // namespace

std::optional<absl::string_view> MagicOfOwnFile(absl::string_view name) {
  if (name == kManifestName) return formats::kManifestMagic;
  if (IsPartFileName(name)) return formats::kPartMagic;
  if (IsDataFileName(name)) return formats::kDataFileMagic;
  if (name == kLatestName || name == absl::StrCat(kLatestName, ".tmp")) {
    return formats::kLatestMagic;
  }
  if (name == kLockName) return absl::string_view();
  return std::nullopt;
}

absl::StatusOr<std::string> HeaderProblem(Env* env, const std::string& path, const FileInfo& info,
                                          absl::string_view magic, bool zeros_allowed) {
  if (magic.empty()) {
    return info.size_bytes == 0 ? std::string() : absl::StrCat(path, " is not empty");
  }
  const size_t n = static_cast<size_t>(std::min<uint64_t>(info.size_bytes, magic.size()));
  if (n == 0) return std::string();
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<RandomAccessFile> file,
                        env->NewRandomAccessFile(path, FileOptions{.follow_symlinks = false}));
  std::string head(n, '\0');
  CKPT_RETURN_IF_ERROR(file->Read(0, std::as_writable_bytes(std::span<char>(head))));
  if (head == magic.substr(0, n)) return std::string();
  if (zeros_allowed && head == std::string(n, '\0')) return std::string();
  return absl::StrCat(path, " does not start with ckpt's header for that name");
}

absl::StatusOr<std::string> OwnTreeProblem(Env* env, const std::string& path, const FileInfo& mount,
                                           int depth) {
  if (depth > kMaxOwnDepth) return absl::StrCat(path, " is deeper than ckpt ever nests");
  CKPT_ASSIGN_OR_RETURN(std::vector<std::string> names, env->GetChildren(path));
  std::sort(names.begin(), names.end());
  for (const std::string& name : names) {
    const std::string child = JoinPath(path, name);
    CKPT_ASSIGN_OR_RETURN(FileInfo info, env->Stat(child));
    if (!info.SameMountAs(mount)) return absl::StrCat(child, " is a mount point");
    if (info.type == Type::kDirectory) {
      if (!ParseStepDirName(name).has_value() && !IsGarbageName(name)) {
        return absl::StrCat(child, " is a directory ckpt never makes");
      }
      CKPT_ASSIGN_OR_RETURN(std::string problem, OwnTreeProblem(env, child, mount, depth + 1));
      if (!problem.empty()) return problem;
      continue;
    }
    if (info.type == Type::kSymlink) return absl::StrCat(child, " is a symbolic link");
    std::optional<absl::string_view> magic = MagicOfOwnFile(name);
    if (info.type != Type::kRegular || !magic.has_value()) {
      return absl::StrCat(child, " is not a file ckpt writes");
    }
    CKPT_ASSIGN_OR_RETURN(std::string problem,
                          HeaderProblem(env, child, info, *magic, IsDataFileName(name)));
    if (!problem.empty()) return problem;
  }
  return std::string();
}

absl::StatusOr<StepProblem> CommittedStepProblem(Env* env, const std::string& dir,
                                                 const FileInfo& root_info) {
  CKPT_ASSIGN_OR_RETURN(FileInfo info, env->Stat(dir));
  if (!info.SameMountAs(root_info)) {
    return StepProblem{StepProblem::Kind::kMountPoint, ".", "the step is itself a mount point"};
  }
  if (info.type != Type::kDirectory) return Foreign(".", "not a directory");
  // A mount point anywhere below outranks everything else: moving the step would move it.
  CKPT_ASSIGN_OR_RETURN(std::string mount, FindMountBelow(env, dir, "", root_info, 1));
  if (!mount.empty()) {
    return StepProblem{StepProblem::Kind::kMountPoint, mount, "a mount point below the step"};
  }
  StepProblem problem;
  CKPT_ASSIGN_OR_RETURN(std::set<std::string> listed, ListedDataFiles(env, dir, &problem));
  if (problem.kind != StepProblem::Kind::kNone) return problem;
  CKPT_ASSIGN_OR_RETURN(std::vector<std::string> names, env->GetChildren(dir));
  std::sort(names.begin(), names.end());
  for (const std::string& name : names) {
    CKPT_ASSIGN_OR_RETURN(problem, EntryProblem(env, dir, name, listed));
    if (problem.kind != StepProblem::Kind::kNone) return problem;
  }
  return problem;
}

}  // namespace ckpt::internal
