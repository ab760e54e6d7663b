// Writing HuggingFace checkpoints through the Env (the reader is libckpt/hf/reader.cc).
//
// Write protocol (the same durability rules as our checkpoints):
// 1. Create the directory if absent; SyncDir(parent).
// 2. For each file (shards first, then the index): write "<dir>/.<name>.tmp", Append, Sync,
//    Close, rename to <name>. A reader never sees a partly written file under its real name.
// 3. Remove a stale index (single-file layout) or stale model.safetensors (sharded layout),
//    which would otherwise shadow or contradict what was written.
// 4. SyncDir(dir): the renames and removals are durable only now.
#include "ckpt/hf_checkpoint.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstring>
#include <set>
#include <thread>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "ckpt/base/coding.h"
#include "ckpt/base/status_macros.h"
#include "libckpt/aligned_buffer.h"

namespace ckpt {
namespace {

absl::Status WriteWhole(Env* env, const std::string& dir, const std::string& name,
                        const std::vector<std::span<const std::byte>>& parts) {
  // A dot-name tmp, so that a crash never leaves a half file under a name transformers reads.
  return WriteFileViaTmp(env, JoinPath(dir, absl::StrCat(".", name, ".tmp")), JoinPath(dir, name),
                         parts, FileOptions{.direct_io = true});
}

// Each tensor's byte size, from a header of its own (which also validates it);
// kInvalidArgument for a name that appears twice.
absl::StatusOr<std::vector<uint64_t>> TensorSizes(const std::vector<HfTensorSpec>& tensors) {
  std::set<std::string> names;
  for (const HfTensorSpec& t : tensors) {
    if (!names.insert(t.name).second)
      return absl::InvalidArgumentError(absl::StrCat("tensor \"", t.name, "\" appears twice"));
  }
  std::vector<uint64_t> sizes;
  for (const HfTensorSpec& t : tensors) {
    std::vector<formats::SafetensorsTensor> one = {{t.name, t.dtype, t.shape, 0, 0}};
    CKPT_RETURN_IF_ERROR(formats::EncodeSafetensorsHeader(&one, {}).status());
    sizes.push_back(one[0].end - one[0].begin);
  }
  return sizes;
}

// Greedy shards of tensors of `sizes` bytes, in the given order: each tensor index in one shard,
// a new shard begun where the next tensor would take the current past `max_shard_bytes` (0: one
// shard).
std::vector<std::vector<size_t>> PlanShards(const std::vector<uint64_t>& sizes,
                                            uint64_t max_shard_bytes) {
  std::vector<std::vector<size_t>> shards(1);
  uint64_t current = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    const uint64_t bytes = sizes[i];
    if (max_shard_bytes > 0 && current > 0 && current + bytes > max_shard_bytes) {
      shards.emplace_back();
      current = 0;
    }
    shards.back().push_back(i);
    current += bytes;
  }
  return shards;
}

std::string ShardFileName(size_t s, size_t count) {
  return absl::StrFormat("model-%05d-of-%05d.safetensors", s + 1, count);
}

// Step 1: `dir` created (and its parent synced) unless it is a directory already;
// kFailedPrecondition when it is something else.
absl::Status EnsureDirectory(Env* env, const std::string& dir) {
  absl::StatusOr<std::string> real = env->RealPath(dir);
  absl::StatusOr<bool> is_dir = real.ok() ? env->IsDirectory(*real) : real.status();
  if (absl::IsNotFound(is_dir.status())) {
    CKPT_RETURN_IF_ERROR(env->CreateDir(dir));
    CKPT_RETURN_IF_ERROR(env->SyncDir(Dirname(dir)));
  } else if (!is_dir.ok() || !*is_dir) {
    return is_dir.ok() ? absl::FailedPreconditionError(dir + ": not a directory") : is_dir.status();
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status WriteHfCheckpoint(const std::string& dir, const std::vector<HfTensorData>& tensors,
                               const HfWriteOptions& options) {
  std::vector<HfTensorSpec> specs;
  for (const HfTensorData& t : tensors) specs.push_back({t.name, t.dtype, t.shape});
  // Checked before anything is written (the streaming writer learns the sizes from the specs).
  for (const HfTensorData& t : tensors) {
    std::vector<formats::SafetensorsTensor> one = {{t.name, t.dtype, t.shape, 0, 0}};
    CKPT_RETURN_IF_ERROR(formats::EncodeSafetensorsHeader(&one, {}).status());
    if (one[0].end - one[0].begin != t.data.size()) {
      return absl::InvalidArgumentError(absl::StrCat("tensor \"", t.name, "\" has ", t.data.size(),
                                                     " bytes, its dtype and shape need ",
                                                     one[0].end - one[0].begin));
    }
  }
  // The data is in memory already: one piece per tensor.
  HfWriteOptions whole = options;
  whole.buffer_bytes = UINT64_MAX;
  return WriteHfCheckpointStreaming(
      dir, specs,
      [&](size_t index, uint64_t offset, std::span<std::byte> out) {
        std::memcpy(out.data(), tensors[index].data.data() + offset, out.size());
        return absl::OkStatus();
      },
      whole);
}

absl::Status WriteHfCheckpointStreaming(const std::string& dir,
                                        const std::vector<HfTensorSpec>& tensors,
                                        const HfTensorFill& fill, const HfWriteOptions& options) {
  Env* env = options.env != nullptr ? options.env : Env::Default();
  CKPT_ASSIGN_OR_RETURN(const std::vector<uint64_t> sizes, TensorSizes(tensors));
  const std::vector<std::vector<size_t>> shards = PlanShards(sizes, options.max_shard_bytes);
  uint64_t total = 0;
  for (uint64_t bytes : sizes) total += bytes;
  const bool sharded = options.max_shard_bytes > 0 && shards.size() > 1;
  // Validate every shard's header before touching the disk.
  std::vector<std::string> headers;
  formats::HfIndex index;
  index.total_size = total;
  for (size_t s = 0; s < shards.size(); ++s) {
    std::vector<formats::SafetensorsTensor> entries;
    for (size_t i : shards[s])
      entries.push_back({tensors[i].name, tensors[i].dtype, tensors[i].shape, 0, 0});
    CKPT_ASSIGN_OR_RETURN(std::string header,
                          formats::EncodeSafetensorsHeader(&entries, options.metadata));
    if (sharded) {
      for (size_t i : shards[s]) {
        index.weight_map.emplace_back(tensors[i].name, ShardFileName(s, shards.size()));
      }
    }
    headers.push_back(std::move(header));
  }
  // Step 1.
  CKPT_RETURN_IF_ERROR(EnsureDirectory(env, dir));
  // Step 2. One buffer, refilled piece by piece: bounded memory at any model size.
  std::vector<std::byte> buffer;
  uint64_t done = 0;
  for (size_t s = 0; s < shards.size(); ++s) {
    const std::string name =
        sharded ? ShardFileName(s, shards.size()) : std::string(kHfSingleFileName);
    auto write = [&](WritableFile& file) -> absl::Status {
      CKPT_RETURN_IF_ERROR(file.Append(AsBytes(headers[s])));
      for (size_t i : shards[s]) {
        const uint32_t bits = formats::StDTypeBits(tensors[i].dtype);
        // Whole elements per piece; a sub-byte tensor in one piece.
        uint64_t piece = bits % 8 != 0 ? sizes[i] : std::min(sizes[i], options.buffer_bytes);
        if (bits % 8 == 0) piece = std::max<uint64_t>(piece / (bits / 8) * (bits / 8), bits / 8);
        for (uint64_t at = 0; at < sizes[i]; at += piece) {
          const uint64_t n = std::min(piece, sizes[i] - at);
          if (buffer.size() < n) buffer.resize(n);
          const std::span<std::byte> out(buffer.data(), n);
          CKPT_RETURN_IF_ERROR(Annotate(fill(i, at, out),
                                        absl::StrCat("tensor \"", tensors[i].name, "\"")));
          CKPT_RETURN_IF_ERROR(file.Append(out));
          done += n;
          if (options.progress) options.progress(done, total);
        }
      }
      return absl::OkStatus();
    };
    // A dot-name tmp, so that a crash never leaves a half file under a name transformers reads.
    CKPT_RETURN_IF_ERROR(WriteFileViaTmpWith(env, JoinPath(dir, absl::StrCat(".", name, ".tmp")),
                                             JoinPath(dir, name), write,
                                             FileOptions{.direct_io = true}));
  }
  // Step 3.
  const std::string stale = JoinPath(dir, sharded ? kHfSingleFileName : kHfIndexFileName);
  if (sharded) {
    const std::string encoded = formats::EncodeHfIndex(index);
    CKPT_RETURN_IF_ERROR(WriteWhole(env, dir, std::string(kHfIndexFileName), {AsBytes(encoded)}));
  }
  absl::Status removed = env->RemoveFile(stale);
  if (!removed.ok() && !absl::IsNotFound(removed)) return removed;
  // Step 4.
  return env->SyncDir(dir);
}

}  // namespace ckpt
