// ckpt-tool adopt and quarantine: an operator's explicit decisions about which step a root
// resumes from, through the primary handle (which recovers first).
//   adopt ROOT STEP       LATEST := STEP, after every chunk of STEP verifies (an intact step
//                         recovery kept above LATEST, or an older step to go back to).
//   quarantine ROOT STEP  moves STEP whole into quarantine/ (LATEST falls back to the newest
//                         older intact step when it named STEP); --all moves every step and
//                         LATEST, so the root opens as a new, empty store.
#include <iostream>
#include <memory>

#include "absl/strings/str_cat.h"
#include "ckpt/checkpoint_store.h"
#include "cli/command.h"
#include "cli/commands.h"
#include "cli/common.h"

namespace ckpt::cli {
namespace {

// Exit code for a failed store operation: damage found is kExitDamage.
int Report(absl::string_view command, const absl::Status& status) {
  ReportError(command, status);
  return absl::IsDataLoss(status) ? kExitDamage : kExitUsage;
}

}  // namespace

int RunAdopt(const AdoptArgs& args) {
  absl::StatusOr<std::unique_ptr<CheckpointStore>> store =
      CheckpointStore::Open(args.root, StoreOptions{});
  if (!store.ok()) return Report("adopt", store.status());
  const std::optional<uint64_t> before = (*store)->latest_step();
  absl::Status adopted = (*store)->Adopt(args.step);
  if (!adopted.ok()) return Report("adopt", adopted);
  std::cout << "LATEST now names step " << args.step << " (was "
            << (before.has_value() ? absl::StrCat("step ", *before) : std::string("none"))
            << ")\n";
  return kExitOk;
}

int RunQuarantine(const QuarantineArgs& args) {
  absl::StatusOr<std::unique_ptr<CheckpointStore>> store =
      CheckpointStore::Open(args.root, StoreOptions{});
  if (!store.ok() && !(args.all && absl::IsDataLoss(store.status()))) {
    return Report("quarantine", store.status());
  }
  if (!store.ok()) {
    // No intact step, so Open refuses: --all is exactly what that refusal asks for. Opened
    // through a handle that skips recovery, under the LOCK all the same.
    StoreOptions options;
    options.skip_recovery = true;
    store = CheckpointStore::Open(args.root, options);
    if (!store.ok()) return Report("quarantine", store.status());
  }
  std::vector<std::string> moved;
  if (args.all) {
    absl::StatusOr<std::vector<std::string>> all = (*store)->QuarantineAll();
    if (!all.ok()) return Report("quarantine", all.status());
    moved = *std::move(all);
  } else {
    absl::StatusOr<std::string> one = (*store)->QuarantineStep(*args.step);
    if (!one.ok()) return Report("quarantine", one.status());
    moved.push_back(*std::move(one));
  }
  for (const std::string& m : moved) std::cout << "moved into " << Printable(m) << "\n";
  const std::optional<uint64_t> latest = (*store)->latest_step();
  std::cout << "LATEST "
            << (latest.has_value() ? absl::StrCat("names step ", *latest)
                                   : std::string(args.all ? "moved: the root is now empty"
                                                          : "names no intact step"))
            << "\n";
  return kExitOk;
}

Command AddAdoptCommand(CLI::App& app) {
  auto args = std::make_shared<AdoptArgs>();
  CLI::App* cmd = app.add_subcommand(
      "adopt", "Make LATEST name STEP once every chunk of it verifies (an unpublished step "
               "recovery kept, or an older one)");
  cmd->add_option("root", args->root, "Checkpoint root directory")->required();
  cmd->add_option("step", args->step, "The step")->required()->check(WholeNumber(0, UINT64_MAX));
  return WhenParsed(cmd, [args] { return RunAdopt(*args); });
}

Command AddQuarantineCommand(CLI::App& app) {
  struct Parsed {
    QuarantineArgs args;
    uint64_t step = 0;  // Into args.step when given.
  };
  auto parsed = std::make_shared<Parsed>();
  CLI::App* cmd = app.add_subcommand(
      "quarantine", "Move a step (or, with --all, every step and LATEST) whole into quarantine/");
  cmd->add_option("root", parsed->args.root, "Checkpoint root directory")->required();
  CLI::Option* step_opt =
      cmd->add_option("step", parsed->step, "The step")->check(WholeNumber(0, UINT64_MAX));
  cmd->add_flag("--all", parsed->args.all, "Every step and LATEST: the root opens empty after")
      ->excludes(step_opt);
  return WhenParsed(cmd, [parsed, step_opt] {
    if (step_opt->count() > 0) parsed->args.step = parsed->step;
    if (!parsed->args.step.has_value() && !parsed->args.all) {
      std::cerr << "ckpt-tool quarantine: name a STEP or --all\n";
      return kExitUsage;
    }
    return RunQuarantine(parsed->args);
  });
}

}  // namespace ckpt::cli
