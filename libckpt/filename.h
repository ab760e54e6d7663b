// Every on-disk name of a checkpoint store is built and parsed here (STYLE.md §8).
//
//   <root>/LOCK                          advisory lock of the primary handle
//   <root>/LATEST                        names the newest committed step
//   <root>/step-00001200/                a committed step
//   <root>/step-00001200/MANIFEST
//   <root>/step-00001200/rank-00003.data
//   <root>/.staging-step-00001300-<nonce>/          a save in progress
//   <root>/.staging-step-00001300-<nonce>/rank-00003.part   a rank's part, before the vote
//   <root>/.deleting-step-00001100-<nonce>/         a step being removed by retention
//   <root>/.deleting-quarantine-<nonce>/            a quarantined entry being purged
//   <root>/.undo-rank-00003-<nonce>/                a load's undo spill (a private store)
//   <root>/quarantine/<entry>-<nonce>               what recovery set aside
#ifndef CKPT_LIBCKPT_FILENAME_H_
#define CKPT_LIBCKPT_FILENAME_H_

#include <cstdint>
#include <optional>
#include <string>
#include "absl/strings/string_view.h"

namespace ckpt::internal {

inline constexpr absl::string_view kLatestName = "LATEST";
inline constexpr absl::string_view kLockName = "LOCK";
inline constexpr absl::string_view kManifestName = "MANIFEST";
inline constexpr absl::string_view kStagingPrefix = ".staging-";
inline constexpr absl::string_view kDeletingPrefix = ".deleting-";
// Undo snapshots a load spills (optimizer/checkpointer.cc); garbage once the load has ended.
inline constexpr absl::string_view kUndoPrefix = ".undo-";

std::string StepDirName(uint64_t step);  // "step-00001200"
std::optional<uint64_t> ParseStepDirName(absl::string_view name);
std::string DataFileName(uint32_t rank);  // "rank-00003.data"
std::string PartFileName(uint32_t rank);  // "rank-00003.part"
std::string StagingDirName(uint64_t step, absl::string_view nonce);
std::string DeletingDirName(uint64_t step, absl::string_view nonce);
std::string UndoDirName(uint32_t rank, absl::string_view nonce);
// True for "rank-NNNNN.data" / "rank-NNNNN.part" (five or more digits).
bool IsDataFileName(absl::string_view name);
bool IsPartFileName(absl::string_view name);
// True for names recovery may delete: staging, deleting and undo directories, LATEST.tmp.
bool IsGarbageName(absl::string_view name);
// A fresh random nonce of 16 hex digits.
std::string NewNonce();

}  // namespace ckpt::internal

#endif  // CKPT_LIBCKPT_FILENAME_H_
