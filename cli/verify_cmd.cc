// ckpt-tool verify: re-reads everything and reports each problem by file, chunk and offset.
#include <iostream>
#include <memory>

#include "absl/strings/str_cat.h"
#include "ckpt/verify.h"
#include "cli/command.h"
#include "cli/commands.h"
#include "cli/common.h"
#include "cli/hf.h"

namespace ckpt::cli {
namespace {

nlohmann::json ProblemJson(const VerifyProblem& p) {
  nlohmann::json j = {{"file", p.file}, {"offset", p.offset}, {"message", p.message}};
  j["chunk"] = p.chunk.has_value() ? nlohmann::json(*p.chunk) : nlohmann::json(nullptr);
  return j;
}

void PrintProblem(const VerifyProblem& p) {
  std::cout << "  DAMAGED " << Printable(p.file);
  if (p.chunk.has_value()) std::cout << " chunk " << *p.chunk;
  std::cout << " offset " << p.offset << ": " << Printable(p.message) << "\n";
}

}  // namespace

int RunVerify(const VerifyArgs& args) {
  absl::StatusOr<bool> hf = TreatAsHf(args.root, "verify");
  if (!hf.ok()) return ReportError("verify", hf.status());
  if (*hf) return VerifyHf(args.root, args.json);
  Env* env = Env::Default();
  ProgressBar bar("verify", 1, !args.json);
  absl::StatusOr<StoreVerifyReport> report =
      VerifyStore(env, args.root, args.step, args.all, [&](uint64_t done, uint64_t total) {
        bar.SetTotal(total);
        bar.Update(done);
      });
  bar.Finish();
  if (!report.ok()) return ReportError("verify", report.status());
  if (args.json) {
    nlohmann::json out = {{"root", args.root},
                          {"ok", report->ok()},
                          {"problems", nlohmann::json::array()},
                          {"steps", nlohmann::json::array()}};
    out["latest"] =
        report->latest.has_value() ? nlohmann::json(*report->latest) : nlohmann::json(nullptr);
    for (const VerifyProblem& p : report->problems) out["problems"].push_back(ProblemJson(p));
    for (const StepVerifyReport& s : report->steps) {
      nlohmann::json step = {{"step", s.step},
                             {"dir", s.dir},
                             {"ok", s.problems.empty()},
                             {"removed", s.removed},
                             {"bytes_checked", s.bytes_checked},
                             {"chunks_checked", s.chunks_checked},
                             {"problems", nlohmann::json::array()}};
      for (const VerifyProblem& p : s.problems) step["problems"].push_back(ProblemJson(p));
      out["steps"].push_back(step);
    }
    PrintJson(out);
  } else {
    for (const VerifyProblem& p : report->problems) PrintProblem(p);
    if (report->steps.empty()) std::cout << Printable(args.root) << ": no step to verify\n";
    for (const StepVerifyReport& s : report->steps) {
      if (s.removed) {
        std::cout << "step " << s.step
                  << ": removed while it was being checked (retention or gc), not damage\n";
        continue;
      }
      std::cout << "step " << s.step << ": " << (s.problems.empty() ? "OK" : "DAMAGED") << " ("
                << s.chunks_checked << " chunks, " << FormatBytes(s.bytes_checked) << " checked)\n";
      for (const VerifyProblem& p : s.problems) PrintProblem(p);
    }
  }
  return report->ok() ? kExitOk : kExitDamage;
}

Command AddVerifyCommand(CLI::App& app) {
  auto args = std::make_shared<VerifyArgs>();
  CLI::App* cmd = app.add_subcommand(
      "verify", "Re-read and check every chunk and manifest (exit 0 intact, 1 damaged, 2 usage)");
  cmd->add_option("path", args->root, "ckpt root, .safetensors file or HF model directory")
      ->required();
  CLI::Option* step_opt =
      cmd->add_option("--step", args->step, "Verify this step")->check(WholeNumber(0, UINT64_MAX));
  cmd->add_flag("--all", args->all, "Verify every step")->excludes(step_opt);
  cmd->add_flag("--json", args->json, "Print one JSON object");
  return WhenParsed(cmd, [args] { return RunVerify(*args); });
}

}  // namespace ckpt::cli
