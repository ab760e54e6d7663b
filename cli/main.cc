// ckpt-tool: inspect, verify, gc and benchmark checkpoint stores. Each subcommand's file adds
// its own options and runs it (cli/command.h); CLI11's exceptions stay here.
#include <malloc.h>

#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "cli/command.h"
#include "cli/common.h"

namespace {

// Names an unknown subcommand: CLI11 would only say that a subcommand is required.
bool UnknownSubcommand(CLI::App& app, int argc, char** argv, std::string* message) {
  CLI::App* level = &app;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.empty() || arg[0] == '-') return false;
    std::vector<std::string> known;
    for (CLI::App* sub : level->get_subcommands([](CLI::App*) { return true; }))
      known.push_back(sub->get_name());
    if (known.empty()) return false;
    bool found = false;
    for (CLI::App* sub : level->get_subcommands([](CLI::App*) { return true; })) {
      if (sub->get_name() == arg) {
        level = sub;
        found = true;
      }
    }
    if (!found) {
      *message =
          "unknown subcommand \"" + arg + "\" of " + level->get_name() + "; expected one of:";
      for (const std::string& k : known) *message += " " + k;
      return true;
    }
  }
  return false;
}

// Each subcommand adds its own options (cli/command.h), in the order --help lists them.
constexpr ckpt::cli::AddCommand kSubcommands[] = {
    ckpt::cli::AddInspectCommand,    ckpt::cli::AddVerifyCommand,
    ckpt::cli::AddGcCommand,         ckpt::cli::AddAdoptCommand,
    ckpt::cli::AddQuarantineCommand, ckpt::cli::AddBenchCommand,
    ckpt::cli::AddDiffCommand,       ckpt::cli::AddHfReshardCommand,
    ckpt::cli::AddExportHfCommand,   ckpt::cli::AddReshardCommand,
};

}  // namespace

int main(int argc, char** argv) {
  // Buffers of 1 MiB and more are mapped, and unmapped when freed. By default glibc raises this
  // threshold after the first such free (up to 32 MiB) and then keeps freed buffers in the
  // arena of the thread that held them: reshard's ranks, each a thread, would each keep their
  // write buffers, and the tool's peak memory would grow with --dp.
  mallopt(M_MMAP_THRESHOLD, 1 << 20);
  using namespace ckpt::cli;
  CLI::App app{"ckpt-tool: inspect, verify and maintain ckpt checkpoint stores", "ckpt-tool"};
  app.require_subcommand(1);
  std::vector<Command> commands;
  for (AddCommand add : kSubcommands) commands.push_back(add(app));

  std::string unknown;
  if (UnknownSubcommand(app, argc, argv, &unknown)) {
    std::cerr << "ckpt-tool: " << Printable(unknown) << "\nRun with --help for more information.\n";
    return kExitUsage;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    int code = app.exit(e);
    return code == 0 ? kExitOk : kExitUsage;
  }
  if (std::optional<int> exit_code = RunParsed(commands)) return *exit_code;
  std::cerr << app.help();
  return kExitUsage;
}
