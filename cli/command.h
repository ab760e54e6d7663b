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

}  // namespace ckpt::cli

#endif  // CKPT_CLI_COMMAND_H_
