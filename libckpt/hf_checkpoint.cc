// Reading and writing HuggingFace checkpoints through the Env.
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
#include "ckpt/formats/convert.h"
#include "libckpt/aligned_buffer.h"
#include "libckpt/read_pipeline.h"

namespace ckpt {
namespace {

using formats::StDType;
using internal::AlignedBuffer;
using internal::kDirectIoAlignment;

constexpr uint64_t kSliceBytes = uint64_t{8} << 20;
static_assert(std::endian::native == std::endian::little, "safetensors data is little-endian");

absl::Status WriteWhole(Env* env, const std::string& dir, const std::string& name,
                        const std::vector<std::span<const std::byte>>& parts) {
  // A dot-name tmp, so that a crash never leaves a half file under a name transformers reads.
  return WriteFileViaTmp(env, JoinPath(dir, absl::StrCat(".", name, ".tmp")), JoinPath(dir, name),
                         parts, FileOptions{.direct_io = true});
}

}  // namespace

struct HfCheckpointReader::Shard {
  std::string path;
  std::unique_ptr<RandomAccessFile> file;
};

HfCheckpointReader::HfCheckpointReader() = default;
HfCheckpointReader::~HfCheckpointReader() = default;

absl::Status HfCheckpointReader::OpenShard(const std::string& name, const std::string& file_path) {
  auto shard = std::make_unique<Shard>();
  shard->path = file_path;
  CKPT_ASSIGN_OR_RETURN(shard->file,
                        env_->NewRandomAccessFile(file_path, FileOptions{.direct_io = true}));
  const uint64_t size = shard->file->size();
  std::byte prefix[8] = {};
  CKPT_RETURN_IF_ERROR(
      shard->file->Read(0, std::span<std::byte>(prefix, std::min<uint64_t>(8, size))));
  CKPT_ASSIGN_OR_RETURN(
      uint64_t n,
      formats::ParseSafetensorsPrefix(
          std::span<const std::byte>(prefix, std::min<uint64_t>(8, size)), size, file_path));
  std::string header(n, '\0');
  CKPT_RETURN_IF_ERROR(shard->file->Read(8, std::as_writable_bytes(std::span(header))));
  CKPT_ASSIGN_OR_RETURN(formats::SafetensorsHeader h,
                        formats::ParseSafetensorsHeader(AsBytes(header), size, file_path));
  for (formats::SafetensorsTensor& t : h.tensors) {
    tensors_.push_back(
        {t.name, t.dtype, t.shape, name, h.data_offset + t.begin, t.end - t.begin, t.numel()});
  }
  shard_metadata_[name] = std::move(h.metadata);
  shards_[name] = std::move(shard);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<HfCheckpointReader>> HfCheckpointReader::Open(
    const std::string& path, const HfReaderOptions& options) {
  std::unique_ptr<HfCheckpointReader> r(new HfCheckpointReader());
  r->path_ = path;
  r->options_ = options;
  r->env_ = options.env != nullptr ? options.env : Env::Default();
  // The type of what `path` resolves to: a model directory given as a link is a directory.
  // Names stay as given (a cached model's file links to a blob named by its hash).
  CKPT_ASSIGN_OR_RETURN(std::string real, r->env_->RealPath(path));
  CKPT_ASSIGN_OR_RETURN(bool is_dir, r->env_->IsDirectory(real));
  if (!is_dir) {
    CKPT_RETURN_IF_ERROR(
        r->OpenShard(std::string(absl::string_view(path).substr(path.rfind('/') + 1)), path));
  } else {
    const std::string index_path = JoinPath(path, kHfIndexFileName);
    absl::StatusOr<std::string> index_bytes =
        ReadFileToString(r->env_, index_path, formats::kMaxSafetensorsHeaderBytes);
    if (index_bytes.ok()) {
      CKPT_ASSIGN_OR_RETURN(formats::HfIndex index,
                            formats::ParseHfIndex(AsBytes(*index_bytes), index_path));
      for (const std::string& shard : index.shards()) {
        absl::Status s = r->OpenShard(shard, JoinPath(path, shard));
        if (absl::IsNotFound(s)) {
          return absl::DataLossError(
              absl::StrCat(index_path, ": MissingShard: shard \"", shard, "\" does not exist"));
        }
        CKPT_RETURN_IF_ERROR(s);
      }
      std::map<std::string, std::string> expected(index.weight_map.begin(), index.weight_map.end());
      std::set<std::string> seen;
      for (const HfTensor& t : r->tensors_) {
        auto it = expected.find(t.name);
        if (it == expected.end()) {
          return absl::DataLossError(absl::StrCat(index_path, ": UnlistedTensor: tensor \"", t.name,
                                                  "\" in shard ", t.shard,
                                                  " is not in weight_map"));
        }
        if (!seen.insert(t.name).second) {
          return absl::DataLossError(absl::StrCat(index_path, ": DuplicateTensor: tensor \"",
                                                  t.name, "\" is stored in more than one shard"));
        }
        if (it->second != t.shard) {
          return absl::DataLossError(absl::StrCat(index_path, ": WrongShard: tensor \"", t.name,
                                                  "\" is in ", t.shard, " but weight_map says ",
                                                  it->second));
        }
      }
      for (const auto& [tensor, shard] : expected) {
        if (!seen.count(tensor)) {
          return absl::DataLossError(absl::StrCat(index_path, ": MissingTensor: tensor \"", tensor,
                                                  "\" is not in shard ", shard));
        }
      }
      r->index_ = std::move(index);
    } else if (absl::IsNotFound(index_bytes.status())) {
      absl::Status s =
          r->OpenShard(std::string(kHfSingleFileName), JoinPath(path, kHfSingleFileName));
      if (absl::IsNotFound(s)) {
        return absl::NotFoundError(
            absl::StrCat(path, ": neither ", kHfIndexFileName, " nor ", kHfSingleFileName));
      }
      CKPT_RETURN_IF_ERROR(s);
    } else {
      return index_bytes.status();
    }
  }
  std::sort(r->tensors_.begin(), r->tensors_.end(),
            [](const HfTensor& a, const HfTensor& b) { return a.name < b.name; });
  return r;
}

absl::StatusOr<const HfTensor*> HfCheckpointReader::Find(absl::string_view name) const {
  auto it = std::lower_bound(tensors_.begin(), tensors_.end(), name,
                             [](const HfTensor& t, absl::string_view n) { return t.name < n; });
  if (it == tensors_.end() || it->name != name) {
    return absl::NotFoundError(absl::StrCat(path_, ": no tensor \"", name, "\""));
  }
  return &*it;
}

// Read plan. Jobs are sorted by (shard, offset) and merged into extents wherever they touch or
// overlap (a loader's tensors usually tile the file). Each extent is cut into slices on the
// file's absolute kSliceBytes grid, so requests are 8 MiB (split by the Env into 1 MiB reads)
// at aligned offsets however the tensors fall, and the page shared by two tensors is read once.
// A grid line that would split an element of a job is moved up to that element's end (at most
// 3 bytes, inside the same 4 KiB page), so every consume() sees whole elements.
absl::Status HfCheckpointReader::ReadJobs(const std::vector<Job>& jobs) const {
  std::vector<size_t> order(jobs.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    if (jobs[a].shard != jobs[b].shard)
      return std::less<const Shard*>()(jobs[a].shard, jobs[b].shard);
    return jobs[a].offset < jobs[b].offset;
  });
  struct Slice {
    const Shard* shard;
    uint64_t begin, end;         // Absolute bytes of the shard this slice delivers.
    size_t first_job, last_job;  // Range of `order` that may overlap it.
  };
  std::vector<Slice> slices;
  for (size_t i = 0; i < order.size();) {
    if (jobs[order[i]].length == 0) {
      ++i;
      continue;
    }
    const Shard* shard = jobs[order[i]].shard;
    const uint64_t lo = jobs[order[i]].offset;
    uint64_t hi = lo + jobs[order[i]].length;
    size_t j = i + 1;
    for (; j < order.size() && jobs[order[j]].shard == shard && jobs[order[j]].offset <= hi; ++j) {
      hi = std::max(hi, jobs[order[j]].offset + jobs[order[j]].length);
    }
    // Grid lines inside (lo, hi), each moved past any element it would split. `k` walks the
    // jobs: those before it end at or before the current slice's start (prefix maximum).
    uint64_t begin = lo, ends_before = 0;
    size_t k = i;
    for (uint64_t line = (lo / kSliceBytes + 1) * kSliceBytes; begin < hi; line += kSliceBytes) {
      while (k < j &&
             std::max(ends_before, jobs[order[k]].offset + jobs[order[k]].length) <= begin) {
        ends_before = std::max(ends_before, jobs[order[k]].offset + jobs[order[k]].length);
        ++k;
      }
      uint64_t cut = std::min(line, hi);
      size_t last = k;
      for (; last < j && jobs[order[last]].offset < cut; ++last) {
        const Job& job = jobs[order[last]];
        if (cut < job.offset + job.length) {
          cut = job.offset + RoundUp(cut - job.offset, job.element_bytes);
        }
      }
      slices.push_back({shard, begin, cut, k, last});
      begin = cut;
    }
    i = j;
  }
  // Widened to 4 KiB boundaries so every read takes the O_DIRECT path.
  std::vector<internal::PipelinedRead> reads;
  for (const Slice& slice : slices) {
    const uint64_t lo = slice.begin / kDirectIoAlignment * kDirectIoAlignment;
    const uint64_t hi = std::min(slice.shard->file->size(), RoundUp(slice.end, kDirectIoAlignment));
    reads.push_back({slice.shard->file.get(), lo, hi - lo});
  }
  return internal::RunReadPipeline(
      reads, options_.read_threads, [&](size_t i, std::span<const std::byte> bytes) {
        const Slice& slice = slices[i];
        for (size_t k = slice.first_job; k < slice.last_job; ++k) {
          const Job& job = jobs[order[k]];
          const uint64_t a = std::max(job.offset, slice.begin);
          const uint64_t b = std::min(job.offset + job.length, slice.end);
          if (a < b) job.consume(a - job.offset, bytes.subspan(a - reads[i].offset, b - a));
        }
        return absl::OkStatus();
      });
}

absl::Status HfCheckpointReader::ReadBytes(absl::string_view name, uint64_t begin, uint64_t count,
                                           std::span<std::byte> out) const {
  CKPT_ASSIGN_OR_RETURN(const HfTensor* t, Find(name));
  const uint32_t bits = formats::StDTypeBits(t->dtype);
  if (begin > t->numel || count > t->numel - begin) {
    return absl::InvalidArgumentError(absl::StrCat("range [", begin, ", +", count, ") of \"", name,
                                                   "\" lies outside its ", t->numel, " elements"));
  }
  uint64_t offset, length;
  if (bits % 8 == 0) {
    offset = begin * (bits / 8);
    length = count * (bits / 8);
  } else if (begin == 0 && count == t->numel) {
    offset = 0;
    length = t->byte_size;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("\"", name, "\" has sub-byte dtype ",
                                                   formats::StDTypeName(t->dtype),
                                                   "; only whole-tensor reads"));
  }
  if (out.size() != length) {
    return absl::InvalidArgumentError(
        absl::StrCat("output for \"", name, "\" has ", out.size(), " bytes, expected ", length));
  }
  return ReadJobs({Job{shards_.at(t->shard).get(), t->file_offset + offset, length, 1,
                       [&](uint64_t pos, std::span<const std::byte> bytes) {
                         std::memcpy(out.data() + pos, bytes.data(), bytes.size());
                       }}});
}

