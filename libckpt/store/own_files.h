// What ckpt can show it wrote: the one recogniser that recovery (garbage directories) and
// retention (retired steps) both ask before they delete anything (DESIGN.md §3: "Recovery
// deletes only what ckpt created and can show it created (by name and by contents)").
// Private to libckpt/.
#ifndef CKPT_LIBCKPT_STORE_OWN_FILES_H_
#define CKPT_LIBCKPT_STORE_OWN_FILES_H_

#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "ckpt/env.h"

namespace ckpt::internal {

// The header a file of ckpt's own name starts with, or nullopt for a name ckpt never writes
// inside its directories. An empty magic: the file is always empty (LOCK).
std::optional<absl::string_view> MagicOfOwnFile(absl::string_view name);

// "" when the file at `path` (of `info`) starts with `magic`, or with a prefix of it (a crash
// tears a file at its last Sync); with `zeros_allowed` it may also start with zeros (a data
// file's extents are written at reserved offsets, the header with the first chunk, so a crash
// can leave a hole at 0). Otherwise the problem, in words. IO errors as they come.
absl::StatusOr<std::string> HeaderProblem(Env* env, const std::string& path, const FileInfo& info,
                                          absl::string_view magic, bool zeros_allowed);

// "" when everything below the directory `path` is ckpt's own garbage: directories of ckpt's
// names, regular files of ckpt's names that start with their header, all on `mount`'s mount
// and no deeper than ckpt ever nests (`depth` is the depth of `path`: 1 for an entry of the
// root). Otherwise the first thing that is not, in words. IO errors as they come.
absl::StatusOr<std::string> OwnTreeProblem(Env* env, const std::string& path, const FileInfo& mount,
                                           int depth);

// What a committed step directory holds besides what its commit wrote.
struct StepProblem {
  enum class Kind {
    kNone,        // Exactly MANIFEST and data files it lists: regular files with ckpt's headers.
    kForeign,     // Something ckpt did not write there (`entry`): a user's file, a FIFO, a
                  // directory, a link, an unlisted or foreign-headed data file; or no MANIFEST
                  // that parses, so that what the step should hold cannot be shown.
    kMountPoint,  // The step, or an entry at any depth below it, is on another mount.
  };
  Kind kind = Kind::kNone;
  std::string entry;  // Relative to the step directory ("notes.txt", "nested/mnt"); "." itself.
  std::string why;    // In words, for reports: "holds notes.txt, which ckpt did not write (...)".
};

// Judges the committed step directory `dir` against `root_info` (the root's Stat). A mount
// point outranks anything foreign: the whole tree is searched for one (never following a link,
// never entering another mount) before kForeign is returned, so that the caller decides
// before it renames anything. Reads MANIFEST, lists the tree and reads each data file's first
// bytes; changes nothing. IO errors (permission, EIO) as they come: the caller cannot tell.
absl::StatusOr<StepProblem> CommittedStepProblem(Env* env, const std::string& dir,
                                                 const FileInfo& root_info);

}  // namespace ckpt::internal

#endif  // CKPT_LIBCKPT_STORE_OWN_FILES_H_
