// ckpt-tool gc: recovers the root (through the primary handle's Open), applies a retention
// policy, and on request deletes what recovery set aside in quarantine/. --dry-run takes no
// LOCK and changes nothing: it prints the recovery plan (PlanRecovery, the very list the real
// run then acts on, line for line) and, per step retention retires after it, what retention
// would do (PlanRetention: delete, quarantine or leave, the very list the real run acts on).
#include <iostream>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "ckpt/base/status_macros.h"
#include "ckpt/checkpoint_store.h"
#include "ckpt/recovery.h"
#include "cli/command.h"
#include "cli/commands.h"
#include "cli/common.h"

namespace ckpt::cli {
namespace {

struct GcOutcome {
  std::vector<RecoveryAction> recovery;
  std::vector<std::string> quarantined_to;
  std::optional<uint64_t> latest;
  RetentionReport retention;
  std::vector<std::string> purged;
};

// The dry run: the plan, then retention over the steps the plan leaves.
absl::StatusOr<GcOutcome> DryRun(const GcArgs& args, const std::string& root) {
  GcOutcome out;
  CKPT_ASSIGN_OR_RETURN(RecoveryPlan plan, PlanRecovery(Env::Default(), root));
  CKPT_ASSIGN_OR_RETURN(std::vector<uint64_t> steps, RetainableSteps(Env::Default(), root));
  std::vector<uint64_t> left;
  for (uint64_t step : steps) {
    bool goes = false;
    for (const RecoveryAction& a : plan.actions) {
      goes |= a.kind == RecoveryAction::Kind::kQuarantine && a.step == step;
    }
    if (!goes) left.push_back(step);
  }
  CKPT_ASSIGN_OR_RETURN(out.retention,
                        PlanRetention(Env::Default(), root,
                                      RetiredSteps(left, plan.latest,
                                                   {args.keep_last, args.keep_every})));
  out.recovery = std::move(plan.actions);
  out.latest = plan.latest;
  if (args.purge_quarantine) {
    StoreOptions options;
    options.read_only = true;
    CKPT_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointStore> store,
                          CheckpointStore::Open(root, options));
    CKPT_ASSIGN_OR_RETURN(out.purged, store->ListQuarantine());
  }
  return out;
}

absl::StatusOr<GcOutcome> RealRun(const GcArgs& args) {
  GcOutcome out;
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointStore> store,
                        CheckpointStore::Open(args.root, StoreOptions{}));
  out.recovery = store->recovery().actions;
  out.quarantined_to = store->recovery().quarantined;
  out.latest = store->latest_step();
  CKPT_ASSIGN_OR_RETURN(out.retention,
                        store->ApplyRetention({args.keep_last, args.keep_every}));
  if (args.purge_quarantine) {
    CKPT_ASSIGN_OR_RETURN(out.purged, store->PurgeQuarantine());
  }
  return out;
}

}  // namespace

int RunGc(const GcArgs& args) {
  absl::StatusOr<std::string> real = Env::Default()->RealPath(args.root);
  absl::StatusOr<bool> is_dir = real.ok() ? Env::Default()->IsDirectory(*real) : real.status();
  if (!is_dir.ok() || !*is_dir) {
    return ReportError(
        "gc", is_dir.ok() ? absl::NotFoundError(args.root + ": not a directory") : is_dir.status());
  }
  absl::StatusOr<GcOutcome> outcome = args.dry_run ? DryRun(args, *real) : RealRun(args);
  if (!outcome.ok()) return ReportError("gc", outcome.status());
  std::vector<std::string> lines;
  for (const RecoveryAction& a : outcome->recovery) lines.push_back(DescribeAction(a));
  std::vector<std::string> retention;
  for (const RecoveryAction& a : outcome->retention.actions) {
    retention.push_back(DescribeRetention(a, args.dry_run));
  }
  const std::vector<uint64_t> deleted = StepsOf(outcome->retention, RecoveryAction::Kind::kRemove);
  if (args.json) {
    PrintJson({{"root", args.root},
               {"dry_run", args.dry_run},
               {"recovery", lines},
               {"recovery_quarantined_to", outcome->quarantined_to},
               {"latest", outcome->latest.has_value() ? nlohmann::json(*outcome->latest)
                                                      : nlohmann::json(nullptr)},
               {"deleted", deleted},
               {"retention_quarantined",
                StepsOf(outcome->retention, RecoveryAction::Kind::kQuarantine)},
               {"retention_left", StepsOf(outcome->retention, RecoveryAction::Kind::kKeep)},
               {"retention", retention},
               {"retention_quarantined_to", outcome->retention.quarantined},
               {"quarantine_purged", outcome->purged}});
    return kExitOk;
  }
  const char* prefix = args.dry_run ? "recovery would: " : "recovery: ";
  for (const std::string& line : lines) std::cout << prefix << Printable(line) << "\n";
  for (const std::string& q : outcome->quarantined_to) {
    std::cout << "recovery moved an entry into " << Printable(q) << "\n";
  }
  for (const std::string& line : retention) std::cout << Printable(line) << "\n";
  for (const std::string& q : outcome->retention.quarantined) {
    std::cout << "retention moved a step into " << Printable(q) << "\n";
  }
  std::cout << (args.dry_run ? "would delete" : "deleted") << " " << deleted.size() << " step(s)"
            << (deleted.empty() ? "" : ": " + absl::StrJoin(deleted, ", ")) << "\n";
  if (args.purge_quarantine) {
    std::cout << (args.dry_run ? "would purge" : "purged") << " " << outcome->purged.size()
              << " quarantined entr" << (outcome->purged.size() == 1 ? "y" : "ies") << "\n";
  }
  return kExitOk;
}

Command AddGcCommand(CLI::App& app) {
  auto args = std::make_shared<GcArgs>();
  CLI::App* cmd = app.add_subcommand("gc", "Delete old steps (never the one LATEST names)");
  cmd->add_option("root", args->root, "Checkpoint root directory")->required();
  cmd->add_option("--keep-last", args->keep_last, "Keep the newest K steps")
      ->required()
      ->check(WholeNumber(1, UINT64_MAX));
  cmd->add_option("--keep-every", args->keep_every, "Also keep steps that are multiples of N")
      ->check(WholeNumber(0, UINT64_MAX));
  cmd->add_flag("--dry-run", args->dry_run,
                "Only print what recovery and retention would do (no LOCK, no change)");
  cmd->add_flag("--purge-quarantine", args->purge_quarantine,
                "Also delete the steps recovery set aside in quarantine/");
  cmd->add_flag("--json", args->json, "Print one JSON object");
  return WhenParsed(cmd, [args] { return RunGc(*args); });
}

}  // namespace ckpt::cli
