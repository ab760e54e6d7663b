#include "cli/command.h"

#include <charconv>
#include <string>
#include <utility>

namespace ckpt::cli {

Command WhenParsed(const CLI::App* cmd, std::function<int()> run) {
  return [cmd, run = std::move(run)]() -> std::optional<int> {
    if (!cmd->parsed()) return std::nullopt;
    return run();
  };
}

CLI::Validator WholeNumber(uint64_t lo, uint64_t hi) {
  const std::string range = std::to_string(lo) + " to " + std::to_string(hi);
  return CLI::Validator(
      [lo, hi, range](std::string& text) -> std::string {
        uint64_t value = 0;
        const char* end = text.data() + text.size();
        auto [ptr, ec] = std::from_chars(text.data(), end, value);
        if (text.empty() || ec != std::errc() || ptr != end || value < lo || value > hi) {
          return "must be a whole number from " + range + ", got \"" + text + "\"";
        }
        return std::string();
      },
      "INT in " + range);
}

std::optional<int> RunParsed(const std::vector<Command>& commands) {
  for (const Command& command : commands) {
    if (std::optional<int> exit_code = command()) return exit_code;
  }
  return std::nullopt;
}

}  // namespace ckpt::cli
