// ckpt-tool gc: applies a retention policy through the primary handle (which recovers first),
// and on request deletes what recovery set aside in quarantine/. --dry-run opens the root
// read-only (no LOCK, no recovery) and changes nothing.
#include <iostream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "ckpt/checkpoint_store.h"
#include "cli/commands.h"
#include "cli/common.h"

namespace ckpt::cli {

int RunGc(const GcArgs& args) {
  StoreOptions options;
  options.read_only = args.dry_run;
  absl::StatusOr<std::string> real = Env::Default()->RealPath(args.root);
  absl::StatusOr<bool> is_dir = real.ok() ? Env::Default()->IsDirectory(*real) : real.status();
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
  std::vector<std::string> purged;
  if (args.purge_quarantine) {
    absl::StatusOr<std::vector<std::string>> p = (*store)->PurgeQuarantine(args.dry_run);
    if (!p.ok()) return ReportError("gc", p.status());
    purged = *std::move(p);
  }
  const RecoveryReport& recovery = (*store)->recovery();
  if (args.json) {
    PrintJson({{"root", args.root},
               {"dry_run", args.dry_run},
               {"deleted", *deleted},
               {"quarantine_purged", purged},
               {"recovery_removed", recovery.removed},
               {"recovery_quarantined", recovery.quarantined},
               {"recovery_problem", recovery.latest_problem}});
    return kExitOk;
  }
  if (recovery.latest_repaired) {
    const std::optional<uint64_t> latest = (*store)->latest_step();
    std::cout << "recovery: " << Printable(recovery.latest_problem) << "; LATEST now names "
              << (latest.has_value() ? absl::StrCat("step ", *latest) : std::string("no step"))
              << "\n";
  }
  for (const std::string& r : recovery.removed)
    std::cout << "recovery removed " << Printable(r) << "\n";
  for (const std::string& q : recovery.quarantined)
    std::cout << "recovery moved a step into " << Printable(q) << "\n";
  std::cout << (args.dry_run ? "would delete" : "deleted") << " " << deleted->size() << " step(s)"
            << (deleted->empty() ? "" : ": " + absl::StrJoin(*deleted, ", ")) << "\n";
  if (args.purge_quarantine) {
    std::cout << (args.dry_run ? "would purge" : "purged") << " " << purged.size()
              << " quarantined entr" << (purged.size() == 1 ? "y" : "ies") << "\n";
  }
  return kExitOk;
}

}  // namespace ckpt::cli
