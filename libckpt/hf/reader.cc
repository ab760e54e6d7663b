// HfCheckpointReader: a .safetensors file or a model directory (model.safetensors, or an index
// and its shards, checked against each other by formats::CheckHfIndexAgainstShards), read by
// element range through the Env with O_DIRECT in slices planned by libckpt/hf/read_plan.h.
// The writer is libckpt/hf/writer.cc.
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
#include "libckpt/hf/read_plan.h"
#include "libckpt/read_pipeline.h"

namespace ckpt {
namespace {

using formats::StDType;
using internal::AlignedBuffer;
using internal::kDirectIoAlignment;

constexpr uint64_t kSliceBytes = uint64_t{8} << 20;
static_assert(std::endian::native == std::endian::little, "safetensors data is little-endian");

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
      std::vector<std::pair<std::string, std::string>> stored;
      for (const HfTensor& t : r->tensors_) stored.emplace_back(t.name, t.shard);
      CKPT_RETURN_IF_ERROR(formats::CheckHfIndexAgainstShards(index, stored, index_path));
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

// Reads the jobs' bytes in the slices PlanSlices cuts them into (libckpt/hf/read_plan.h: 8 MiB
// requests on each file's absolute grid, split by the Env into 1 MiB reads), widened to 4 KiB
// boundaries so every read takes the O_DIRECT path; each slice goes to the jobs it overlaps.
absl::Status HfCheckpointReader::ReadJobs(const std::vector<Job>& jobs) const {
  std::vector<const Shard*> files;
  std::map<const Shard*, size_t> file_of;
  std::vector<internal::ByteRange> ranges;
  for (const Job& job : jobs) {
    auto [it, added] = file_of.emplace(job.shard, files.size());
    if (added) files.push_back(job.shard);
    ranges.push_back({it->second, job.offset, job.length, job.element_bytes});
  }
  const internal::ReadPlan plan = internal::PlanSlices(ranges, kSliceBytes);
  std::vector<internal::PipelinedRead> reads;
  for (const internal::ReadPlan::Slice& slice : plan.slices) {
    const RandomAccessFile* file = files[slice.file]->file.get();
    const uint64_t lo = slice.begin / kDirectIoAlignment * kDirectIoAlignment;
    const uint64_t hi = std::min(file->size(), RoundUp(slice.end, kDirectIoAlignment));
    reads.push_back({file, lo, hi - lo});
  }
  return internal::RunReadPipeline(
      env_, reads, options_.read_threads, [&](size_t i, std::span<const std::byte> bytes) {
        const internal::ReadPlan::Slice& slice = plan.slices[i];
        for (size_t k = slice.first; k < slice.last; ++k) {
          const Job& job = jobs[plan.order[k]];
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

}  // namespace ckpt
