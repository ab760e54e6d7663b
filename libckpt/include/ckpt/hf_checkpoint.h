// HuggingFace checkpoints on disk: a reader for a single .safetensors file or a model directory
// (model.safetensors, or model.safetensors.index.json with shards) that reads element ranges
// without loading whole files, and a writer that produces what transformers loads, with the
// same durability rules as our checkpoints. The byte-level rules live in
// ckpt/formats/safetensors.h.
#ifndef CKPT_HF_CHECKPOINT_H_
#define CKPT_HF_CHECKPOINT_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "ckpt/env.h"
#include "ckpt/formats/safetensors.h"

namespace ckpt {

inline constexpr absl::string_view kHfSingleFileName = "model.safetensors";
inline constexpr absl::string_view kHfIndexFileName = "model.safetensors.index.json";

struct HfTensor {
  std::string name;
  formats::StDType dtype = formats::StDType::kF32;
  std::vector<uint64_t> shape;
  std::string shard;         // File name relative to the model directory (or the file itself).
  uint64_t file_offset = 0;  // Absolute byte offset of the tensor's data in its shard.
  uint64_t byte_size = 0;
  uint64_t numel = 0;
};

struct HfReaderOptions {
  Env* env = nullptr;  // Null: Env::Default().
  // Threads that read and convert slices of one large range in parallel. Each uses an 8 MiB
  // bounce buffer from a process-wide pool (libckpt/bounce_pool.h) that keeps up to 16.
  int read_threads = 8;
};

// An opened, fully validated HF checkpoint. Safe for concurrent use.
class HfCheckpointReader {
 public:
  // `path` is a .safetensors file or a model directory. kNotFound when neither a
  // model.safetensors nor an index is there; kDataLoss naming the file and the rule for any
  // invalid header or index, or an index that disagrees with its shards (missing shard, tensor
  // in two shards, tensor the index does not list, listed tensor absent).
  static absl::StatusOr<std::unique_ptr<HfCheckpointReader>> Open(
      const std::string& path, const HfReaderOptions& options = {});
  ~HfCheckpointReader();

  const std::string& path() const { return path_; }
  bool sharded() const { return index_.has_value(); }
  const std::optional<formats::HfIndex>& index() const { return index_; }
  // Every tensor, sorted by name.
  const std::vector<HfTensor>& tensors() const { return tensors_; }
  // __metadata__ of each shard, by shard name.
  const std::map<std::string, std::map<std::string, std::string>>& shard_metadata() const {
    return shard_metadata_;
  }
  // kNotFound for an unknown name.
  absl::StatusOr<const HfTensor*> Find(absl::string_view name) const;

  // Copies the bytes of elements [begin, begin + count). kInvalidArgument for a range outside
  // the tensor, an output of the wrong size, or a sub-byte dtype (F4, F6) unless the range is
  // the whole tensor.
  absl::Status ReadBytes(absl::string_view name, uint64_t begin, uint64_t count,
                         std::span<std::byte> out) const;
  // Reads elements [begin, begin + count) converted to FP32 from BF16, F16 or F32.
  // kInvalidArgument for other dtypes and for bad ranges or sizes.
  absl::Status ReadAsF32(absl::string_view name, uint64_t begin, uint64_t count,
                         std::span<float> out) const;

  // Elements [begin, begin + count) of tensor `name`, converted into `out` (count floats).
  struct F32Request {
    std::string name;
    uint64_t begin = 0;
    uint64_t count = 0;
    std::span<float> out;
  };
  // Reads many ranges at once: their slices share one pool of reader threads, so a rank's
  // whole set of pieces streams without a pause between tensors. Errors as ReadAsF32; on
  // failure the outputs are unspecified.
  absl::Status ReadManyAsF32(std::span<const F32Request> requests) const;

 private:
  struct Shard;
  HfCheckpointReader();
  absl::Status OpenShard(const std::string& name, const std::string& file_path);
  // A byte range of a shard and what to do with each slice of it: consume(position in the
  // range, bytes), called with whole elements of `element_bytes` only.
  struct Job {
    const Shard* shard;
    uint64_t offset;
    uint64_t length;
    uint64_t element_bytes;
    std::function<void(uint64_t, std::span<const std::byte>)> consume;
  };
  // Reads every job in slices, in parallel, with O_DIRECT where it can.
  absl::Status ReadJobs(const std::vector<Job>& jobs) const;
  absl::StatusOr<Job> F32Job(const F32Request& request) const;

  std::string path_;
  HfReaderOptions options_;
  Env* env_ = nullptr;
  std::optional<formats::HfIndex> index_;
  std::map<std::string, std::unique_ptr<Shard>> shards_;
  std::map<std::string, std::map<std::string, std::string>> shard_metadata_;
  std::vector<HfTensor> tensors_;
};

struct HfTensorData {
  std::string name;
  formats::StDType dtype = formats::StDType::kF32;
  std::vector<uint64_t> shape;
  std::span<const std::byte> data;  // Exactly the tensor's bytes.
};

struct HfWriteOptions {
  Env* env = nullptr;  // Null: Env::Default().
  // 0 writes one model.safetensors; otherwise shards of at most this many data bytes (a larger
  // tensor gets a shard of its own) named model-0000i-of-0000n.safetensors, plus the index.
  uint64_t max_shard_bytes = 0;
  std::map<std::string, std::string> metadata = {{"format", "pt"}};
  // WriteHfCheckpointStreaming: bytes asked of `fill` at a time (the memory it holds), rounded
  // down to whole elements.
  uint64_t buffer_bytes = uint64_t{32} << 20;
  // Called after each piece is written with the data bytes written so far and the total.
  std::function<void(uint64_t done, uint64_t total)> progress = nullptr;
};

// A tensor to be written whose bytes come from a callback.
struct HfTensorSpec {
  std::string name;
  formats::StDType dtype = formats::StDType::kF32;
  std::vector<uint64_t> shape;
};
// Fills `out` with bytes [offset, offset + out.size()) of tensor `index` of the specs; an
// error ends the write. Called in file order, each tensor's bytes front to back, with whole
// elements (a sub-byte dtype's tensor whole).
using HfTensorFill =
    std::function<absl::Status(size_t index, uint64_t offset, std::span<std::byte> out)>;

// As WriteHfCheckpoint, with the tensors' bytes streamed from `fill` in pieces of
// options.buffer_bytes: memory does not grow with the model.
absl::Status WriteHfCheckpointStreaming(const std::string& dir,
                                        const std::vector<HfTensorSpec>& tensors,
                                        const HfTensorFill& fill,
                                        const HfWriteOptions& options = {});

// Writes `tensors` (in the given order) into directory `dir`, created if absent. Each file is
// written under a temporary name, synced, closed and renamed; the index last; then the
// directory is synced. A stale index or single file of the other layout is removed. On failure
// the temporary files are removed and files already renamed into place may remain.
// kInvalidArgument for repeated or invalid names or data of the wrong size.
absl::Status WriteHfCheckpoint(const std::string& dir, const std::vector<HfTensorData>& tensors,
                               const HfWriteOptions& options = {});

}  // namespace ckpt

#endif  // CKPT_HF_CHECKPOINT_H_
