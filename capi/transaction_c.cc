// The C ABI's store transactions and readers (ckpt/ckpt.h, ABI 9): a caller's own tensors and
// blobs saved as one step through the store's save protocol (SaveTransaction), and committed
// steps read back by element range (CheckpointReader). Only marshalling lives here: the
// protocol is libckpt's.
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "capi/capi_internal.h"
#include "ckpt/checkpoint_reader.h"
#include "ckpt/checkpoint_store.h"
#include "ckpt/checkpoint_writer.h"
#include "ckpt/ckpt.h"
#include "ckpt/formats/dtype.h"

struct ckpt_save {
  // Declared first so that it is destroyed last: the transaction's destructor may still vote
  // (an abort) through it.
  std::unique_ptr<ckpt::capi::CallbackCoordinator> ranks;
  std::unique_ptr<ckpt::SaveTransaction> txn;
};

struct ckpt_reader {
  std::unique_ptr<ckpt::CheckpointReader> reader;
};

namespace {

using ckpt::capi::Fail;
using ckpt::capi::Guard;
using ckpt::capi::Invalid;
using ckpt::formats::DType;

// The ABI's dtype codes, in their order (CKPT_F32 = 0 ... CKPT_BOOL = 9).
constexpr DType kDTypes[] = {DType::kF32, DType::kBF16, DType::kF16, DType::kF64, DType::kI64,
                             DType::kI32, DType::kI16,  DType::kI8,  DType::kU8,  DType::kBool};

std::optional<DType> ToDType(int code) {
  if (code < 0 || code >= static_cast<int>(std::size(kDTypes))) return std::nullopt;
  return kDTypes[code];
}

int ToCode(DType dtype) {
  for (size_t i = 0; i < std::size(kDTypes); ++i) {
    if (kDTypes[i] == dtype) return static_cast<int>(i);
  }
  return -1;
}

// kInvalidArgument unless `bytes` is exactly `count` elements of `tensor`'s dtype.
absl::Status CheckBytes(absl::string_view tensor, DType dtype, uint64_t count, size_t bytes) {
  const size_t element = ckpt::formats::DTypeSize(dtype);
  if (count > SIZE_MAX / element || count * element != bytes) {
    return absl::InvalidArgumentError(absl::StrCat("tensor \"", tensor, "\": ", bytes,
                                                   " bytes is not ", count, " elements of ",
                                                   ckpt::formats::DTypeName(dtype)));
  }
  return absl::OkStatus();
}

}  // namespace

