// MpiCoordinator: AllGather is MPI_Allgather of the sizes, then MPI_Allgatherv of the bytes.
// Votes and digests are small, so two collectives per call cost nothing next to a save.
#include "ckpt/mpi_coordinator.h"

#include <mpi.h>

#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

namespace ckpt {
namespace {

absl::Status MpiError(int code, const char* what) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  MPI_Error_string(code, text, &length);
  return absl::InternalError(absl::StrCat(what, ": ", std::string(text, length)));
}

// Owns a duplicated communicator. Not copyable: it would free the communicator twice.
class MpiCoordinator : public Coordinator {
 public:
  MpiCoordinator(MPI_Comm comm, int rank, int size) : comm_(comm), rank_(rank), size_(size) {}
  ~MpiCoordinator() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Comm_free(&comm_);  // Destructors never report.
  }
  MpiCoordinator(const MpiCoordinator&) = delete;
  MpiCoordinator& operator=(const MpiCoordinator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  absl::StatusOr<std::vector<std::string>> AllGather(absl::string_view mine) override {
    if (mine.size() > static_cast<size_t>(std::numeric_limits<int>::max())) {
      return absl::InvalidArgumentError("AllGather of more than 2 GiB");
    }
    const int length = static_cast<int>(mine.size());
    std::vector<int> lengths(static_cast<size_t>(size_));
    int rc = MPI_Allgather(&length, 1, MPI_INT, lengths.data(), 1, MPI_INT, comm_);
    if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Allgather of lengths");
    std::vector<int> offsets(static_cast<size_t>(size_));
    long long total = 0;
    for (int r = 0; r < size_; ++r) {
      offsets[static_cast<size_t>(r)] = static_cast<int>(total);
      total += lengths[static_cast<size_t>(r)];
      if (total > std::numeric_limits<int>::max()) {
        return absl::InvalidArgumentError("AllGather of more than 2 GiB in all");
      }
    }
    std::string all(static_cast<size_t>(total), '\0');
    rc = MPI_Allgatherv(mine.data(), length, MPI_CHAR, all.data(), lengths.data(), offsets.data(),
                        MPI_CHAR, comm_);
    if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Allgatherv");
    std::vector<std::string> out;
    for (int r = 0; r < size_; ++r) {
      out.push_back(all.substr(static_cast<size_t>(offsets[static_cast<size_t>(r)]),
                               static_cast<size_t>(lengths[static_cast<size_t>(r)])));
    }
    return out;
  }

  absl::Status Barrier() override {
    const int rc = MPI_Barrier(comm_);
    return rc == MPI_SUCCESS ? absl::OkStatus() : MpiError(rc, "MPI_Barrier");
  }

 private:
  MPI_Comm comm_;
  const int rank_, size_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Coordinator>> NewMpiCoordinator(const void* mpi_comm) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) return absl::FailedPreconditionError("MPI is not initialized");
  const MPI_Comm parent =
      mpi_comm != nullptr ? *static_cast<const MPI_Comm*>(mpi_comm) : MPI_COMM_WORLD;
  MPI_Comm comm;
  int rc = MPI_Comm_dup(parent, &comm);
  if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Comm_dup");
  MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
  int rank = 0, size = 0;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  return std::unique_ptr<Coordinator>(new MpiCoordinator(comm, rank, size));
}

}  // namespace ckpt
