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

// A Status as ranks exchange it through a Coordinator: "<code> <message>" ("0" for OK). The
// one encoding of every vote and outcome, so all ranks return the same code and message.
std::string EncodeStatus(const absl::Status& status);
// The inverse; text that no EncodeStatus produced becomes kInternal naming it.
absl::Status DecodeStatus(absl::string_view text);

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
