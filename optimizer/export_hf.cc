// ExportHf: a committed step's model as HuggingFace safetensors, streamed in bounded memory.
// 1. Refuse an output that exists and is not an empty directory, or that lies inside the
//    step's own store; check every tensor's conversion and the config, nothing written yet.
// 2. Build the directory under a hidden sibling name (optimizer/new_directory.h): the files as
//    WriteHfCheckpointStreaming writes them (each synced and renamed, the index last, the
//    directory synced), then config.json.
// 3. Rename it onto the output and sync the parent: a reader sees the whole model or nothing,
//    and two exports to one place cannot mix. Any failure removes the staging directory.
// Memory: one buffer of the source dtype and one of the output dtype, each at most
// options.buffer_bytes, plus the reader's chunk buffers.
#include "ckpt/optimizer/export_hf.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "ckpt/base/status_macros.h"
#include "ckpt/formats/convert.h"
#include "ckpt/formats/safetensors.h"
#include "ckpt/hf_checkpoint.h"
#include "optimizer/state_layout.h"
#include "optimizer/new_directory.h"

namespace ckpt::optimizer {
namespace {

using formats::DType;

constexpr uint64_t kMaxConfigBytes = uint64_t{16} << 20;

using formats::IsFloatDType;

// One tensor of the export: where its values come from and what is written.
struct Entry {
  std::string name;    // In the output (the parameter's name).
  std::string source;  // In the step.
  DType from = DType::kF32;
  DType to = DType::kF32;
  std::vector<uint64_t> shape;
};

// Step 1's check of the tensors: each model tensor of `step`, where its values come from and
// the dtype written; kInvalidArgument for one that cannot convert, kNotFound for missing masters
// or no model tensor at all, each naming `where`.
absl::StatusOr<std::vector<Entry>> PlanEntries(const CheckpointReader& step,
                                               const ExportHfOptions& options,
                                               const std::string& where) {
  std::vector<Entry> entries;
  for (const formats::TensorInfo& t : step.manifest().tensors) {
    if (t.name.rfind(internal::kOptimizerPrefix, 0) == 0) continue;
    Entry e{t.name, t.name, t.dtype, t.dtype, t.shape};
    // Masters are exported in FP32 unless told otherwise; weights in their own dtype.
    e.to = options.dtype.value_or(options.from == ExportFrom::kMasters ? DType::kF32 : t.dtype);
    if (options.from == ExportFrom::kMasters) {
      e.source = internal::StateTensorName(internal::kMasterKey, t.name);
      absl::StatusOr<const formats::TensorInfo*> master = step.FindTensor(e.source);
      if (!master.ok()) {
        return absl::NotFoundError(absl::StrCat(where, ": no FP32 masters \"", e.source,
                                                "\" for \"", t.name,
                                                "\" (not an optimizer checkpoint?)"));
      }
      e.from = (*master)->dtype;
    }
    if (e.from != e.to && (!IsFloatDType(e.from) || !IsFloatDType(e.to))) {
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
  return entries;
}

// Step 1's check of the config: the file at `path`, which must be one JSON object as Python's
// json.load reads it; kNotFound when it does not exist, kInvalidArgument otherwise.
absl::StatusOr<std::string> ReadConfig(Env* env, const std::string& path) {
  absl::StatusOr<std::string> read = ReadFileToString(env, path, kMaxConfigBytes);
  if (!read.ok()) {
    // A config too large or unreadable is a bad request, not damage of the step.
    return absl::Status(absl::IsNotFound(read.status()) ? absl::StatusCode::kNotFound
                                                        : absl::StatusCode::kInvalidArgument,
                        absl::StrCat("config: ", read.status().message()));
  }
  std::string config = *std::move(read);
  // What Python's json.load reads: one JSON object, no byte-order mark, no NUL.
  const bool clean =
      config.find('\0') == std::string::npos && config.rfind("\xEF\xBB\xBF", 0) != 0;
  const nlohmann::json parsed =
      nlohmann::json::parse(config, nullptr, /*allow_exceptions=*/false);
  if (!clean || !parsed.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config ", path,
        " is not one JSON object (as json.load reads it: no byte-order mark, no NUL)"));
  }
  return config;
}

}  // namespace

absl::StatusOr<ExportHfReport> ExportHf(const CheckpointReader& step, const std::string& out_dir,
                                        const ExportHfOptions& options) {
  Env* env = options.env != nullptr ? options.env : Env::Default();
  const formats::Manifest& m = step.manifest();
  const std::string where = absl::StrCat("export of step ", m.step, " (", step.dir(), ")");
  if (options.dtype.has_value() && !IsFloatDType(*options.dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": export dtype ",
                                                   formats::DTypeName(*options.dtype),
                                                   " is not F32, BF16 or F16"));
  }
  CKPT_ASSIGN_OR_RETURN(std::vector<Entry> entries, PlanEntries(step, options, where));
  std::string config;
  if (!options.config.empty()) {
    CKPT_ASSIGN_OR_RETURN(config, ReadConfig(env, options.config));
  }
  // Step 1: where the output goes.
  CKPT_RETURN_IF_ERROR(internal::CheckOutside(env, Dirname(step.dir()), out_dir, "export"));
  CKPT_ASSIGN_OR_RETURN(internal::NewDirectory target,
                        internal::NewDirectory::Plan(env, out_dir, "export"));
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
    formats::Convert(e.from, narrow, e.to, out);
    return absl::OkStatus();
  };
  HfWriteOptions write;
  write.env = env;
  write.max_shard_bytes = options.max_shard_bytes;
  write.buffer_bytes = options.buffer_bytes;
  write.progress = options.progress;
  // Steps 2 and 3.
  absl::Status written = Annotate(WriteHfCheckpointStreaming(target.staging(), specs, fill, write), where);
  if (written.ok() && !config.empty()) {
    written = WriteFileAtomically(env, JoinPath(target.staging(), "config.json"), config);
  }
  if (written.ok()) written = target.Publish(env);
  if (!written.ok()) {
    target.Discard(env);
    return written;
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
