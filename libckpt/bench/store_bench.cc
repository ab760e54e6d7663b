// bench io: saves and loads synthetic state through the real store (ranks as threads) and, in
// the same run and directory, measures the raw O_DIRECT sequential write and read bandwidth
// that bounds them (DESIGN.md §8). Also the raw read on the readers' grid that bench
// safetensors pairs with its reads.
#include "ckpt/bench/store_bench.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <random>
#include <span>
#include <thread>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "ckpt/base/status_macros.h"
#include "ckpt/checkpoint_store.h"
#include "ckpt/coordinator.h"
#include "libckpt/aligned_buffer.h"
#include "libckpt/bounce_pool.h"

namespace ckpt::bench {
namespace {

using Clock = std::chrono::steady_clock;
using internal::AlignedBuffer;
constexpr uint64_t kPieceBytes = uint64_t{256} << 20;  // Each rank moves its range as pieces.
constexpr uint64_t kRawIoBytes = uint64_t{8} << 20;
constexpr int kLoadBatches = 8;

double Seconds(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

void Report(const PhaseProgress& progress, std::string_view phase, uint64_t done, uint64_t total) {
  if (progress) progress(phase, done, total);
}

// Fills with values shaped like trained weights: random mantissas, few distinct exponents.
void FillState(std::span<float> out, uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (size_t i = 0; i < out.size(); i += 2) {
    uint64_t r = rng();
    for (size_t k = 0; k < 2 && i + k < out.size(); ++k) {
      uint32_t bits = static_cast<uint32_t>(r >> (32 * k));
      uint32_t exponent = 120 + (bits & 3);
      uint32_t f = ((bits >> 31) << 31) | (exponent << 23) | ((bits >> 2) & 0x7fffff);
      std::memcpy(&out[i + k], &f, 4);
    }
  }
}

// Runs fn(rank) on `ranks` threads (rank 0 on the calling one) and returns the first error.
absl::Status RunRanks(int ranks, const std::function<absl::Status(int)>& fn) {
  std::vector<absl::Status> results(static_cast<size_t>(ranks));
  std::vector<std::thread> threads;
  for (int r = 1; r < ranks; ++r) threads.emplace_back([&, r] { results[r] = fn(r); });
  results[0] = fn(0);
  for (std::thread& t : threads) t.join();
  for (const absl::Status& s : results) CKPT_RETURN_IF_ERROR(s);
  return absl::OkStatus();
}

// Host memory laid out as optimizer slabs are (optimizer/host_buffer.cc: 2 MiB-aligned, advised
// MADV_HUGEPAGE): O_DIRECT into and out of huge pages is what the state really sees, and on
// this VM it is 2-3x faster than into 4 KiB pages.
absl::StatusOr<AlignedBuffer> SlabLike(uint64_t bytes) {
  return AlignedBuffer::Create(bytes, AlignedBuffer::Fill::kZero, AlignedBuffer::Pages::kHuge);
}

std::span<float> Floats(const AlignedBuffer& b, uint64_t bytes) {
  return {reinterpret_cast<float*>(b.data()), bytes / 4};
}

// Sequential O_DIRECT write (8 MiB appends, then Sync) of `bytes` through the Env, split over
// `streams` files written concurrently (one thread each). Returns GB/s.
absl::StatusOr<double> MeasureRawWriteOnce(Env* env, const std::string& dir, uint64_t bytes,
                                           int streams, const PhaseProgress& progress) {
  CKPT_ASSIGN_OR_RETURN(AlignedBuffer buf, SlabLike(kRawIoBytes));
  FillState(Floats(buf, kRawIoBytes), 7);
  auto path = [&](int i) { return JoinPath(dir, absl::StrCat(".ckpt-bench-raw-", i, ".tmp")); };
  auto share = [&](int i) { return bytes * (i + 1) / streams - bytes * i / streams; };
  // A run killed mid-measurement leaves its scratch files: ours to unlink (a link is unlinked,
  // never followed), since NewWritableFile never replaces a name.
  for (int i = 0; i < streams; ++i) {
    absl::Status stale = env->RemoveFile(path(i));
    if (!stale.ok() && !absl::IsNotFound(stale)) return stale;
  }
  const std::string phase = absl::StrCat("raw x", streams);
  std::atomic<uint64_t> written{0};
  // A failed write (ENOSPC) must not leave the disk full of scratch: best effort, the error
  // being what is reported.
  absl::Cleanup scratch = [&] {
    for (int i = 0; i < streams; ++i) env->RemoveFile(path(i)).IgnoreError();
  };
  Clock::time_point start = Clock::now();
  CKPT_RETURN_IF_ERROR(RunRanks(streams, [&](int i) -> absl::Status {
    CKPT_ASSIGN_OR_RETURN(auto file, env->NewWritableFile(path(i), FileOptions{.direct_io = true}));
    for (uint64_t done = 0, n = share(i); done < n; done += kRawIoBytes) {
      CKPT_RETURN_IF_ERROR(file->Append(buf.span().first(std::min(kRawIoBytes, n - done))));
      uint64_t total = written += std::min(kRawIoBytes, n - done);
      if (i == 0) Report(progress, phase, total, bytes);
    }
    CKPT_RETURN_IF_ERROR(file->Sync());
    return file->Close();
  }));
  const double gbps = static_cast<double>(bytes) / Seconds(start) / 1e9;
  Report(progress, phase, bytes, bytes);
  std::move(scratch).Cancel();
  for (int i = 0; i < streams; ++i) CKPT_RETURN_IF_ERROR(env->RemoveFile(path(i)));
  return gbps;
}

// The best the device gave in any configuration tried: one stream and four concurrent streams.
absl::StatusOr<double> MeasureRawWriteBound(Env* env, const IoBenchOptions& options) {
  double best = 0;
  for (int streams : {1, 4}) {
    CKPT_ASSIGN_OR_RETURN(double gbps, MeasureRawWriteOnce(env, options.dir, options.bytes, streams,
                                                           options.progress));
    best = std::max(best, gbps);
  }
  return best;
}

struct RankRange {
  uint64_t begin;
  uint64_t count;
};

RankRange RangeOf(int rank, int ranks, uint64_t elems) {
  uint64_t lo = elems * static_cast<uint64_t>(rank) / static_cast<uint64_t>(ranks);
  uint64_t hi = elems * static_cast<uint64_t>(rank + 1) / static_cast<uint64_t>(ranks);
  return {lo, hi - lo};
}

// Saves `state` as step `step` of `stores` (one handle per rank) and returns GB/s.
absl::StatusOr<double> Save(const IoBenchOptions& options,
                            const std::vector<std::unique_ptr<CheckpointStore>>& stores,
                            uint64_t step, std::span<const float> state) {
  const uint64_t elems = state.size();
  const uint64_t piece_elems = kPieceBytes / 4;
  ThreadGroup group(options.ranks);
  std::atomic<uint64_t> saved_bytes{0};
  Clock::time_point start = Clock::now();
  CKPT_RETURN_IF_ERROR(RunRanks(options.ranks, [&](int rank) -> absl::Status {
    CKPT_ASSIGN_OR_RETURN(auto txn, stores[rank]->BeginSave(step, group.member(rank)));
    RankRange range = RangeOf(rank, options.ranks, elems);
    absl::Status local = txn->DeclareTensor({"state", formats::DType::kF32, {elems}});
    for (uint64_t done = 0; local.ok() && done < range.count; done += piece_elems) {
      uint64_t n = std::min(piece_elems, range.count - done);
      local = txn->WritePiece("state", range.begin + done, n,
                              std::as_bytes(state.subspan(range.begin + done, n)));
      uint64_t total = saved_bytes += n * 4;
      if (rank == 0) Report(options.progress, "save", total, options.bytes);
    }
    absl::Status committed = txn->Commit();  // Collective even after a local failure.
    return local.ok() ? committed : local;
  }));
  const double gbps = static_cast<double>(options.bytes) / Seconds(start) / 1e9;
  Report(options.progress, "save", options.bytes, options.bytes);
  return gbps;
}

// Loads step `step` back into `loaded` and fills in the load and read-bound figures. The read
// bound is paired with the load (as in bench safetensors): the step's data files are read raw
// in kLoadBatches batches, each next to the load of the matching part of every rank's range,
// the first of the pair alternating; each side's times are summed. Same bytes, same moment,
// same buffers (see RawReadOnGrid), same threads per file as the store's readers.
absl::Status Load(Env* env, const IoBenchOptions& options, const CheckpointStore& store,
                  int read_threads, std::span<float> loaded, IoFigures& fig) {
  CKPT_ASSIGN_OR_RETURN(auto reader, store.OpenStep(fig.step));
  const uint64_t elems = loaded.size();
  std::vector<std::unique_ptr<RandomAccessFile>> raw_files;
  std::vector<uint64_t> raw_sizes;
  for (const formats::DataFileInfo& f : reader->manifest().files) {
    CKPT_ASSIGN_OR_RETURN(
        auto file, env->NewRandomAccessFile(JoinPath(reader->dir(), f.name), {.direct_io = true}));
    raw_sizes.push_back(file->size());
    raw_files.push_back(std::move(file));
  }
  double load_s = 0, raw_s = 0;
  for (int b = 0; b < kLoadBatches; ++b) {
    for (int side = 0; side < 2; ++side) {
      Clock::time_point start = Clock::now();
      if ((side + b) % 2 == 0) {
        CKPT_RETURN_IF_ERROR(RunRanks(static_cast<int>(raw_files.size()), [&](int i) {
          const uint64_t pages = raw_sizes[i] / 4096;
          const uint64_t lo = pages * b / kLoadBatches * 4096;
          const uint64_t hi =
              b + 1 == kLoadBatches ? raw_sizes[i] : pages * (b + 1) / kLoadBatches * 4096;
          return RawReadOnGrid(*raw_files[i], lo, hi, read_threads);
        }));
        raw_s += Seconds(start);
      } else {
        CKPT_RETURN_IF_ERROR(RunRanks(options.ranks, [&](int rank) -> absl::Status {
          RankRange range = RangeOf(rank, options.ranks, elems);
          const uint64_t lo = range.begin + range.count * b / kLoadBatches;
          const uint64_t hi = range.begin + range.count * (b + 1) / kLoadBatches;
          return reader->ReadRange("state", lo, hi - lo,
                                   std::as_writable_bytes(loaded.subspan(lo, hi - lo)));
        }));
        load_s += Seconds(start);
      }
    }
    Report(options.progress, "load", b + 1, kLoadBatches);
  }
  uint64_t raw_bytes = 0;
  for (uint64_t size : raw_sizes) raw_bytes += size;
  fig.load_gbps = static_cast<double>(options.bytes) / load_s / 1e9;
  fig.read_bound_gbps = static_cast<double>(raw_bytes) / raw_s / 1e9;
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<IoFigures> RunIoBench(const IoBenchOptions& options) {
  if (options.bytes == 0 || options.bytes % 4 != 0 || options.ranks < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("bench io needs a positive multiple of 4 bytes and at least one rank, not ",
                     options.bytes, " bytes and ", options.ranks, " ranks"));
  }
  Env* env = options.env != nullptr ? options.env : Env::Default();
  IoFigures fig;
  absl::StatusOr<double> write_bound = MeasureRawWriteBound(env, options);
  if (!write_bound.ok()) return Annotate(write_bound.status(), "raw bound");
  fig.write_bound_gbps = *write_bound;
  CKPT_ASSIGN_OR_RETURN(AlignedBuffer state_buf, SlabLike(options.bytes));
  std::span<float> state = Floats(state_buf, options.bytes);
  FillState(state, 42);
  fig.root = JoinPath(options.dir, "ckpt-bench");
  StoreOptions store_options;
  store_options.write_threads = options.write_threads;
  store_options.env = env;
  if (options.zstd_level.has_value()) {
    store_options.codec = formats::Codec::kZstd;
    store_options.zstd_level = *options.zstd_level;
  }
  ThreadGroup opening(options.ranks);
  CKPT_ASSIGN_OR_RETURN(std::vector<std::unique_ptr<CheckpointStore>> stores,
                        OpenStoresOnThreads(fig.root, store_options, opening));
  fig.step = stores[0]->latest_step().value_or(0) + 1;
  CKPT_ASSIGN_OR_RETURN(fig.save_gbps, Save(options, stores, fig.step, state));
  CKPT_ASSIGN_OR_RETURN(AlignedBuffer loaded_buf, SlabLike(options.bytes));
  std::span<float> loaded = Floats(loaded_buf, options.bytes);
  CKPT_RETURN_IF_ERROR(Load(env, options, *stores[0], store_options.read_threads, loaded, fig));
  if (std::memcmp(loaded.data(), state.data(), options.bytes) != 0) {
    return absl::DataLossError("loaded state differs from the saved state");
  }
  if (!options.keep) {
    stores.clear();                                  // Each handle lets go of the root first.
    RemoveRecursively(env, fig.root).IgnoreError();  // Best effort: only benchmark output.
  }
  return fig;
}

absl::StatusOr<double> RawWriteBoundGbps(Env* env, const std::string& dir, uint64_t bytes) {
  IoBenchOptions options;
  options.dir = dir;
  options.bytes = bytes;
  return MeasureRawWriteBound(env != nullptr ? env : Env::Default(), options);
}

absl::StatusOr<double> RawReadStepGbps(Env* env, const std::string& step_dir, int threads) {
  if (env == nullptr) env = Env::Default();
  CKPT_ASSIGN_OR_RETURN(std::vector<std::string> names, env->GetChildren(step_dir));
  std::vector<std::unique_ptr<RandomAccessFile>> files;
  uint64_t bytes = 0;
  for (const std::string& name : names) {
    if (!absl::EndsWith(name, ".data")) continue;
    CKPT_ASSIGN_OR_RETURN(auto file, env->NewRandomAccessFile(JoinPath(step_dir, name),
                                                              FileOptions{.direct_io = true}));
    bytes += file->size();
    files.push_back(std::move(file));
  }
  Clock::time_point start = Clock::now();
  // The files at once, as a load of every rank reads them; each cut on its 4 KiB-aligned span.
  CKPT_RETURN_IF_ERROR(RunRanks(static_cast<int>(files.size()), [&](int i) {
    const uint64_t size = files[static_cast<size_t>(i)]->size() / 4096 * 4096;
    return RawReadOnGrid(*files[static_cast<size_t>(i)], 0, size, threads);
  }));
  return static_cast<double>(bytes) / Seconds(start) / 1e9;
}

absl::Status RawReadOnGrid(const RandomAccessFile& file, uint64_t lo, uint64_t hi, int threads) {
  constexpr uint64_t kGrid = uint64_t{8} << 20;
  std::vector<std::pair<uint64_t, uint64_t>> requests;
  for (uint64_t off = lo; off < hi;) {
    const uint64_t end = std::min(hi, (off / kGrid + 1) * kGrid);
    requests.emplace_back(off, end);
    off = end;
  }
  internal::BouncePool& pool = internal::BouncePool::ReadBuffers();
  const size_t n = static_cast<size_t>(std::max(1, threads));
  std::vector<AlignedBuffer> bufs;
  absl::Cleanup give_back = [&] {
    for (auto& b : bufs) pool.Give(std::move(b));
  };
  for (size_t i = 0; i < n; ++i) {
    CKPT_ASSIGN_OR_RETURN(AlignedBuffer b, pool.Take());
    bufs.push_back(std::move(b));
  }
  std::vector<absl::Status> results(n);
  std::vector<std::thread> pool_threads;
  for (size_t i = 0; i < n; ++i) {
    pool_threads.emplace_back([&, i] {
      for (size_t k = requests.size() * i / n; k < requests.size() * (i + 1) / n && results[i].ok();
           ++k) {
        auto [a, b] = requests[k];
        results[i] = file.Read(a, bufs[i].span().first(b - a));
      }
    });
  }
  for (auto& t : pool_threads) t.join();
  for (const auto& st : results) CKPT_RETURN_IF_ERROR(st);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::unique_ptr<CheckpointStore>>> OpenStoresOnThreads(
    const std::string& root, const StoreOptions& options, ThreadGroup& group) {
  const int n = group.size();
  std::vector<absl::StatusOr<std::unique_ptr<CheckpointStore>>> opened(static_cast<size_t>(n));
  std::vector<std::thread> ranks;
  for (int r = 0; r < n; ++r) {
    ranks.emplace_back([&, r] { opened[r] = OpenStoreOnRanks(root, options, group.member(r)); });
  }
  for (std::thread& t : ranks) t.join();
  std::vector<std::unique_ptr<CheckpointStore>> stores;
  for (auto& s : opened) {
    CKPT_RETURN_IF_ERROR(s.status());
    stores.push_back(*std::move(s));
  }
  return stores;
}

}  // namespace ckpt::bench
