// Runs a command line and captures its exit code and combined output (CLI end-to-end tests).
#ifndef CKPT_TESTS_SUPPORT_RUN_COMMAND_H_
#define CKPT_TESTS_SUPPORT_RUN_COMMAND_H_

#include <string>

namespace ckpt::testing {

struct CommandResult {
  int exit_code;       // 128 + signal number when a signal ended it; -1 if it could not start.
  std::string output;  // stdout and stderr together.
};

CommandResult RunCommand(const std::string& command_line);

}  // namespace ckpt::testing

#endif  // CKPT_TESTS_SUPPORT_RUN_COMMAND_H_
