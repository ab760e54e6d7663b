#include "ckpt/tensor_source.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "ckpt/base/status_macros.h"
#include "ckpt/formats/convert.h"
#include "ckpt/formats/safetensors.h"

namespace ckpt {
namespace {

// Elements widened per read when a step stores a floating tensor in 16 bits.
constexpr uint64_t kWidenElems = uint64_t{1} << 20;

class HfSource : public TensorSource {
 public:
  explicit HfSource(std::unique_ptr<HfCheckpointReader> reader) : reader_(std::move(reader)) {
    for (const HfTensor& t : reader_->tensors()) {
      SourceTensor& out = tensors_[t.name];
      out.dtype_name = std::string(formats::StDTypeName(t.dtype));
      absl::StatusOr<formats::DType> d = formats::FromStDType(t.dtype);
      if (d.ok()) out.dtype = *d;
      out.shape = t.shape;
      out.numel = t.numel;
      out.byte_size = t.byte_size;
      out.element_bytes = t.numel == 0 ? 0 : t.byte_size / t.numel;
      if (out.element_bytes * t.numel != t.byte_size) out.element_bytes = 0;  // Sub-byte.
    }
  }
  std::string Describe() const override { return absl::StrCat("HF ", reader_->path()); }
  absl::Status CheckCovers(const std::string&, uint64_t, uint64_t) const override {
    return absl::OkStatus();  // An HF tensor is whole.
  }
  absl::Status ReadF32(std::span<const F32Request> requests) const override {
    return reader_->ReadManyAsF32(requests);
  }
  absl::Status ReadBytes(const std::string& name, uint64_t begin, uint64_t count,
                         std::span<std::byte> out) const override {
    return reader_->ReadBytes(name, begin, count, out);
  }

 private:
  std::unique_ptr<HfCheckpointReader> reader_;
};

class StepSource : public TensorSource {
 public:
  StepSource(std::string root, std::unique_ptr<CheckpointStore> owned,
             std::unique_ptr<CheckpointReader> reader, const NameFilter& keep)
      : root_(std::move(root)), owned_(std::move(owned)), reader_(std::move(reader)) {
    for (const formats::TensorInfo& t : reader_->manifest().tensors) {
      if (keep && !keep(t.name)) continue;
      SourceTensor& out = tensors_[t.name];
      out.dtype_name = std::string(formats::DTypeName(t.dtype));
      out.dtype = t.dtype;
      out.shape = t.shape;
      out.numel = t.numel();
      out.element_bytes = formats::DTypeSize(t.dtype);
      out.byte_size = out.numel * out.element_bytes;
    }
  }
  std::string Describe() const override {
    return absl::StrCat("step ", reader_->step(), " of ", root_);
  }
  absl::Status CheckCovers(const std::string& name, uint64_t begin,
                           uint64_t count) const override {
    if (reader_->Covers(name, begin, count)) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(Describe(), " does not cover elements [", begin,
                                                   ", ", begin + count, ") of \"", name, "\""));
  }
  absl::Status ReadF32(std::span<const F32Request> requests) const override {
    std::vector<std::byte> narrow;
    for (const F32Request& r : requests) {
      auto found = tensors_.find(r.name);
      if (found == tensors_.end() || !found->second.floating()) {
        return absl::InvalidArgumentError(absl::StrCat(
            Describe(), ": \"", r.name, "\" is not a F32, BF16 or F16 tensor of the source"));
      }
      const formats::DType d = *found->second.dtype;
      if (r.out.size() != r.count) {
        return absl::InvalidArgumentError(absl::StrCat("\"", r.name, "\": ", r.count,
                                                       " elements asked into ", r.out.size()));
      }
      if (d == formats::DType::kF32) {
        CKPT_RETURN_IF_ERROR(
            reader_->ReadRange(r.name, r.begin, r.count, std::as_writable_bytes(r.out)));
        continue;
      }
      const size_t size = formats::DTypeSize(d);
      for (uint64_t done = 0; done < r.count; done += kWidenElems) {
        const uint64_t n = std::min(kWidenElems, r.count - done);
        narrow.resize(n * size);
        CKPT_RETURN_IF_ERROR(reader_->ReadRange(r.name, r.begin + done, n, narrow));
        formats::Convert(d, narrow, formats::DType::kF32,
                         std::as_writable_bytes(r.out.subspan(done, n)));
      }
    }
    return absl::OkStatus();
  }
  absl::Status ReadBytes(const std::string& name, uint64_t begin, uint64_t count,
                         std::span<std::byte> out) const override {
    return reader_->ReadRange(name, begin, count, out);
  }

 private:
  const std::string root_;
  std::unique_ptr<CheckpointStore> owned_;  // Null when the caller's store outlives the source.
  std::unique_ptr<CheckpointReader> reader_;
};

}  // namespace

bool SourceTensor::floating() const {
  return dtype.has_value() && formats::IsFloatDType(*dtype);
}

absl::StatusOr<std::unique_ptr<TensorSource>> TensorSource::OpenHf(const std::string& path,
                                                                   Env* env) {
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<HfCheckpointReader> reader,
                        HfCheckpointReader::Open(path, {.env = env}));
  return std::unique_ptr<TensorSource>(new HfSource(std::move(reader)));
}

absl::StatusOr<std::unique_ptr<TensorSource>> TensorSource::OpenStep(const CheckpointStore& store,
                                                                     uint64_t step,
                                                                     NameFilter keep) {
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> reader, store.OpenStep(step));
  return std::unique_ptr<TensorSource>(
      new StepSource(store.root(), nullptr, std::move(reader), keep));
}

absl::StatusOr<std::unique_ptr<TensorSource>> TensorSource::OpenRoot(const std::string& root,
                                                                     std::optional<uint64_t> step,
                                                                     StoreOptions options) {
  options.primary = false;
  options.read_only = true;
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointStore> store,
                        CheckpointStore::Open(root, options));
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> reader,
                        step.has_value() ? store->OpenStep(*step) : store->OpenLatest());
  const std::string resolved = store->root();
  return std::unique_ptr<TensorSource>(
      new StepSource(resolved, std::move(store), std::move(reader), nullptr));
}

}  // namespace ckpt
