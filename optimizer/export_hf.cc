// ExportHf: a committed step's model as HuggingFace safetensors, streamed in bounded memory.
// The files are written as WriteHfCheckpointStreaming writes them (each under a temporary
// name, synced, renamed; the index last; the directory synced); config.json after them,
// atomically. Memory: one buffer of the source dtype and one of the output dtype, each at most
// options.buffer_bytes, plus the reader's chunk buffers.
#include "ckpt/optimizer/export_hf.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "ckpt/base/status_macros.h"
#include "ckpt/formats/float_convert.h"
#include "ckpt/formats/safetensors.h"
#include "ckpt/hf_checkpoint.h"
#include "optimizer/checkpointer_layout.h"

namespace ckpt::optimizer {
namespace {

using formats::DType;

constexpr uint64_t kMaxConfigBytes = uint64_t{16} << 20;

bool IsFloat(DType d) { return d == DType::kF32 || d == DType::kBF16 || d == DType::kF16; }

float ToFloat(DType d, const std::byte* p) {
  if (d == DType::kF32) {
    float f;
    std::memcpy(&f, p, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, p, 2);
  return d == DType::kBF16 ? formats::Bf16ToFloat(h) : formats::HalfToFloat(h);
}

void FromFloat(DType d, float f, std::byte* p) {
  if (d == DType::kF32) {
    std::memcpy(p, &f, 4);
    return;
  }
  const uint16_t h = d == DType::kBF16 ? formats::FloatToBf16(f) : formats::FloatToHalf(f);
  std::memcpy(p, &h, 2);
}

// One tensor of the export: where its values come from and what is written.
struct Entry {
  std::string name;    // In the output (the parameter's name).
  std::string source;  // In the step.
  DType from = DType::kF32;
  DType to = DType::kF32;
  std::vector<uint64_t> shape;
};

}  // namespace

absl::StatusOr<ExportHfReport> ExportHf(const CheckpointReader& step, const std::string& out_dir,
                                        const ExportHfOptions& options) {
  Env* env = options.env != nullptr ? options.env : Env::Default();
  const formats::Manifest& m = step.manifest();
  const std::string where = absl::StrCat("export of step ", m.step, " (", step.dir(), ")");
  if (options.dtype.has_value() && !IsFloat(*options.dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": export dtype ",
                                                   formats::DTypeName(*options.dtype),
                                                   " is not F32, BF16 or F16"));
  }
  std::vector<Entry> entries;
  for (const formats::TensorInfo& t : m.tensors) {
    if (t.name.rfind(internal::kOptimizerPrefix, 0) == 0) continue;
    Entry e{t.name, t.name, t.dtype, options.dtype.value_or(t.dtype), t.shape};
    if (options.from == ExportFrom::kMasters) {
      e.source = internal::kStatePrefixes[0] + t.name;
      absl::StatusOr<const formats::TensorInfo*> master = step.FindTensor(e.source);
      if (!master.ok()) {
        return absl::NotFoundError(absl::StrCat(where, ": no FP32 masters \"", e.source,
                                                "\" for \"", t.name,
                                                "\" (not an optimizer checkpoint?)"));
      }
      e.from = (*master)->dtype;
    }
    if (e.from != e.to && (!IsFloat(e.from) || !IsFloat(e.to))) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": \"", e.source, "\" is ",
                                                     formats::DTypeName(e.from),
                                                     ", which does not convert to ",
                                                     formats::DTypeName(e.to)));
    }
    entries.push_back(std::move(e));
  }
  if (entries.empty()) {
    return absl::NotFoundError(absl::StrCat(where, ": the step holds no model tensors"));
  }
  std::string config;
  if (!options.config.empty()) {
    CKPT_ASSIGN_OR_RETURN(config, ReadFileToString(env, options.config, kMaxConfigBytes));
    const nlohmann::json parsed =
        nlohmann::json::parse(config, nullptr, /*allow_exceptions=*/false);
    if (!parsed.is_object()) {
      return absl::InvalidArgumentError(
          absl::StrCat("config ", options.config, " is not a JSON object"));
    }
  }
  std::vector<HfTensorSpec> specs;
  for (const Entry& e : entries) specs.push_back({e.name, formats::ToStDType(e.to), e.shape});
  std::vector<std::byte> narrow;  // Source elements when they must be converted.
  auto fill = [&](size_t index, uint64_t offset, std::span<std::byte> out) -> absl::Status {
    const Entry& e = entries[index];
    const size_t out_size = formats::DTypeSize(e.to), in_size = formats::DTypeSize(e.from);
    const uint64_t begin = offset / out_size, count = out.size() / out_size;
    if (e.from == e.to) return step.ReadRange(e.source, begin, count, out);
    narrow.resize(count * in_size);
    CKPT_RETURN_IF_ERROR(step.ReadRange(e.source, begin, count, narrow));
    for (uint64_t i = 0; i < count; ++i) {
      FromFloat(e.to, ToFloat(e.from, narrow.data() + i * in_size), out.data() + i * out_size);
    }
    return absl::OkStatus();
  };
  HfWriteOptions write;
  write.env = env;
  write.max_shard_bytes = options.max_shard_bytes;
  write.buffer_bytes = options.buffer_bytes;
  write.progress = options.progress;
  CKPT_RETURN_IF_ERROR(Annotate(WriteHfCheckpointStreaming(out_dir, specs, fill, write), where));
  if (!config.empty()) {
    CKPT_RETURN_IF_ERROR(WriteFileAtomically(env, JoinPath(out_dir, "config.json"), config));
  }
  ExportHfReport report;
  report.tensors = entries.size();
  for (const Entry& e : entries) {
    uint64_t n = formats::DTypeSize(e.to);
    for (uint64_t d : e.shape) n *= d;
    report.bytes += n;
  }
  report.sharded = options.max_shard_bytes > 0 && report.bytes > options.max_shard_bytes &&
                   entries.size() > 1;
  return report;
}

}  // namespace ckpt::optimizer
