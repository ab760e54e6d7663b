// Optimizer state between the slabs and a step, laid out by StateLayout: the one place that
// writes state into a save transaction (Save, the undo spill, the async writer) and reads it
// back (Load, the restore from a spill or a committed step). The weights are never read from a
// caller's buffer: they are the masters rounded to the model dtype, rounded here as they are
// written. Stateless functions; the caller owns every buffer.
#ifndef CKPT_OPTIMIZER_STATE_IO_H_
#define CKPT_OPTIMIZER_STATE_IO_H_

#include <cstdint>
#include <span>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "ckpt/checkpoint_reader.h"
#include "ckpt/checkpoint_writer.h"
#include "optimizer/state_layout.h"

namespace ckpt::optimizer::internal {

// The master and moment bytes of a range of slab elements, each pointing at the range's first
// element: the slabs themselves, or an async save's copy of a unit.
struct StateBytes {
  const std::byte* master = nullptr;
  const std::byte* exp_avg = nullptr;
  const std::byte* exp_avg_sq = nullptr;
  const std::byte* max_exp_avg_sq = nullptr;  // With AMSGrad's maximum only.
  // The aux slab from the aux state of the range's first element on (StateLayout::AuxStart);
  // null when no parameter keeps aux state.
  const std::byte* aux = nullptr;
};
// The slabs of `opt` from element `begin` on. CUDA engine: REQUIRES Synchronize() first.
StateBytes SlabBytes(const StagedAdamW& opt, uint64_t begin = 0);

// Writes every state tensor of every piece of `layout` from `slabs` (the whole slab range),
// piece by piece, each piece's tensors in the layout's order: the weights rounded from the
// masters one block at a time (a whole number of the store's chunks of `chunk_bytes`, so that
// the blocks of a piece extend one piece of the manifest), then the master and moments as they
// are. Every piece is queued (PieceStream::Queue): the slabs must not change until it returns,
// which is once the writer threads have copied every piece (the commit waits for the writes). Memory: two blocks of weights, the one being rounded
// and the one being written. Errors are the transaction's; after one, the transaction must be
// aborted or fail its vote (its writer threads read no caller memory after an IO error).
absl::Status WriteState(SaveTransaction& txn, const StateLayout& layout, const StateBytes& slabs,
                        uint64_t chunk_bytes);

// Queues slab elements [begin, begin + count) of every state tensor from `from` with
// PieceStream::Queue: the weights rounded from the masters into `weights` (room for count
// elements of the widest model dtype; F32 weights are queued from the masters). `from` and `weights` must stay unchanged until
// WaitWritten returns for the returned ticket, the last one queued.
absl::StatusOr<uint64_t> QueueState(SaveTransaction& txn, const StateLayout& layout,
                                    uint64_t begin, uint64_t count, const StateBytes& from,
                                    std::span<std::byte> weights);

// Where ReadState writes: the writable slabs, from element 0.
struct MutableStateBytes {
  std::byte* master = nullptr;
  std::byte* exp_avg = nullptr;
  std::byte* exp_avg_sq = nullptr;
  std::byte* max_exp_avg_sq = nullptr;  // With AMSGrad's maximum only.
  std::byte* aux = nullptr;             // With aux state only.
};

// Reads the masters and moments of every piece of `layout` from `reader` into `to`; moments
// stored in another dtype than the layout's are converted a bounded batch at a time. The
// weights are not read. REQUIRES: the step holds every tensor, with the layout's shapes, and
// covers every piece (a preflight checked it). On failure `to` holds a mix: the caller restores.
absl::Status ReadState(const CheckpointReader& reader, const StateLayout& layout,
                       const MutableStateBytes& to);

// The identity of a committed step's contents: a checksum of its manifest as parsed and
// encoded again (every chunk's checksum, every piece, every blob), so the same whichever
// reader opened it. Two steps with one identity hold the same bytes (Checkpointer's reload of
// the step the state equals, Load's step 2(a')).
uint64_t ManifestIdentity(const formats::Manifest& manifest);

}  // namespace ckpt::optimizer::internal

#endif  // CKPT_OPTIMIZER_STATE_IO_H_
