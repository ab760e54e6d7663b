// The CUDA half of `ckpt-tool bench adamw`.
#include "absl/strings/str_cat.h"
#include "ckpt/optimizer/staged_adamw.h"
#include "cli/commands.h"

namespace ckpt::cli {

absl::StatusOr<nlohmann::json> BenchAdamwCuda(const BenchAdamwArgs& args) {
  // Creating the engine says why it cannot run (no CUDA in this build, no device).
  optimizer::StagedAdamWOptions o;
  o.params = {{"w", {args.params}, formats::DType::kBF16, 0}};
  o.groups = {optimizer::ParamGroup{}};
  o.pieces = {{0, 0, args.params}};
  o.engine = optimizer::EngineKind::kCuda;
  std::vector<uint16_t> weights(args.params, 0x3f00);
  auto opt = optimizer::StagedAdamW::Create(o, std::as_bytes(std::span(weights)));
  if (!opt.ok()) return opt.status();
  return absl::UnimplementedError("CUDA benchmark needs a CUDA build with ckpt_optimizer_cuda");
}

}  // namespace ckpt::cli