absl::StatusOr<HfCheckpointReader::Job> HfCheckpointReader::F32Job(const F32Request& r) const {
  CKPT_ASSIGN_OR_RETURN(const HfTensor* t, Find(r.name));
  if (t->dtype != StDType::kF32 && t->dtype != StDType::kBF16 && t->dtype != StDType::kF16) {
    return absl::InvalidArgumentError(absl::StrCat("\"", r.name, "\" is ",
                                                   formats::StDTypeName(t->dtype),
                                                   "; FP32 reads take F32, BF16 or F16"));
  }
  if (r.begin > t->numel || r.count > t->numel - r.begin || r.out.size() != r.count) {
    return absl::InvalidArgumentError(
        absl::StrCat("range [", r.begin, ", +", r.count, ") of \"", r.name, "\" or its ",
                     r.out.size(), "-element output does not fit its ", t->numel, " elements"));
  }
  const uint64_t esize = formats::StDTypeBits(t->dtype) / 8;
  const formats::DType dtype = formats::FromStDType(t->dtype).value();  // F32, BF16 or F16.
  float* out = r.out.data();
  return Job{shards_.at(t->shard).get(), t->file_offset + r.begin * esize, r.count * esize, esize,
             [dtype, out, esize](uint64_t pos, std::span<const std::byte> bytes) {
               const size_t n = bytes.size() / esize;
               formats::Convert(dtype, bytes, formats::DType::kF32,
                                std::as_writable_bytes(std::span(out + pos / esize, n)));
             }};
}

