// AsyncSave: one rank's side of an async save in flight (Checkpointer::SaveAsync, DESIGN.md §6).
// A writer thread writes the optimizer's state as it was when the save began into a
// SaveTransaction, unit by unit in unit order, and meanwhile fences Step (UnitFence): a unit the
// writer has not written yet may change only once its bytes are copied into a bounded staging
// pool; when the pool is full the step waits for the writer. Not part of the API.
//
// Unit states (guarded by mu_):
//   kPending  --writer takes it-->  kWriting --written--> kWritten   (the step may change it)
//   kPending  --step copies it-->   kCopying --copied-->  kCopied    (the step may change it;
//             the writer writes it from the copy later, then frees the copy: kWritten)
// "Written" means on the file: the writer queues unit u (PieceStream::Queue,
// whose writer threads copy and checksum it) while unit u - 1 is being written, and releases
// u - 1 once the store reports it written, so two units are kWriting at once.
// The step copies from the highest pending unit down, the writer writes from the lowest up, so
// each copy buys the writer the most time before the step needs more room. When the writer
// fails it marks every unit free (abandoned_) and stops; the step never waits on a dead writer.
#ifndef CKPT_OPTIMIZER_ASYNC_SAVE_H_
#define CKPT_OPTIMIZER_ASYNC_SAVE_H_

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "ckpt/checkpoint_writer.h"
#include "ckpt/env.h"
#include "ckpt/optimizer/staged_adamw.h"
#include "optimizer/state_io.h"
#include "optimizer/state_layout.h"
#include "optimizer/thread_pool.h"
#include "optimizer/unit_fence.h"

namespace ckpt::optimizer::internal {

// The staging pool of a Checkpointer's async saves: `slots` slots of `slot_bytes` (a unit's
// master and moments at most), allocated once (huge-page advice, untouched: pages fault in at
// their first copy) and reused by every save, so that a step's copies neither allocate nor,
// after the first save, fault. Not thread-safe: AsyncSave hands slots out under its lock.
class StagingPool {
 public:
  // nullptr when `slots` is 0 or the memory cannot be had.
  static std::unique_ptr<StagingPool> Create(uint64_t slot_bytes, uint64_t slots);
  ~StagingPool();
  StagingPool(const StagingPool&) = delete;  // Owns memory.
  StagingPool& operator=(const StagingPool&) = delete;
  std::byte* slot(size_t i) { return base_ + i * slot_bytes_; }
  uint64_t slot_bytes() const { return slot_bytes_; }
  uint64_t slots() const { return slots_; }

 private:
  StagingPool(std::byte* base, uint64_t slot_bytes, uint64_t slots)
      : base_(base), slot_bytes_(slot_bytes), slots_(slots) {}
  std::byte* const base_;
  const uint64_t slot_bytes_, slots_;
};

struct AsyncSaveStats {
  uint64_t units = 0;         // Units of the optimizer.
  uint64_t units_copied = 0;  // Copied into the pool by a step before the writer got to them.
  uint64_t bytes_copied = 0;
  uint64_t step_waits = 0;    // Times a step waited for the writer (the pool was full, or the
                              // units left were being written).
};

class AsyncSave : public UnitFence {
 public:
  // Blobs written after the state, by name.
  using Blobs = std::vector<std::pair<std::string, std::string>>;
  // Starts the writer on `txn`: the state as StateLayout::Of(opt) lays it out (the weights
  // rounded from the masters, which is what every step writes), then `blobs`. Until Wait()
  // returns, `opt` may change only through Step with this object installed as its fence, and
  // `pool` (null: steps never copy, they wait) is this save's. Its slots must hold any unit
  // (UnitStateBytes). A step's copies run on `workers` (the optimizer's threads), leaving one
  // core to the writer, which `env` starts (the store's Env).
  AsyncSave(const StagedAdamW& opt, std::unique_ptr<SaveTransaction> txn, Blobs blobs,
            StagingPool* pool, ThreadPool* workers, Env* env);
  // The bytes of a unit's master and moments; the largest is a pool's slot size.
  static uint64_t UnitStateBytes(const StagedAdamW& opt, const Unit& unit);
  ~AsyncSave() override;  // Joins the writer.
  AsyncSave(const AsyncSave&) = delete;  // Owns a thread that points into it.
  AsyncSave& operator=(const AsyncSave&) = delete;

