// bench safetensors: writes a synthetic safetensors file with our writer, then reads every
// tensor into FP32 buffers through HfCheckpointReader and compares the rate (file bytes per
// second) with raw O_DIRECT reads of the same bytes measured in the same run.
//
// Measurement design. The disks this runs on (virtual volumes on shared hosts) change speed by 2x
// within seconds, and two files written one after the other can read at 2.3 and 1.5 GB/s for as
// long as they exist (where the host placed them). So the bound is taken on the same bytes at the
// same time: after the file is written, its tensors are read in kSafetensorsBatches batches of
// equal bytes, and each batch's byte range is also read raw (O_DIRECT, as many threads as the
// reader, each a contiguous part in 8 MiB requests, no conversion) right before or right after
// it, the first of the pair alternating by batch and round so that neither side is always the
// second read. The times of each side are summed. The caller reports the round with the median
// ratio.
#include <algorithm>
#include <chrono>
#include <memory>
#include <random>
#include <span>

#include "absl/strings/str_cat.h"
#include "ckpt/base/status_macros.h"
#include "ckpt/bench/store_bench.h"
#include "ckpt/hf_checkpoint.h"

namespace ckpt::bench {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// One round: write the file, then read it in batches, each raw and through the reader.
absl::StatusOr<SafetensorsRound> RunRound(Env* env, const std::string& dir,
                                          const std::vector<HfTensorData>& data,
                                          std::vector<std::vector<float>>& out, int threads,
                                          int round) {
  const std::string file = JoinPath(dir, kHfSingleFileName);
  CKPT_RETURN_IF_ERROR(WriteHfCheckpoint(dir, data));
  CKPT_ASSIGN_OR_RETURN(auto raw, env->NewRandomAccessFile(file, {.direct_io = true}));
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<HfCheckpointReader> reader,
                        HfCheckpointReader::Open(file, {.env = env, .read_threads = threads}));
  CKPT_ASSIGN_OR_RETURN(uint64_t file_bytes, env->GetFileSize(file));
  // Tensors in file order, cut into batches of (nearly) equal bytes.
  std::vector<size_t> order(data.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::vector<uint64_t> offsets(data.size());
  for (size_t i = 0; i < data.size(); ++i) {
    CKPT_ASSIGN_OR_RETURN(const HfTensor* t, reader->Find(data[i].name));
    offsets[i] = t->file_offset;
  }
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return offsets[a] < offsets[b]; });
  const int batches = std::min<int>(kSafetensorsBatches, static_cast<int>(data.size()));
  double raw_s = 0, read_s = 0;
  uint64_t raw_bytes = 0;
  for (int b = 0; b < batches; ++b) {
    const size_t first = order.size() * b / batches, last = order.size() * (b + 1) / batches;
    std::vector<HfCheckpointReader::F32Request> requests;
    for (size_t k = first; k < last; ++k) {
      const size_t i = order[k];
      requests.push_back({data[i].name, 0, out[i].size(), out[i]});
    }
    const uint64_t lo = offsets[order[first]] / 4096 * 4096;
    const uint64_t end = offsets[order[last - 1]] + data[order[last - 1]].data.size();
    const uint64_t hi = std::min(file_bytes, (end + 4095) / 4096 * 4096);
    raw_bytes += hi - lo;
    for (int side = 0; side < 2; ++side) {
      Clock::time_point start = Clock::now();
      if ((side + b + round) % 2 == 0) {
        CKPT_RETURN_IF_ERROR(RawReadOnGrid(*raw, lo, hi, threads));
        raw_s += Seconds(start);
      } else {
        CKPT_RETURN_IF_ERROR(reader->ReadManyAsF32(requests));
        read_s += Seconds(start);
      }
    }
  }
  return SafetensorsRound{static_cast<double>(file_bytes) / read_s / 1e9,
                          static_cast<double>(raw_bytes) / raw_s / 1e9, file_bytes};
}

bool Supported(formats::StDType dtype) {
  return dtype == formats::StDType::kBF16 || dtype == formats::StDType::kF16 ||
         dtype == formats::StDType::kF32;
}

}  // namespace

absl::StatusOr<SafetensorsFigures> RunSafetensorsBench(const SafetensorsBenchOptions& options) {
  if (!Supported(options.dtype)) {
    return absl::InvalidArgumentError(absl::StrCat("bench safetensors reads BF16, F16 or F32, not ",
                                                   formats::StDTypeName(options.dtype)));
  }
  if (options.tensors < 1 || options.elems_per_tensor < 1 || options.rounds < 1 ||
      options.threads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("bench safetensors needs at least one tensor, element, round and thread, not ",
                     options.tensors, ", ", options.elems_per_tensor, ", ", options.rounds, " and ",
                     options.threads));
  }
  Env* env = options.env != nullptr ? options.env : Env::Default();
  const uint64_t elems = options.elems_per_tensor;
  const uint64_t esize = formats::StDTypeBits(options.dtype) / 8;
  // One tensor's source bytes, shared by every tensor.
  std::vector<uint16_t> source(elems * esize / 2 + 1);
  std::mt19937 rng(1);
  for (uint16_t& x : source) {
    x = static_cast<uint16_t>(0x3c00 | (rng() & 0x03ff));  // Finite in every dtype.
  }
  std::vector<HfTensorData> data;
  for (int t = 0; t < options.tensors; ++t) {
    data.push_back({absl::StrCat("model.layers.", t, ".weight"),
                    options.dtype,
                    {elems},
                    std::as_bytes(std::span(source)).first(elems * esize)});
  }
  const std::string dir = JoinPath(options.dir, "ckpt-bench-safetensors");
  std::vector<std::vector<float>> out(static_cast<size_t>(options.tensors),
                                      std::vector<float>(elems));
  SafetensorsFigures figures;
  for (int r = 0; r < options.rounds; ++r) {
    absl::StatusOr<SafetensorsRound> round = RunRound(env, dir, data, out, options.threads, r);
    RemoveRecursively(env, dir).IgnoreError();  // Best effort: only benchmark output.
    if (!round.ok()) return round.status();
    figures.rounds.push_back(*round);
  }
  std::sort(
      figures.rounds.begin(), figures.rounds.end(),
      [](const SafetensorsRound& a, const SafetensorsRound& b) { return a.ratio() < b.ratio(); });
  return figures;
}

}  // namespace ckpt::bench
