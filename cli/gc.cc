// ckpt-tool gc: applies a retention policy through the primary handle (which recovers first).
#include <iostream>

#include "absl/strings/str_join.h"
#include "ckpt/checkpoint_store.h"
#include "cli/commands.h"
#include "cli/common.h"

namespace ckpt::cli {

int RunGc(const GcArgs& args) {
  StoreOptions options;
  absl::StatusOr<bool> is_dir = Env::Default()->IsDirectory(args.root);
  if (!is_dir.ok() || !*is_dir) {
    return ReportError(
        "gc", is_dir.ok() ? absl::NotFoundError(args.root + ": not a directory") : is_dir.status());
  }
  absl::StatusOr<std::unique_ptr<CheckpointStore>> store =
      CheckpointStore::Open(args.root, options);
  if (!store.ok()) return ReportError("gc", store.status());
  absl::StatusOr<std::vector<uint64_t>> deleted =
      (*store)->ApplyRetention({args.keep_last, args.keep_every}, args.dry_run);
  if (!deleted.ok()) return ReportError("gc", deleted.status());
  if (args.json) {
    PrintJson({{"root", args.root},
               {"dry_run", args.dry_run},
               {"deleted", *deleted},
               {"recovery_removed", (*store)->recovery().removed}});
    return kExitOk;
  }
  for (const std::string& r : (*store)->recovery().removed)
    std::cout << "recovery removed " << r << "\n";
  std::cout << (args.dry_run ? "would delete" : "deleted") << " " << deleted->size() << " step(s)"
            << (deleted->empty() ? "" : ": " + absl::StrJoin(*deleted, ", ")) << "\n";
  return kExitOk;
}

}  // namespace ckpt::cli