  void Acquire(const std::vector<bool>& done, std::vector<size_t>* ready) override;

  // Whether the writer has finished (prepared the transaction, or failed).
  bool writer_done() const;
  // Joins the writer; returns its error (the transaction then votes no with it).
  absl::Status Wait();
  // The transaction, once Wait() has returned.
  SaveTransaction& txn() { return *txn_; }
  AsyncSaveStats stats() const;

 private:
  enum class State { kPending, kWriting, kWritten, kCopying, kCopied };
  // What one Acquire copies at most before it lets the step go on.
  static constexpr uint64_t kCopyBatchBytes = uint64_t{256} << 20;
  // Copies units `copy` into their slots on `workers_`.
  void CopyUnits(const std::vector<size_t>& copy, const std::vector<std::byte*>& to) const;
  void WriterMain();
  absl::Status WriteAll();
  // Queues unit `u` from its master and moment bytes (the slabs' or its copy's), which must
  // stay unchanged until the returned ticket is written (PieceStream::WaitWritten).
  absl::StatusOr<uint64_t> QueueUnit(size_t u, const StateBytes& from);
  // Unit `u`'s state in the slabs, and in a copy of it at `copy` (master, then each moment,
  // then its aux state).
  StateBytes SlabsOf(size_t u) const;
  StateBytes CopyOf(size_t u, const std::byte* copy) const;
  uint64_t UnitBytes(size_t u) const;
  uint64_t UnitAux(size_t u) const;  // Unit `u`'s aux elements.
  bool Released(size_t u) const;  // REQUIRES: mu_ held.

  // What the writer and the fence read of the optimizer, taken once on the caller's thread: the
  // slabs' addresses and the units never change while the optimizer lives.
  const std::vector<Unit> units_;
  const std::byte* const master_;
  const std::byte* const exp_avg_;
  const std::byte* const exp_avg_sq_;
  const std::byte* const max_exp_avg_sq_;  // Null without AMSGrad's maximum.
  const std::byte* const aux_;             // Null without aux state.
  const size_t moment_bytes_;
  const size_t moments_;  // Moment slabs: 2, or 3 with max_exp_avg_sq.
  const StateLayout layout_;
  const Blobs blobs_;
  std::vector<std::byte> bounce_[2];  // The writer's model-dtype weights of units u % 2.
  // After what its writer threads read (blobs_, bounce_), so that it goes first.
  std::unique_ptr<SaveTransaction> txn_;

  mutable std::mutex mu_;
  std::condition_variable changed_;
  std::vector<State> state_;                           // Guarded by mu_.
  StagingPool* const pool_;                            // Null: no copies.
  ThreadPool* const workers_;
  const int copy_threads_;  // Of workers_: every core but the writer's, within its size.
  std::vector<int64_t> slot_of_;                       // Per unit, -1 for none; guarded by mu_.
  std::vector<size_t> free_slots_;                     // Guarded by mu_.
  bool abandoned_ = false;                             // Guarded by mu_.
  bool writer_done_ = false;                           // Guarded by mu_.
  AsyncSaveStats stats_;                               // Guarded by mu_.
  absl::Status status_;  // The writer's; read after the join.
  std::unique_ptr<EnvThread> writer_;  // Last: starts once everything above exists.
};

}  // namespace ckpt::optimizer::internal

#endif  // CKPT_OPTIMIZER_ASYNC_SAVE_H_
