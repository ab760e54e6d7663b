// How each subcommand of ckpt-tool puts itself on the command line: its own file declares its
// options, their checks and what runs once it is parsed, so main() only lists the subcommands.
// CLI11 appears only in cli/; this header is private to it.
#ifndef CKPT_CLI_COMMAND_H_
#define CKPT_CLI_COMMAND_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include <CLI/CLI.hpp>

namespace ckpt::cli {

// A subcommand added to an App. Called after a successful parse: runs the subcommand and returns
// its exit code if it is the one parsed, nullopt otherwise. It runs outside App::parse, so
// nothing it does is mistaken for a parse error.
using Command = std::function<std::optional<int>()>;
// Adds one subcommand to an App and returns its Command.
using AddCommand = Command (*)(CLI::App& app);

// The Command that runs `run` when `cmd` was the subcommand parsed.
Command WhenParsed(const CLI::App* cmd, std::function<int()> run);

// A whole number in [lo, hi], written in plain decimal digits. CLI11 would read "-1" into an
// unsigned option as 2^64-1, and its range checks print their bounds as doubles.
CLI::Validator WholeNumber(uint64_t lo, uint64_t hi);

// The exit code of the first of `commands` that was parsed; nullopt if none was.
std::optional<int> RunParsed(const std::vector<Command>& commands);

// Each adds one subcommand to `app` (the order of the calls is the order of --help).
Command AddInspectCommand(CLI::App& app);     // inspect.cc
Command AddVerifyCommand(CLI::App& app);      // verify_cmd.cc
Command AddGcCommand(CLI::App& app);          // gc.cc
Command AddAdoptCommand(CLI::App& app);       // store_cmds.cc
Command AddQuarantineCommand(CLI::App& app);  // store_cmds.cc
Command AddBenchCommand(CLI::App& app);       // bench.cc: bench and each bench subcommand
Command AddDiffCommand(CLI::App& app);        // diff.cc
Command AddHfReshardCommand(CLI::App& app);   // hf_reshard.cc
Command AddExportHfCommand(CLI::App& app);    // export_hf.cc
Command AddReshardCommand(CLI::App& app);     // reshard.cc

// The subcommands of bench, each added to `bench` by its bench_*.cc.
Command AddBenchIoCommand(CLI::App& bench);
Command AddBenchSafetensorsCommand(CLI::App& bench);
Command AddBenchAdamwCommand(CLI::App& bench);
Command AddBenchReshardCommand(CLI::App& bench);
Command AddBenchStartupCommand(CLI::App& bench);
Command AddBenchOverlapCommand(CLI::App& bench);
Command AddBenchMuonCommand(CLI::App& bench);
Command AddBenchCkptCommand(CLI::App& bench);
Command AddBenchAsyncSaveCommand(CLI::App& bench);

}  // namespace ckpt::cli

#endif  // CKPT_CLI_COMMAND_H_