extern "C" {

int ckpt_save_begin(ckpt_store* store, uint64_t step, const ckpt_coordinator* coordinator,
                    ckpt_save** out) {
  return Guard("ckpt_save_begin", [&]() -> int {
    if (store == nullptr || out == nullptr) return Invalid("store or out is NULL");
    *out = nullptr;
    auto save = std::make_unique<ckpt_save>();
    if (coordinator != nullptr) {
      const absl::Status usable = ckpt::capi::CheckCoordinator(*coordinator);
      if (!usable.ok()) return Fail(usable);
      save->ranks = std::make_unique<ckpt::capi::CallbackCoordinator>(*coordinator);
    }
    absl::StatusOr<std::unique_ptr<ckpt::SaveTransaction>> txn =
        store->store->BeginSave(step, save->ranks.get());
    if (!txn.ok()) return Fail(txn.status());
    save->txn = *std::move(txn);
    *out = save.release();
    return CKPT_OK;
  });
}

int ckpt_save_declare(ckpt_save* save, const char* name, int dtype, const uint64_t* shape,
                      size_t ndim) {
  return Guard("ckpt_save_declare", [&]() -> int {
    if (save == nullptr || name == nullptr || (ndim > 0 && shape == nullptr)) {
      return Invalid("save, name or shape is NULL");
    }
    const std::optional<DType> type = ToDType(dtype);
    if (!type.has_value()) {
      return Invalid(absl::StrCat("tensor \"", name, "\": dtype code ", dtype, " is not one of ",
                                  "CKPT_F32 .. CKPT_BOOL"));
    }
    ckpt::TensorSpec spec{name, *type, std::vector<uint64_t>(shape, shape + ndim)};
    return ckpt::capi::Done(save->txn->DeclareTensor(spec));
  });
}

int ckpt_save_write(ckpt_save* save, const char* tensor, uint64_t begin, uint64_t count,
                    const void* data, size_t bytes) {
  return Guard("ckpt_save_write", [&]() -> int {
    if (save == nullptr || tensor == nullptr || (bytes > 0 && data == nullptr)) {
      return Invalid("save, tensor or data is NULL");
    }
    return ckpt::capi::Done(save->txn->WritePiece(
        tensor, begin, count, std::span(static_cast<const std::byte*>(data), bytes)));
  });
}

int ckpt_save_write_blob(ckpt_save* save, const char* name, const void* data, size_t bytes) {
  return Guard("ckpt_save_write_blob", [&]() -> int {
    if (save == nullptr || name == nullptr || (bytes > 0 && data == nullptr)) {
      return Invalid("save, name or data is NULL");
    }
    return ckpt::capi::Done(
        save->txn->WriteBlob(name, std::span(static_cast<const std::byte*>(data), bytes)));
  });
}

int ckpt_save_commit(ckpt_save* save) {
  return Guard("ckpt_save_commit", [&]() -> int {
    if (save == nullptr) return Invalid("save is NULL");
    return ckpt::capi::Done(save->txn->Commit());
  });
}

int ckpt_save_abort(ckpt_save* save) {
  return Guard("ckpt_save_abort", [&]() -> int {
    if (save == nullptr) return Invalid("save is NULL");
    return ckpt::capi::Done(save->txn->Abort());
  });
}

void ckpt_save_destroy(ckpt_save* save) {
  // The transaction's destructor aborts an unended save; nothing it reports can reach a caller.
  Guard("ckpt_save_destroy", [&]() -> int {
    delete save;
    return CKPT_OK;
  });
}

int ckpt_reader_open(const ckpt_store* store, uint64_t step, ckpt_reader** out) {
  return Guard("ckpt_reader_open", [&]() -> int {
    if (store == nullptr || out == nullptr) return Invalid("store or out is NULL");
    *out = nullptr;
    absl::StatusOr<std::unique_ptr<ckpt::CheckpointReader>> reader = store->store->OpenStep(step);
    if (!reader.ok()) return Fail(reader.status());
    *out = new ckpt_reader{*std::move(reader)};
    return CKPT_OK;
  });
}

void ckpt_reader_close(ckpt_reader* reader) { delete reader; }

int ckpt_reader_tensor(const ckpt_reader* reader, const char* name, int* dtype, uint64_t* shape,
                       size_t max_ndim, size_t* ndim) {
  return Guard("ckpt_reader_tensor", [&]() -> int {
    if (reader == nullptr || name == nullptr || dtype == nullptr || ndim == nullptr ||
        (max_ndim > 0 && shape == nullptr)) {
      return Invalid("NULL argument");
    }
    absl::StatusOr<const ckpt::formats::TensorInfo*> info = reader->reader->FindTensor(name);
    if (!info.ok()) return Fail(info.status());
    *dtype = ToCode((*info)->dtype);
    *ndim = (*info)->shape.size();
    for (size_t d = 0; d < std::min(max_ndim, (*info)->shape.size()); ++d) {
      shape[d] = (*info)->shape[d];
    }
    return CKPT_OK;
  });
}

int ckpt_reader_read(const ckpt_reader* reader, const char* tensor, uint64_t begin,
                     uint64_t count, void* out, size_t bytes) {
  return Guard("ckpt_reader_read", [&]() -> int {
    if (reader == nullptr || tensor == nullptr || (bytes > 0 && out == nullptr)) {
      return Invalid("reader, tensor or out is NULL");
    }
    absl::StatusOr<const ckpt::formats::TensorInfo*> info = reader->reader->FindTensor(tensor);
    if (!info.ok()) return Fail(info.status());
    const absl::Status size = CheckBytes(tensor, (*info)->dtype, count, bytes);
    if (!size.ok()) return Fail(size);
    return ckpt::capi::Done(reader->reader->ReadRange(
        tensor, begin, count, std::span(static_cast<std::byte*>(out), bytes)));
  });
}

int ckpt_reader_read_many(const ckpt_reader* reader, size_t n, const char* const* tensors,
                          const uint64_t* begins, const uint64_t* counts, void* const* outs,
                          const size_t* bytes) {
  return Guard("ckpt_reader_read_many", [&]() -> int {
    if (reader == nullptr || (n > 0 && (tensors == nullptr || begins == nullptr ||
                                        counts == nullptr || outs == nullptr ||
                                        bytes == nullptr))) {
      return Invalid("NULL argument");
    }
    std::vector<ckpt::CheckpointReader::RangeRead> ranges;
    ranges.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      if (tensors[i] == nullptr || (bytes[i] > 0 && outs[i] == nullptr)) {
        return Invalid(absl::StrCat("range ", i, ": tensor or out is NULL"));
      }
      absl::StatusOr<const ckpt::formats::TensorInfo*> info =
          reader->reader->FindTensor(tensors[i]);
      if (!info.ok()) return Fail(info.status());
      const absl::Status size = CheckBytes(tensors[i], (*info)->dtype, counts[i], bytes[i]);
      if (!size.ok()) return Fail(size);
      ranges.push_back({tensors[i], begins[i], counts[i],
                        std::span(static_cast<std::byte*>(outs[i]), bytes[i])});
    }
    return ckpt::capi::Done(reader->reader->ReadRanges(ranges));
  });
}

int ckpt_reader_blob(const ckpt_reader* reader, const char* name, uint32_t rank, void* out,
                     size_t capacity, size_t* len) {
  return Guard("ckpt_reader_blob", [&]() -> int {
    if (reader == nullptr || name == nullptr || len == nullptr) return Invalid("NULL argument");
    absl::StatusOr<std::string> blob = reader->reader->ReadBlob(name, rank);
    if (!blob.ok()) return Fail(blob.status());
    *len = blob->size();
    if (out == nullptr || capacity == 0) return CKPT_OK;  // Asked for the size only.
    if (capacity < blob->size()) {
      return Fail(absl::OutOfRangeError(absl::StrCat("blob \"", name, "\" holds ", blob->size(),
                                                     " bytes, more than the ", capacity,
                                                     " given")));
    }
    std::memcpy(out, blob->data(), blob->size());
    return CKPT_OK;
  });
}

}  // extern "C"
