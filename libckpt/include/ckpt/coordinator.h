// How the ranks of a job agree. Ranks exchange only status and digests through it, never tensor
// data (DESIGN.md §7). The trainer passes its own implementation (MPI, torch.distributed); ckpt
// ships a single-process one and an in-process thread group for tests and benchmarks.
#ifndef CKPT_COORDINATOR_H_
#define CKPT_COORDINATOR_H_

#include <memory>
#include <string>
#include <vector>
#include "absl/strings/string_view.h"

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ckpt {

// Collective operations over the ranks of one job. Every rank calls the same collectives in
// the same order. One collective at a time per rank; an implementation is used by one thread
// of each rank.
class Coordinator {
 public:
  virtual ~Coordinator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Returns every rank's `mine`, indexed by rank. An error means the group is broken; every
  // rank then fails its save.
  virtual absl::StatusOr<std::vector<std::string>> AllGather(absl::string_view mine) = 0;
  // Returns `value` as given by rank `root`; other ranks' `value` is ignored.
  virtual absl::StatusOr<std::string> Broadcast(absl::string_view value, int root);
  virtual absl::Status Barrier();
};

// The one codec of what ranks exchange through a Coordinator, so that all ranks return the same
// code and message.
// A Status (a vote, an outcome): "<code> <message>" ("0" for OK).
std::string EncodeStatus(const absl::Status& status);
// The inverse; text that no EncodeStatus produced becomes kInternal naming it.
absl::Status DecodeStatus(absl::string_view text);
// A value, or the error that stands in its place (a vote with its digest, the step rank 0
// resolved, the staging directory it made): "ok <value>" or "no " + EncodeStatus(error).
std::string EncodeResult(const absl::StatusOr<std::string>& result);
// The inverse; text that no EncodeResult produced becomes kInternal naming it.
absl::StatusOr<std::string> DecodeResult(absl::string_view text);
// Collective: rank `root`'s `mine` on every rank (the others' is ignored); the coordinator's
// own error when the broadcast fails.
absl::StatusOr<std::string> BroadcastResult(Coordinator& coordinator,
                                            const absl::StatusOr<std::string>& mine, int root);

// A job of one rank.
class SingleProcessCoordinator : public Coordinator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  absl::StatusOr<std::vector<std::string>> AllGather(absl::string_view mine) override {
    return std::vector<std::string>{std::string(mine)};
  }
};

// `size` ranks as threads of one process. member(r) is the Coordinator rank r's thread uses.
// Safe for concurrent use by the member threads; the group outlives its members' use.
class ThreadGroup {
 public:
  explicit ThreadGroup(int size);
  ~ThreadGroup();
  ThreadGroup(const ThreadGroup&) = delete;  // Members point into the group.
  ThreadGroup& operator=(const ThreadGroup&) = delete;
  int size() const;
  Coordinator* member(int rank);

 private:
  struct State;
  class Member;
  std::unique_ptr<State> state_;
  std::vector<std::unique_ptr<Member>> members_;
};

}  // namespace ckpt

#endif  // CKPT_COORDINATOR_H_