absl::Status HfCheckpointReader::ReadAsF32(absl::string_view name, uint64_t begin, uint64_t count,
                                           std::span<float> out) const {
  F32Request request{std::string(name), begin, count, out};
  return ReadManyAsF32(std::span<const F32Request>(&request, 1));
}

absl::Status HfCheckpointReader::ReadManyAsF32(std::span<const F32Request> requests) const {
  std::vector<Job> jobs;
  for (const F32Request& r : requests) {
    CKPT_ASSIGN_OR_RETURN(Job job, F32Job(r));
    jobs.push_back(std::move(job));
  }
  return ReadJobs(jobs);
}

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
  std::set<std::string> names;
  for (const HfTensorSpec& t : tensors) {
    if (!names.insert(t.name).second)
      return absl::InvalidArgumentError(absl::StrCat("tensor \"", t.name, "\" appears twice"));
  }
  // Each tensor's byte size, from a header of its own (which also validates it).
  std::vector<uint64_t> sizes;
  for (const HfTensorSpec& t : tensors) {
    std::vector<formats::SafetensorsTensor> one = {{t.name, t.dtype, t.shape, 0, 0}};
    CKPT_RETURN_IF_ERROR(formats::EncodeSafetensorsHeader(&one, {}).status());
    sizes.push_back(one[0].end - one[0].begin);
  }
  // Plan: greedy shards in the given order.
  std::vector<std::vector<size_t>> shards(1);
  uint64_t current = 0, total = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const uint64_t bytes = sizes[i];
    if (options.max_shard_bytes > 0 && current > 0 && current + bytes > options.max_shard_bytes) {
      shards.emplace_back();
      current = 0;
    }
    shards.back().push_back(i);
    current += bytes;
    total += bytes;
  }
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
        index.weight_map.emplace_back(
            tensors[i].name, absl::StrFormat("model-%05d-of-%05d.safetensors", s + 1, shards.size()));
      }
    }
    headers.push_back(std::move(header));
  }
  // Step 1.
  absl::StatusOr<std::string> real = env->RealPath(dir);
  absl::StatusOr<bool> is_dir = real.ok() ? env->IsDirectory(*real) : real.status();
  if (absl::IsNotFound(is_dir.status())) {
    CKPT_RETURN_IF_ERROR(env->CreateDir(dir));
    CKPT_RETURN_IF_ERROR(env->SyncDir(Dirname(dir)));
  } else if (!is_dir.ok() || !*is_dir) {
    return is_dir.ok() ? absl::FailedPreconditionError(dir + ": not a directory") : is_dir.status();
  }
  // Step 2. One buffer, refilled piece by piece: bounded memory at any model size.
  std::vector<std::byte> buffer;
  uint64_t done = 0;
  for (size_t s = 0; s < shards.size(); ++s) {
    const std::string name =
        sharded ? absl::StrFormat("model-%05d-of-%05d.safetensors", s + 1, shards.size())
                : std::string(kHfSingleFileName);
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
