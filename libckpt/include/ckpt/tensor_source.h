// TensorSource: named tensors read by element range from either kind of checkpoint ckpt reads: a
// committed step of a ckpt root, or a HuggingFace checkpoint (a .safetensors file, or a model
// directory with model.safetensors or its index). The one "tensor source" of `ckpt-tool diff` and
// the model-only load (Checkpointer::LoadModel). Reads are safe for concurrent use.
#ifndef CKPT_TENSOR_SOURCE_H_
#define CKPT_TENSOR_SOURCE_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "ckpt/checkpoint_store.h"
#include "ckpt/env.h"
#include "ckpt/formats/dtype.h"
#include "ckpt/hf_checkpoint.h"

namespace ckpt {

struct SourceTensor {
  std::string dtype_name;               // "F32", "BF16", "I64", "F8_E4M3", ...
  std::optional<formats::DType> dtype;  // nullopt: a safetensors dtype ckpt does not store.
  std::vector<uint64_t> shape;
  uint64_t numel = 0;
  size_t element_bytes = 0;  // 0 for sub-byte dtypes (read whole, as bytes).
  uint64_t byte_size = 0;
  // F32, BF16 or F16: readable as FP32 (ReadF32).
  bool floating() const;
};

class TensorSource {
 public:
  using F32Request = HfCheckpointReader::F32Request;

  // The HF checkpoint at `path`. Errors as HfCheckpointReader::Open.
  static absl::StatusOr<std::unique_ptr<TensorSource>> OpenHf(const std::string& path, Env* env);
  // Which of a step's tensors a source shows (by name); empty: all of them.
  using NameFilter = std::function<bool(absl::string_view name)>;
  // Step `step` of `store` (which must outlive the source), showing the tensors `keep` accepts
  // (the store does not know whose names are whose: the caller says, e.g. the model's tensors
  // and not the optimizer's). Errors as CheckpointStore::OpenStep.
  static absl::StatusOr<std::unique_ptr<TensorSource>> OpenStep(const CheckpointStore& store,
                                                                uint64_t step,
                                                                NameFilter keep = nullptr);
  // Step `step` (LATEST when nullopt) of the ckpt root at `root`, opened read-only (the source
  // owns the handle). kNotFound when the root has no committed step; errors as
  // CheckpointStore::Open and OpenStep.
  static absl::StatusOr<std::unique_ptr<TensorSource>> OpenRoot(const std::string& root,
                                                                std::optional<uint64_t> step,
                                                                StoreOptions options);
  virtual ~TensorSource() = default;

  // "HF <path>" or "step <n> of <root>", for messages.
  virtual std::string Describe() const = 0;
  const std::map<std::string, SourceTensor>& tensors() const { return tensors_; }
  // kInvalidArgument naming the elements when the source does not hold all of [begin, begin +
  // count) of `name` (a step's pieces may leave gaps; an HF tensor is whole).
  virtual absl::Status CheckCovers(const std::string& name, uint64_t begin,
                                   uint64_t count) const = 0;
  // Reads floating tensors' ranges as FP32 (widening exact). kInvalidArgument for another dtype
  // or a range outside the tensor; IO and damage as the readers report them. On failure the
  // outputs are unspecified.
  virtual absl::Status ReadF32(std::span<const F32Request> requests) const = 0;
  // Elements [begin, begin + count) of `name` as stored (a sub-byte tensor only whole).
  virtual absl::Status ReadBytes(const std::string& name, uint64_t begin, uint64_t count,
                                 std::span<std::byte> out) const = 0;

 protected:
  std::map<std::string, SourceTensor> tensors_;
};

}  // namespace ckpt

#endif  // CKPT_TENSOR_SOURCE_H_
