// MpiCoordinator: the ranks of an MPI job as a ckpt::Coordinator (DESIGN.md §7). Built when MPI
// is found (CMake option CKPT_MPI; target ckpt::mpi). This header names no MPI type, so a
// trainer includes it without MPI's headers; a communicator is passed by address.
#ifndef CKPT_MPI_COORDINATOR_H_
#define CKPT_MPI_COORDINATOR_H_

#include <memory>

#include "absl/status/statusor.h"
#include "ckpt/coordinator.h"

namespace ckpt {

// A Coordinator over a duplicate of the communicator `*mpi_comm` points to (an MPI_Comm; null
// means MPI_COMM_WORLD), so ckpt's collectives never mix with the trainer's messages; the
// duplicate returns errors instead of aborting the job. REQUIRES: MPI is initialized and stays
// so while the coordinator lives (it frees its duplicate on destruction). Collective over the
// communicator. kFailedPrecondition when MPI is not initialized; kInternal naming the MPI error
// otherwise. The coordinator, like every Coordinator, is used by one thread of each rank.
absl::StatusOr<std::unique_ptr<Coordinator>> NewMpiCoordinator(const void* mpi_comm = nullptr);

}  // namespace ckpt

#endif  // CKPT_MPI_COORDINATOR_H_
