// ckpt-tool on HuggingFace checkpoints: inspect, verify and reshard a .safetensors file or a
// model directory.
#ifndef CKPT_CLI_HF_H_
#define CKPT_CLI_HF_H_

#include <string>

namespace ckpt::cli {

// True when `path` is a .safetensors file or a directory holding model.safetensors or
// model.safetensors.index.json (rather than a ckpt root).
bool IsHfPath(const std::string& path);
int InspectHf(const std::string& path, bool json);
int VerifyHf(const std::string& path, bool json);

}  // namespace ckpt::cli

#endif  // CKPT_CLI_HF_H_
