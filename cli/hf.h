// ckpt-tool on HuggingFace checkpoints: inspect, verify and reshard a .safetensors file or a
// model directory; and the rule that tells an HF path from a ckpt root.
#ifndef CKPT_CLI_HF_H_
#define CKPT_CLI_HF_H_

#include <string>

#include "absl/status/statusor.h"

namespace ckpt::cli {

// What a path given to inspect or verify holds, decided by what is in it.
struct PathKind {
  bool hf = false;    // A .safetensors file, or a directory with model.safetensors or its index.
  bool ckpt = false;  // A directory with LATEST, LOCK, step, staging or quarantine entries.
};
// A regular file (links followed) is HF when it is named *.safetensors or begins like one; any
// other file is kInvalidArgument naming it. A directory holding both kinds says so (both
// true); an empty directory or one with neither is a (new) ckpt root. kNotFound when absent.
absl::StatusOr<PathKind> DetectPathKind(const std::string& path);
// DetectPathKind for a command: HF when it is only HF; with both, prints a note to stderr that
// the ckpt root is the one checked. kInvalidArgument and kNotFound as DetectPathKind.
absl::StatusOr<bool> TreatAsHf(const std::string& path, const char* command);
int InspectHf(const std::string& path, bool json);
int VerifyHf(const std::string& path, bool json);

}  // namespace ckpt::cli

#endif  // CKPT_CLI_HF_H_
