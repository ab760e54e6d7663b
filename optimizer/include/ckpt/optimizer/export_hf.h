// Export of a committed step to HuggingFace safetensors (what `ckpt-tool export-hf` and the
// demo trainer run): the model tensors of a Checkpointer step (every tensor outside
// optimizer.*), or their FP32 masters, in the dtype asked for, streamed from the step's chunks
// into the safetensors files in pieces, so memory stays bounded whatever the model's size.
#ifndef CKPT_OPTIMIZER_EXPORT_HF_H_
#define CKPT_OPTIMIZER_EXPORT_HF_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "ckpt/checkpoint_reader.h"
#include "ckpt/env.h"
#include "ckpt/formats/dtype.h"

namespace ckpt::optimizer {

enum class ExportFrom {
  kWeights,  // The model-dtype weights the trainer's parameters held.
  kMasters,  // The FP32 masters (optimizer.master.<name>).
};

struct ExportHfOptions {
  Env* env = nullptr;  // Where the output goes; null: Env::Default().
  ExportFrom from = ExportFrom::kWeights;
  // kF32, kBF16 or kF16 (FP32 rounds to nearest even, 16-bit widens exactly); nullopt writes
  // weights in their own dtype and masters in F32.
  std::optional<formats::DType> dtype = std::nullopt;
  // Files of at most this many data bytes plus model.safetensors.index.json; 0 or a model that
  // fits writes one model.safetensors.
  uint64_t max_shard_bytes = uint64_t{5} << 30;
  // A config.json (a JSON object; at most 16 MiB) copied beside the weights, so that
  // transformers' from_pretrained loads the directory; empty: none.
  std::string config;
  // Bytes converted and written at a time: with the reader's buffers, the memory the export
  // holds.
  uint64_t buffer_bytes = uint64_t{32} << 20;
  // Called as data is written: bytes written so far, and the total.
  std::function<void(uint64_t done, uint64_t total)> progress = nullptr;
};

struct ExportHfReport {
  uint64_t tensors = 0;
  uint64_t bytes = 0;  // Tensor data written.
  bool sharded = false;
};

// Writes the model of `step` as a new directory `out_dir`: built under a hidden sibling name
// and renamed into place when complete and durable, so that it holds the whole model or is
// absent (an empty directory there is replaced). kFailedPrecondition when `out_dir` exists and
// is not an empty directory; kInvalidArgument when it lies inside the step's store, for a
// dtype conversion of a tensor that is not F32, BF16 or F16, or a config that is not one JSON
// object; kNotFound when the step has no model tensors, no masters for one with kMasters, or
// the config is missing; kDataLoss naming file and chunk for a damaged step; IO errors as they
// come. On failure nothing is left at `out_dir`.
absl::StatusOr<ExportHfReport> ExportHf(const CheckpointReader& step, const std::string& out_dir,
                                        const ExportHfOptions& options = {});

}  // namespace ckpt::optimizer

#endif  // CKPT_OPTIMIZER_EXPORT_HF_H_
