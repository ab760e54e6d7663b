// ckpt-tool bench io: saves and loads synthetic state through the real store (ranks as threads)
// and, in the same run and directory, measures the raw O_DIRECT sequential write and read
// bandwidth that bounds them (DESIGN.md §8). Prints both figures, both bounds and the ratios.
#include <atomic>
#include <chrono>
#include <iostream>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "ckpt/checkpoint_store.h"
#include "cli/commands.h"
#include "cli/common.h"
#include "libckpt/aligned_buffer.h"
#include "ckpt/base/status_macros.h"

namespace ckpt::cli {
namespace {

using Clock = std::chrono::steady_clock;
constexpr uint64_t kPieceBytes = uint64_t{256} << 20;  // Each rank moves its range as pieces.
constexpr uint64_t kRawIoBytes = uint64_t{8} << 20;
constexpr int kLoadBatches = 8;

double Seconds(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
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

// Runs fn(rank) on `ranks` threads and returns the first error.
absl::Status RunRanks(int ranks, const std::function<absl::Status(int)>& fn) {
  std::vector<absl::Status> results(static_cast<size_t>(ranks));
  std::vector<std::thread> threads;
  for (int r = 1; r < ranks; ++r) threads.emplace_back([&, r] { results[r] = fn(r); });
  results[0] = fn(0);
  for (std::thread& t : threads) t.join();
  for (const absl::Status& s : results) CKPT_RETURN_IF_ERROR(s);
  return absl::OkStatus();
}

// Sequential O_DIRECT write (8 MiB appends, then Sync) of `bytes` through the Env, split over
// `streams` files written concurrently (one thread each). Returns GB/s.
absl::StatusOr<double> MeasureRawWriteOnce(Env* env, const std::string& dir, uint64_t bytes,
                                           int streams, ProgressBar* bar) {
  CKPT_ASSIGN_OR_RETURN(
      internal::AlignedBuffer buf,
      internal::AlignedBuffer::Create(kRawIoBytes, internal::AlignedBuffer::Fill::kZero,
                                      internal::AlignedBuffer::Pages::kHuge));
  FillState(std::span(reinterpret_cast<float*>(buf.data()), kRawIoBytes / 4), 7);
  auto path = [&](int i) { return JoinPath(dir, absl::StrCat(".ckpt-bench-raw-", i, ".tmp")); };
  auto share = [&](int i) { return bytes * (i + 1) / streams - bytes * i / streams; };
  // A run killed mid-measurement leaves its scratch files: ours to unlink (a link is unlinked,
  // never followed), since NewWritableFile never replaces a name.
  for (int i = 0; i < streams; ++i) {
    absl::Status stale = env->RemoveFile(path(i));
    if (!stale.ok() && !absl::IsNotFound(stale)) return stale;
  }
  std::atomic<uint64_t> progress{0};
  Clock::time_point start = Clock::now();
  CKPT_RETURN_IF_ERROR(RunRanks(streams, [&](int i) -> absl::Status {
    CKPT_ASSIGN_OR_RETURN(auto file, env->NewWritableFile(path(i), FileOptions{.direct_io = true}));
    for (uint64_t done = 0, n = share(i); done < n; done += kRawIoBytes) {
      CKPT_RETURN_IF_ERROR(file->Append(buf.span().first(std::min(kRawIoBytes, n - done))));
      uint64_t total = progress += std::min(kRawIoBytes, n - done);
      if (i == 0) bar->Update(total);
    }
    CKPT_RETURN_IF_ERROR(file->Sync());
    return file->Close();
  }));
  const double gbps = static_cast<double>(bytes) / Seconds(start) / 1e9;
  for (int i = 0; i < streams; ++i) CKPT_RETURN_IF_ERROR(env->RemoveFile(path(i)));
  return gbps;
}

// The write bound is the best the device gave in any configuration tried: one stream and four
// concurrent streams, so a parallel store is never compared with a serial bound.
absl::StatusOr<double> MeasureRawWriteBound(Env* env, const std::string& dir, uint64_t bytes,
                                            bool progress) {
  double best = 0;
  for (int streams : {1, 4}) {
    ProgressBar bar(absl::StrCat("raw x", streams, "   "), bytes, progress);
    CKPT_ASSIGN_OR_RETURN(double gbps, MeasureRawWriteOnce(env, dir, bytes, streams, &bar));
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

struct Figures {
  uint64_t step = 0;
  double save_gbps = 0;
  double load_gbps = 0;
  double read_bound_gbps = 0;  // Paired with the load: the same bytes, read raw.
};

// Host memory laid out as optimizer slabs are (optimizer/host_buffer.cc: 2 MiB-aligned, advised
// MADV_HUGEPAGE): O_DIRECT into and out of huge pages is what the state really sees, and on
// this VM it is 2-3x faster than into 4 KiB pages.
absl::StatusOr<internal::AlignedBuffer> SlabLike(uint64_t bytes) {
  return internal::AlignedBuffer::Create(bytes, internal::AlignedBuffer::Fill::kZero,
                                         internal::AlignedBuffer::Pages::kHuge);
}

std::span<float> Floats(const internal::AlignedBuffer& b, uint64_t bytes) {
  return {reinterpret_cast<float*>(b.data()), bytes / 4};
}

absl::StatusOr<Figures> SaveAndLoad(const BenchIoArgs& args, const std::string& root,
                                    uint64_t bytes, std::span<const float> state) {
  const uint64_t elems = state.size();
  StoreOptions options;
  if (args.zstd_level.has_value()) {
    options.codec = formats::Codec::kZstd;
    options.zstd_level = *args.zstd_level;
  }
  std::vector<std::unique_ptr<CheckpointStore>> stores;
  for (int r = 0; r < args.ranks; ++r) {
    StoreOptions o = options;
    o.primary = r == 0;
    CKPT_ASSIGN_OR_RETURN(auto store, CheckpointStore::Open(root, o));
    stores.push_back(std::move(store));
  }
  Figures fig;
  fig.step = stores[0]->latest_step().value_or(0) + 1;
  ThreadGroup group(args.ranks);
  std::atomic<uint64_t> progress_bytes{0};
  const uint64_t piece_elems = kPieceBytes / 4;
  {
    ProgressBar bar("save     ", bytes, !args.json);
    Clock::time_point start = Clock::now();
    absl::Status s = RunRanks(args.ranks, [&](int rank) -> absl::Status {
      CKPT_ASSIGN_OR_RETURN(auto txn, stores[rank]->BeginSave(fig.step, group.member(rank)));
      RankRange range = RangeOf(rank, args.ranks, elems);
      absl::Status local = txn->DeclareTensor({"state", formats::DType::kF32, {elems}});
      for (uint64_t done = 0; local.ok() && done < range.count; done += piece_elems) {
        uint64_t n = std::min(piece_elems, range.count - done);
        local = txn->WritePiece("state", range.begin + done, n,
                                std::as_bytes(std::span(state).subspan(range.begin + done, n)));
        uint64_t total = progress_bytes += n * 4;
        if (rank == 0) bar.Update(total);
      }
      absl::Status committed = txn->Commit();  // Collective even after a local failure.
      return local.ok() ? committed : local;
    });
    CKPT_RETURN_IF_ERROR(s);
    fig.save_gbps = static_cast<double>(bytes) / Seconds(start) / 1e9;
  }
  CKPT_ASSIGN_OR_RETURN(auto reader, stores[0]->OpenStep(fig.step));
  CKPT_ASSIGN_OR_RETURN(internal::AlignedBuffer loaded_buf, SlabLike(bytes));
  std::span<float> loaded = Floats(loaded_buf, bytes);
  // The read bound is paired with the load (as in bench safetensors): the step's data files are
  // read raw in kLoadBatches batches, each next to the load of the matching part of every rank's
  // range, the first of the pair alternating; each side's times are summed. Same bytes, same
  // moment, same buffers (see RawReadOnGrid), same threads per file as the store's readers.
  std::vector<std::unique_ptr<RandomAccessFile>> raw_files;
  std::vector<uint64_t> raw_sizes;
  for (const formats::DataFileInfo& f : reader->manifest().files) {
    CKPT_ASSIGN_OR_RETURN(auto file, Env::Default()->NewRandomAccessFile(
                                         JoinPath(reader->dir(), f.name), {.direct_io = true}));
    raw_sizes.push_back(file->size());
    raw_files.push_back(std::move(file));
  }
  double load_s = 0, raw_s = 0;
  uint64_t raw_bytes = 0;
  {
    ProgressBar bar("load     ", kLoadBatches, !args.json);
    for (int b = 0; b < kLoadBatches; ++b) {
      for (int side = 0; side < 2; ++side) {
        Clock::time_point start = Clock::now();
        if ((side + b) % 2 == 0) {
          CKPT_RETURN_IF_ERROR(RunRanks(static_cast<int>(raw_files.size()), [&](int i) {
            const uint64_t pages = raw_sizes[i] / 4096;
            const uint64_t lo = pages * b / kLoadBatches * 4096;
            const uint64_t hi =
                b + 1 == kLoadBatches ? raw_sizes[i] : pages * (b + 1) / kLoadBatches * 4096;
            return RawReadOnGrid(*raw_files[i], lo, hi, options.read_threads);
          }));
          raw_s += Seconds(start);
        } else {
          CKPT_RETURN_IF_ERROR(RunRanks(args.ranks, [&](int rank) -> absl::Status {
            RankRange range = RangeOf(rank, args.ranks, elems);
            const uint64_t lo = range.begin + range.count * b / kLoadBatches;
            const uint64_t hi = range.begin + range.count * (b + 1) / kLoadBatches;
            return reader->ReadRange("state", lo, hi - lo,
                                     std::as_writable_bytes(loaded.subspan(lo, hi - lo)));
          }));
          load_s += Seconds(start);
        }
      }
      bar.Update(b + 1);
    }
  }
  for (uint64_t size : raw_sizes) raw_bytes += size;
  fig.load_gbps = static_cast<double>(bytes) / load_s / 1e9;
  fig.read_bound_gbps = static_cast<double>(raw_bytes) / raw_s / 1e9;
  if (std::memcmp(loaded.data(), state.data(), bytes) != 0) {
    return absl::DataLossError("loaded state differs from the saved state");
  }
  return fig;
}

}  // namespace

int RunBenchIo(const BenchIoArgs& args) {
  absl::StatusOr<uint64_t> size = ParseByteSize(args.size);
  if (!size.ok()) return ReportError("bench io", size.status());
  const uint64_t bytes = *size / 4 * 4;
  if (bytes == 0)
    return ReportError("bench io", absl::InvalidArgumentError("--size must be at least 4 bytes"));
  // The state, and the buffer it is loaded back into.
  absl::Status fits = CheckFitsInMemory(bytes > UINT64_MAX / 2 ? UINT64_MAX : 2 * bytes,
                                        absl::StrCat("bench io --size ", args.size));
  if (!fits.ok()) return ReportError("bench io", fits);
  Env* env = Env::Default();
  absl::StatusOr<bool> is_dir = env->IsDirectory(args.dir);
  if (!is_dir.ok() || !*is_dir) {
    return ReportError("bench io", absl::NotFoundError(args.dir + ": not a directory"));
  }
  absl::StatusOr<double> write_bound = MeasureRawWriteBound(env, args.dir, bytes, !args.json);
  if (!write_bound.ok()) return ReportError("bench io: raw bound", write_bound.status());
  absl::StatusOr<internal::AlignedBuffer> state_buf = SlabLike(bytes);
  if (!state_buf.ok()) return ReportError("bench io", state_buf.status());
  std::span<float> state = Floats(*state_buf, bytes);
  FillState(state, 42);
  const std::string root = JoinPath(args.dir, "ckpt-bench");
  absl::StatusOr<Figures> fig = SaveAndLoad(args, root, bytes, state);
  if (!fig.ok()) return ReportError("bench io", fig.status());
  if (!args.keep) {
    RemoveRecursively(env, root).IgnoreError();  // Best effort: only benchmark output.
  }
  const double save_ratio = fig->save_gbps / *write_bound;
  const double load_ratio = fig->load_gbps / fig->read_bound_gbps;
  const std::string env_name = DefaultEnvFallbackReason().empty() ? "uring" : "posix";
  if (args.json) {
    PrintJson(
        {{"dir", args.dir},
         {"root", root},
         {"step", fig->step},
         {"kept", args.keep},
         {"size_bytes", bytes},
         {"ranks", args.ranks},
         {"env", env_name},
         {"codec", args.zstd_level.has_value() ? absl::StrCat("zstd-", *args.zstd_level) : "raw"},
         {"save_gbps", fig->save_gbps},
         {"write_bound_gbps", *write_bound},
         {"save_ratio", save_ratio},
         {"load_gbps", fig->load_gbps},
         {"read_bound_gbps", fig->read_bound_gbps},
         {"load_ratio", load_ratio}});
  } else {
    std::cout << absl::StrFormat(
        "state %s, %d rank(s), %s env, codec %s\n"
        "save  %6.2f GB/s   O_DIRECT write bound %6.2f GB/s   ratio %.2f\n"
        "load  %6.2f GB/s   O_DIRECT read  bound %6.2f GB/s   ratio %.2f\n",
        FormatBytes(bytes), args.ranks, env_name,
        args.zstd_level.has_value() ? absl::StrCat("zstd-", *args.zstd_level) : "raw",
        fig->save_gbps, *write_bound, save_ratio, fig->load_gbps, fig->read_bound_gbps, load_ratio);
    if (args.keep) std::cout << "kept step " << fig->step << " in " << root << "\n";
  }
  return kExitOk;
}

}  // namespace ckpt::cli
