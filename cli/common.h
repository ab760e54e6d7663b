// Shared pieces of ckpt-tool's subcommands: exit codes, output and progress.
#ifndef CKPT_CLI_COMMON_H_
#define CKPT_CLI_COMMON_H_

#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "ckpt/checkpoint_store.h"
#include "ckpt/env.h"

namespace ckpt::cli {

// Exit codes shared by every subcommand.
inline constexpr int kExitOk = 0;
inline constexpr int kExitDamage = 1;  // Damage or invalid input found.
inline constexpr int kExitUsage = 2;   // Bad usage, or the root cannot be read.

// Prints "ckpt-tool: <context>: <status>" to stderr (Printable) and returns kExitUsage.
int ReportError(absl::string_view context, const absl::Status& status);

// A committed step opened for reading, with the read-only store handle it came from.
struct OpenedStep {
  std::unique_ptr<CheckpointStore> store;
  std::unique_ptr<CheckpointReader> reader;
};
// Opens `root` read-only and its `step` (LATEST when nullopt) for `command`. On failure prints
// the error and returns the exit code: damage (kDataLoss; kNotFound when the step's directory
// or LATEST is there, so a file of it is missing or LATEST names a step that is gone) is
// kExitDamage; anything else (a step never saved, a missing root) kExitUsage. kExitOk on
// success.
int OpenStepOrReport(absl::string_view command, const std::string& root,
                     std::optional<uint64_t> step, OpenedStep* out);

// `text` safe for a terminal: control bytes (below 0x20, and 0x7f) become \xNN and a backslash
// becomes \\; C1 controls and bidirectional controls (U+0080-U+009F, U+061C, U+200E, U+200F,
// U+202A-U+202E, U+2066-U+2069) become \uNNNN; bytes that are not well-formed UTF-8 become
// \xNN. So a name read from a file cannot move the cursor, rewrite what was printed or reorder
// it. Other UTF-8 passes unchanged. JSON output is escaped by the JSON encoder instead.
std::string Printable(absl::string_view text);

// kResourceExhausted naming `what` when `bytes` exceed the machine's physical memory: a
// benchmark that would need more fails with a clear message instead of std::bad_alloc.
absl::Status CheckFitsInMemory(uint64_t bytes, absl::string_view what);

// Parses "123", "4K", "2M", "2G", "1T" (powers of 1024).
absl::StatusOr<uint64_t> ParseByteSize(absl::string_view text);
std::string FormatBytes(uint64_t bytes);

void PrintJson(const nlohmann::json& value);

// A one-line progress bar on stderr, drawn only when stderr is a terminal. Not thread-safe.
class ProgressBar {
 public:
  ProgressBar(std::string label, uint64_t total, bool enabled);
  ~ProgressBar();
  void SetTotal(uint64_t total) { total_ = total; }
  void Update(uint64_t done);
  void Finish();

 private:
  std::string label_;
  uint64_t total_;
  bool enabled_;
  int last_percent_ = -1;
  bool finished_ = false;
};

bool StderrIsTerminal();

}  // namespace ckpt::cli

#endif  // CKPT_CLI_COMMON_H_
