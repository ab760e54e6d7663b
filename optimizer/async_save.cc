#include "optimizer/async_save.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <optional>

#include "absl/strings/str_cat.h"
#include "ckpt/base/status_macros.h"
#include "optimizer/state_io.h"

namespace ckpt::optimizer::internal {

using formats::DType;

std::unique_ptr<StagingPool> StagingPool::Create(uint64_t slot_bytes, uint64_t slots) {
  if (slots == 0 || slot_bytes == 0) return nullptr;
  constexpr uint64_t kHugePage = uint64_t{2} << 20;
  const uint64_t bytes = (slot_bytes * slots + kHugePage - 1) / kHugePage * kHugePage;
  void* base = std::aligned_alloc(kHugePage, bytes);
  if (base == nullptr) return nullptr;
  ::madvise(base, bytes, MADV_HUGEPAGE);  // Advice only: a step's copies stream through it.
  return std::unique_ptr<StagingPool>(
      new StagingPool(static_cast<std::byte*>(base), slot_bytes, slots));
}

StagingPool::~StagingPool() { std::free(base_); }

uint64_t AsyncSave::UnitStateBytes(const StagedAdamW& opt, const Unit& unit) {
  const uint64_t aux = opt.AuxStart(unit.offset + unit.count) - opt.AuxStart(unit.offset);
  return unit.count * (4 + (opt.has_max_exp_avg_sq() ? 3 : 2) * opt.moment_bytes()) + aux * 4;
}

AsyncSave::AsyncSave(const StagedAdamW& opt, std::unique_ptr<SaveTransaction> txn, Blobs blobs,
                     StagingPool* pool, ThreadPool* workers, Env* env)
    : units_(opt.units()),
      master_(reinterpret_cast<const std::byte*>(opt.master().data())),
      exp_avg_(opt.exp_avg_bytes().data()),
      exp_avg_sq_(opt.exp_avg_sq_bytes().data()),
      max_exp_avg_sq_(opt.has_max_exp_avg_sq() ? opt.max_exp_avg_sq_bytes().data() : nullptr),
      aux_(opt.aux().empty() ? nullptr : reinterpret_cast<const std::byte*>(opt.aux().data())),
      moment_bytes_(opt.moment_bytes()),
      moments_(opt.has_max_exp_avg_sq() ? 3 : 2),
      layout_(StateLayout::Of(opt)),
      blobs_(std::move(blobs)),
      txn_(std::move(txn)),
      state_(opt.units().size(), State::kPending),
      pool_(pool),
      workers_(workers),
      copy_threads_(std::max(
          1, std::min(workers->size(),
                      static_cast<int>(std::max(1u, std::thread::hardware_concurrency())) - 1))),
      slot_of_(opt.units().size(), -1) {
  if (pool_ != nullptr) {
    for (size_t i = pool_->slots(); i-- > 0;) free_slots_.push_back(i);
  }
  stats_.units = units_.size();
  writer_ = env->StartThread([this] { WriterMain(); });
}

AsyncSave::~AsyncSave() {
  writer_->Join();
}

uint64_t AsyncSave::UnitAux(size_t u) const {
  return layout_.AuxStart(units_[u].offset + units_[u].count) -
         layout_.AuxStart(units_[u].offset);
}

uint64_t AsyncSave::UnitBytes(size_t u) const {
  return units_[u].count * (4 + moments_ * moment_bytes_) + UnitAux(u) * 4;
}

StateBytes AsyncSave::SlabsOf(size_t u) const {
  const uint64_t at = units_[u].offset;
  return {master_ + at * 4, exp_avg_ + at * moment_bytes_, exp_avg_sq_ + at * moment_bytes_,
          max_exp_avg_sq_ == nullptr ? nullptr : max_exp_avg_sq_ + at * moment_bytes_,
          aux_ == nullptr ? nullptr : aux_ + layout_.AuxStart(at) * 4};
}

StateBytes AsyncSave::CopyOf(size_t u, const std::byte* copy) const {
  const uint64_t n = units_[u].count;
  return {copy, copy + n * 4, copy + n * (4 + moment_bytes_),
          max_exp_avg_sq_ == nullptr ? nullptr : copy + n * (4 + 2 * moment_bytes_),
          aux_ == nullptr ? nullptr : copy + n * (4 + moments_ * moment_bytes_)};
}

bool AsyncSave::Released(size_t u) const {
  return abandoned_ || state_[u] == State::kWritten || state_[u] == State::kCopied;
}

void AsyncSave::Acquire(const std::vector<bool>& done, std::vector<size_t>* ready) {
  std::unique_lock<std::mutex> lock(mu_);
  bool waited = false;
  for (;;) {
    for (size_t u = 0; u < done.size(); ++u) {
      if (!done[u] && Released(u)) ready->push_back(u);
    }
    if (!ready->empty()) break;
    // Nothing free: copy pending units into free slots, from the highest down (the writer
    // comes from below), at most kCopyBatchBytes at a time so that the step comes back soon to
    // take what the writer released meanwhile.
    std::vector<size_t> copy;
    std::vector<std::byte*> to;
    uint64_t batch = 0;
    for (size_t u = done.size(); u-- > 0 && batch < kCopyBatchBytes && !free_slots_.empty();) {
      if (done[u] || state_[u] != State::kPending) continue;
      // A unit larger than a slot (the Checkpointer sizes its pool for the largest) waits for
      // the writer rather than overrun the pool.
      if (UnitBytes(u) > pool_->slot_bytes()) continue;
      slot_of_[u] = static_cast<int64_t>(free_slots_.back());
      free_slots_.pop_back();
      batch += UnitBytes(u);
      state_[u] = State::kCopying;
      copy.push_back(u);
      to.push_back(pool_->slot(static_cast<size_t>(slot_of_[u])));
    }
    if (copy.empty()) {
      // The pool is full (or every unit left is being written): wait for the writer.
      if (!waited) ++stats_.step_waits;
      waited = true;
      changed_.wait(lock);
      continue;
    }
    lock.unlock();
    // Outside the lock: the writer goes on with other units meanwhile, and waits for a unit in
    // kCopying before it writes that one.
    CopyUnits(copy, to);
    lock.lock();
    for (size_t u : copy) {
      state_[u] = State::kCopied;
      ++stats_.units_copied;
      stats_.bytes_copied += UnitBytes(u);
    }
    changed_.notify_all();
  }
}

void AsyncSave::CopyUnits(const std::vector<size_t>& copy,
                          const std::vector<std::byte*>& to) const {
  auto one = [&](size_t k) {
    const uint64_t n = units_[copy[k]].count;
    const StateBytes from = SlabsOf(copy[k]);
    // Laid out as CopyOf reads it: the master, then each moment.
    std::byte* into = to[k];
    std::memcpy(into, from.master, n * 4);
    into += n * 4;
    for (const std::byte* m : {from.exp_avg, from.exp_avg_sq, from.max_exp_avg_sq}) {
      if (m == nullptr) continue;
      std::memcpy(into, m, n * moment_bytes_);
      into += n * moment_bytes_;
    }
    if (from.aux != nullptr) std::memcpy(into, from.aux, UnitAux(copy[k]) * 4);
  };
  workers_->ParallelFor(copy.size(), one, copy_threads_);
}

void AsyncSave::WriterMain() {
  absl::Status s = WriteAll();
  if (s.ok()) {
    s = txn_->stream().Prepare();
  } else {
    txn_->stream().MarkFailed(s);  // Returns once no writer thread reads a unit any more.
  }
  std::lock_guard<std::mutex> lock(mu_);
  status_ = s;
  if (!s.ok()) {
    // Free every unit: the steps go on, and the save votes no at Finalize.
    abandoned_ = true;
  }
  writer_done_ = true;
  changed_.notify_all();
}

absl::Status AsyncSave::WriteAll() {
  for (const TensorSpec& t : layout_.Declarations()) CKPT_RETURN_IF_ERROR(txn_->DeclareTensor(t));
  // Unit u is queued while unit u - 1 is being written, so the store's writer threads always
  // have the next unit's chunks at hand; a unit is released once written.
  struct Queued {
    size_t unit;
    uint64_t ticket;
    bool copied;  // Written from its slot in the pool, which it then frees.
  };
  std::optional<Queued> previous;
  auto release = [&](const Queued& q) {
    absl::Status s = txn_->stream().WaitWritten(q.ticket);
    std::lock_guard<std::mutex> lock(mu_);
    if (q.copied) {
      free_slots_.push_back(static_cast<size_t>(slot_of_[q.unit]));
      slot_of_[q.unit] = -1;
    }
    state_[q.unit] = State::kWritten;
    changed_.notify_all();
    return s;
  };
  // An error returns at once: WriterMain's MarkFailed stops the store's writer threads before
  // the units are freed for the steps.
  for (size_t u = 0; u < state_.size(); ++u) {
    const std::byte* from = nullptr;
    {
      std::unique_lock<std::mutex> lock(mu_);
      changed_.wait(lock, [&] { return state_[u] != State::kCopying; });
      if (state_[u] == State::kCopied) {
        from = pool_->slot(static_cast<size_t>(slot_of_[u]));
      } else {
        state_[u] = State::kWriting;
      }
    }
    absl::StatusOr<uint64_t> ticket = QueueUnit(u, from != nullptr ? CopyOf(u, from) : SlabsOf(u));
    if (!ticket.ok()) return ticket.status();
    if (previous.has_value()) {
      absl::Status s = release(*previous);
      if (!s.ok()) return s;
    }
    previous = Queued{u, *ticket, from != nullptr};
  }
  if (previous.has_value()) {
    absl::Status s = release(*previous);
    if (!s.ok()) return s;
  }
  for (const auto& [name, bytes] : blobs_) {
    absl::Status s = txn_->WriteBlob(name, std::as_bytes(std::span(bytes)));
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> AsyncSave::QueueUnit(size_t u, const StateBytes& from) {
  // The unit's weights, rounded from its masters, stay in a bounce buffer until it is written
  // (the caller's weight buffer is not read: a CUDA trainer copies device weights into it at
  // will). Two units are in the writer's hands at once, hence two buffers.
  std::vector<std::byte>& bounce = bounce_[u % 2];
  bounce.resize(units_[u].count * 4);  // Room for the widest model dtype.
  return QueueState(*txn_, layout_, units_[u].offset, units_[u].count, from, bounce);
}

bool AsyncSave::writer_done() const {
  std::lock_guard<std::mutex> lock(mu_);
  return writer_done_;
}

absl::Status AsyncSave::Wait() {
  writer_->Join();
  return status_;
}

AsyncSaveStats AsyncSave::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

}  // namespace ckpt::optimizer::internal
