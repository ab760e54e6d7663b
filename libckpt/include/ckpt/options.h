// Options of a checkpoint store.
#ifndef CKPT_OPTIONS_H_
#define CKPT_OPTIONS_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "absl/strings/string_view.h"

#include "ckpt/env.h"
#include "ckpt/formats/chunk.h"

namespace ckpt {

// Which committed steps retention keeps. The step LATEST names is always kept.
struct RetentionPolicy {
  // Keep the newest `keep_last` steps; 0 keeps every step (retention off).
  uint64_t keep_last = 0;
  // Also keep every step that is a multiple of `keep_every`; 0 keeps none for this reason.
  uint64_t keep_every = 0;
  // Set: keep exactly these committed steps (and LATEST), whatever keep_last and keep_every
  // say; every other committed step goes. What a trainer's own rotation decided (ckpt's HF
  // Trainer integration keeps the steps its checkpoint folders name).
  std::optional<std::vector<uint64_t>> keep_only = std::nullopt;
};

struct StoreOptions {
  // All file access goes through this Env; null means Env::Default(). Not owned.
  Env* env = nullptr;
  // The primary handle of a root takes its LOCK, recovers it at Open (removes staging
  // directories, repairs LATEST), commits saves as rank 0 and applies retention. Exactly one
  // handle per root is primary; the other ranks of a job open theirs with primary = false.
  bool primary = true;
  // Opens without the LOCK and without recovery, and changes nothing on disk: saves and
  // retention are refused (kFailedPrecondition); only reads and a retention dry run work. What
  // read-only tools (`ckpt-tool inspect`, `verify`, `gc --dry-run`) use.
  bool read_only = false;
  // Primary only: take the LOCK but do not recover; latest_step() is what LATEST names when it
  // reads, else none. Only for an operator's repair of a root recovery refuses (`ckpt-tool
  // quarantine ROOT --all`); a trainer never sets it.
  bool skip_recovery = false;
  // Raw bytes per chunk of a piece. Every chunk is checksummed and may be compressed on its own.
  uint64_t chunk_bytes = uint64_t{4} << 20;
  formats::Codec codec = formats::Codec::kRaw;
  int zstd_level = 3;
  // Move data files with O_DIRECT where the Env and file system allow it.
  bool direct_io = true;
  // Threads a reader uses to read and verify chunks of one large range in parallel.
  int read_threads = 8;
  // Threads each save transaction (one rank's data file) copies, checksums and writes whole
  // chunks on, so that several chunks are in flight at once (at least 1). Each holds one
  // chunk-sized buffer while the transaction writes.
  int write_threads = 4;
  // Applied by the primary after each durable commit: the retired steps are renamed away in the
  // commit and their files removed in the background (CheckpointStore::WaitForRemovals).
  RetentionPolicy retention;
  // Diagnostics (what recovery removed, why a fallback happened). Libraries never print.
  std::function<void(absl::string_view)> logger;
};

}  // namespace ckpt

#endif  // CKPT_OPTIONS_H_
