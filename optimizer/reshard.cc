// Offline reshard: one committed step rewritten for another data-parallel size.
//
// R1. Plan, nothing written: the parameters and their order from the step's optimizer record
//     (or every tensor as a parameter), each parameter's tensors (weights, masters, moments),
//     Megatron buckets for `dp` ranks and each rank's pieces (layout.h), each output rank's
//     blobs (the source rank's, or rank 0's), the optimizer record with world size `dp`.
// R2. Every rank, a thread over one ThreadGroup, opens its handle on the output root
//     (OpenStoreOnRanks: rank 0's primary creates the root and recovers it, removing any staging
//     a crashed reshard left, before the others open theirs).
// R3. Every rank begins the step's save transaction (the
//     store's commit protocol, libckpt/store/transaction.cc: a staging directory, published
//     only by the commit).
// R4. The ranks write one after the other (the disk sees one sequential stream and memory
//     holds one buffer): each declares every tensor, then for each of its pieces streams each
//     of the parameter's tensors, a buffer of whole chunks at a time, read from the source
//     and written as one growing piece (so its file is laid out as the optimizer's own save
//     lays it out); rank 0 also writes any tensor no parameter owns, whole; then the blobs;
//     then Prepare (the data durable, its part of the manifest written). A failure is this
//     rank's no vote, and the ranks after it write nothing.
// R5. Commit, collectively: all yes, rank 0 publishes the step and LATEST; any no, the staging
//     directory is removed and the root is as it was.
#include "ckpt/optimizer/reshard.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <map>
#include <mutex>
#include <optional>
#include <vector>


#include "absl/strings/str_cat.h"
#include "ckpt/base/status_macros.h"
#include "ckpt/checkpoint_store.h"
#include "ckpt/coordinator.h"
#include "ckpt/formats/optimizer_record.h"
#include "optimizer/state_layout.h"
#include "optimizer/thread_pool.h"
#include "optimizer/new_directory.h"

namespace ckpt::optimizer {
namespace {

using formats::DType;

struct Plan {
  std::vector<ParamSpec> params;
  std::vector<std::vector<uint32_t>> tensors_of;  // Manifest tensor indices by parameter.
  std::vector<uint32_t> loose;                    // Tensors no parameter owns (rank 0, whole).
  std::vector<std::vector<Piece>> pieces;         // By output rank.
  std::vector<bool> whole;  // By parameter: its rule keeps it whole on one rank (Muon).
  bool optimizer_layout = false;
  std::string layout;  // The optimizer record with world size dp (empty without one).
};

absl::StatusOr<Plan> MakePlan(const CheckpointReader& source, const ReshardOptions& options) {
  const formats::Manifest& m = source.manifest();
  const std::string where = absl::StrCat("step ", m.step, " (", source.dir(), ")");
  std::map<std::string, uint32_t> index;
  for (uint32_t i = 0; i < m.tensors.size(); ++i) index[m.tensors[i].name] = i;
  Plan plan;
  std::vector<bool> owned(m.tensors.size(), false);
  absl::StatusOr<std::string> record = source.ReadBlob(formats::kOptimizerRecordBlob, 0);
  if (record.ok()) {
    CKPT_ASSIGN_OR_RETURN(formats::OptimizerRecord parsed,
                          formats::ParseOptimizerRecord(*record, where));
    for (const formats::OptimizerRecordParam& p : parsed.params) {
      const std::string& name = p.name;
      auto found = index.find(name);
      if (found == index.end()) {
        return absl::DataLossError(absl::StrCat(where, ": optimizer record names \"", name,
                                                "\", which the step does not hold"));
      }
      const formats::TensorInfo& t = m.tensors[found->second];
      plan.params.push_back({name, t.shape, t.dtype, p.group});
      std::vector<uint32_t> tensors;
      // The tensors its group's rule keeps (AMSGrad's maximum only where the optimizer kept
      // one: for every parameter alike).
      CKPT_ASSIGN_OR_RETURN(const Algorithm algorithm,
                            internal::RecordAlgorithm(parsed.groups[p.group], p.group, where));
      const internal::UpdateRule& rule = internal::RuleFor(algorithm);
      const std::vector<std::string> with_max =
          internal::StateTensorNames(rule, name, p.shape, true);
      const std::vector<std::string> without =
          internal::StateTensorNames(rule, name, p.shape, false);
      for (const std::string& tensor : with_max) {
        auto state = index.find(tensor);
        const bool optional =
            std::find(without.begin(), without.end(), tensor) == without.end();
        if (state == index.end() && optional) continue;
        if (state == index.end()) {
          return absl::DataLossError(absl::StrCat(where, ": optimizer record names \"", name,
                                                  "\" but the step has no \"", tensor, "\""));
        }
        tensors.push_back(state->second);
      }
      for (uint32_t i : tensors) owned[i] = true;
      plan.tensors_of.push_back(std::move(tensors));
      plan.whole.push_back(rule.keeps_params_whole());
    }
    parsed.world_size = static_cast<uint32_t>(options.dp);
    plan.layout = formats::EncodeOptimizerRecord(parsed);
    plan.optimizer_layout = true;
  } else if (absl::IsNotFound(record.status())) {
    for (uint32_t i = 0; i < m.tensors.size(); ++i) {
      plan.params.push_back({m.tensors[i].name, m.tensors[i].shape, m.tensors[i].dtype, 0});
      plan.tensors_of.push_back({i});
      owned[i] = true;
    }
  } else {
    return record.status();
  }
  for (uint32_t i = 0; i < m.tensors.size(); ++i) {
    if (!owned[i]) plan.loose.push_back(i);
  }
  if (std::find(plan.whole.begin(), plan.whole.end(), true) != plan.whole.end()) {
    // Each Muon matrix whole on one output rank, as the optimizer lays it out there.
    CKPT_ASSIGN_OR_RETURN(plan.pieces, RankPiecesKeepingWhole(plan.params, plan.whole,
                                                              options.buckets, options.dp));
    return plan;
  }
  CKPT_ASSIGN_OR_RETURN(std::vector<Bucket> buckets,
                        BuildBuckets(plan.params, options.buckets, options.dp));
  plan.pieces = RankPieces(buckets, options.dp);
  return plan;
}

// Step R4 for one output rank.
class RankWriter {
 public:
  RankWriter(const CheckpointReader& source, const Plan& plan, const ReshardOptions& options,
             SaveTransaction& txn, std::atomic<uint64_t>& done, uint64_t total)
      : source_(source), plan_(plan), options_(options), txn_(txn), done_(done), total_(total) {}

  absl::Status Write(int rank) {
    const formats::Manifest& m = source_.manifest();
    for (const formats::TensorInfo& t : m.tensors) {
      CKPT_RETURN_IF_ERROR(txn_.DeclareTensor({t.name, t.dtype, t.shape}));
    }
    std::vector<Batch> batches;
    for (const Piece& piece : plan_.pieces[rank]) {
      for (uint32_t t : plan_.tensors_of[piece.param]) {
        // A parameter kept whole is one piece, [0, numel): each of its tensors goes whole, so
        // too those shaped unlike it (Adafactor's factors).
        const bool whole = !plan_.whole.empty() && plan_.whole[piece.param];
        Cut(m.tensors[t], piece.begin, whole ? m.tensors[t].numel() : piece.count, &batches);
      }
    }
    if (rank == 0) {
      for (uint32_t t : plan_.loose) Cut(m.tensors[t], 0, m.tensors[t].numel(), &batches);
    }
    CKPT_RETURN_IF_ERROR(Stream(batches));
    // This rank's blobs: the source rank's, or rank 0's when the source had fewer ranks.
    const uint32_t from = static_cast<uint32_t>(rank) < m.world_size ? rank : 0;
    for (const formats::BlobInfo& b : m.blobs) {
      if (b.rank != from) continue;
      if (b.name == formats::kOptimizerRecordBlob) {
        CKPT_RETURN_IF_ERROR(txn_.WriteBlob(b.name, std::as_bytes(std::span(plan_.layout))));
        continue;
      }
      CKPT_ASSIGN_OR_RETURN(std::string bytes, source_.ReadBlob(b.name, from));
      CKPT_RETURN_IF_ERROR(txn_.WriteBlob(b.name, std::as_bytes(std::span(bytes))));
    }
    return txn_.stream().Prepare();
  }

 private:
  // Elements [begin, begin + count) of one tensor: one read and one write.
  struct Batch {
    const formats::TensorInfo* tensor;
    uint64_t begin;
    uint64_t count;
  };
  // Cuts elements [begin, begin + count) of `t` into batches of whole output chunks.
  void Cut(const formats::TensorInfo& t, uint64_t begin, uint64_t count,
           std::vector<Batch>* out) const {
    const uint64_t esize = formats::DTypeSize(t.dtype);
    const uint64_t chunk_elems = std::max<uint64_t>(1, options_.store.chunk_bytes / esize);
    const uint64_t batch =
        chunk_elems * std::max<uint64_t>(1, options_.buffer_bytes / (chunk_elems * esize));
    for (uint64_t at = 0; at < count; at += batch) {
      out->push_back({&t, begin + at, std::min(batch, count - at)});
    }
  }
  // Reads batch i + 1 while batch i is written, the two on `pair_`'s two threads: the time is
  // close to the longer of the two streams rather than their sum. Two buffers in all.
  absl::Status Stream(const std::vector<Batch>& batches) {
    std::vector<std::byte> buffers[2];
    auto read = [&](size_t i) {
      const Batch& b = batches[i];
      std::vector<std::byte>& buffer = buffers[i % 2];
      buffer.resize(b.count * formats::DTypeSize(b.tensor->dtype));
      return source_.ReadRange(b.tensor->name, b.begin, b.count, buffer);
    };
    if (batches.empty()) return absl::OkStatus();
    absl::Status next = read(0);
    for (size_t i = 0; i < batches.size(); ++i) {
      CKPT_RETURN_IF_ERROR(next);
      absl::Status prefetched, written;
      const Batch& b = batches[i];
      pair_.ParallelFor(i + 1 < batches.size() ? 2 : 1, [&](size_t task) {
        if (task == 1) {
          prefetched = read(i + 1);
        } else {
          written = txn_.WritePiece(b.tensor->name, b.begin, b.count, buffers[i % 2]);
        }
      });
      CKPT_RETURN_IF_ERROR(written);
      next = prefetched;
      const uint64_t bytes = b.count * formats::DTypeSize(b.tensor->dtype);
      const uint64_t now = done_.fetch_add(bytes) + bytes;
      if (options_.progress) options_.progress(now, total_);
    }
    return absl::OkStatus();
  }

  const CheckpointReader& source_;
  const Plan& plan_;
  const ReshardOptions& options_;
  SaveTransaction& txn_;
  std::atomic<uint64_t>& done_;
  const uint64_t total_;
  internal::ThreadPool pair_{2};  // The write of a batch and the read of the next.
};

absl::StatusOr<ReshardReport> Write(const CheckpointReader& source, const Plan& plan,
                                    const std::string& dst_root, const ReshardOptions& options,
                                    Env* env);

}  // namespace

absl::StatusOr<ReshardReport> Reshard(const CheckpointReader& source, const std::string& dst_root,
                                      const ReshardOptions& options) {
  if (options.dp < 1 || options.dp > kMaxReshardRanks) {
    return absl::InvalidArgumentError(absl::StrCat("reshard to ", options.dp,
                                                   " ranks: from 1 to ", kMaxReshardRanks));
  }
  Env* env = options.store.env != nullptr ? options.store.env : Env::Default();
  CKPT_RETURN_IF_ERROR(internal::CheckOutside(env, Dirname(source.dir()), dst_root, "reshard"));
  // Step R1.
  CKPT_ASSIGN_OR_RETURN(Plan plan, MakePlan(source, options));
  // A new root is built aside and renamed into place when committed: a failure or a crash
  // leaves nothing at dst_root (a crash: an inert hidden sibling).
  std::optional<internal::NewDirectory> fresh;
  absl::StatusOr<bool> exists = env->IsDirectory(dst_root);
  if (exists.ok() && *exists) {
    CKPT_ASSIGN_OR_RETURN(std::vector<std::string> children, env->GetChildren(dst_root));
    if (children.empty()) {
      exists = absl::NotFoundError("empty");
    } else {
      CKPT_ASSIGN_OR_RETURN(bool store, LooksLikeStore(env, dst_root));
      if (!store) {
        // As export-hf: a user's directory never gets LATEST, LOCK and a step beside its files.
        return absl::FailedPreconditionError(absl::StrCat(
            "reshard into ", dst_root,
            ": is a non-empty directory that is not a ckpt store (no LATEST, LOCK or step "
            "directory); name a new or empty directory, or a store"));
      }
    }
  } else if (exists.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("reshard into ", dst_root, ": exists and is not a directory"));
  }
  if (absl::IsNotFound(exists.status())) {
    CKPT_ASSIGN_OR_RETURN(fresh, internal::NewDirectory::Plan(env, dst_root, "reshard"));
  }
  const std::string root = fresh.has_value() ? fresh->staging() : dst_root;
  absl::StatusOr<ReshardReport> report = Write(source, plan, root, options, env);
  if (fresh.has_value()) {
    absl::Status published = report.ok() ? fresh->Publish(env) : report.status();
    if (!published.ok()) {
      fresh->Discard(env);
      return published;
    }
  }
  return report;
}

namespace {

// Steps R2 to R5 into the store at `root`.
absl::StatusOr<ReshardReport> Write(const CheckpointReader& source, const Plan& plan,
                                    const std::string& dst_root, const ReshardOptions& options,
                                    Env* env) {
  const formats::Manifest& m = source.manifest();
  uint64_t total = 0;
  for (const formats::TensorInfo& t : m.tensors) total += t.numel() * formats::DTypeSize(t.dtype);
  StoreOptions so = options.store;
  so.env = env;
  so.read_only = false;
  // Steps R2 to R5, a thread per rank: ranks.ParallelFor hands each of its dp threads one rank
  // (each blocks in its rank's collective commit until every rank has arrived, so no thread
  // takes a second rank before every rank has a thread).
  ThreadGroup group(options.dp);
  std::mutex mu;
  std::condition_variable cv;
  int turn = 0;           // The rank writing now (guarded by mu).
  bool failed = false;    // A rank before `turn` failed (guarded by mu).
  std::atomic<uint64_t> done{0};
  std::vector<absl::Status> results(options.dp);
  internal::ThreadPool ranks(options.dp);
  ranks.ParallelFor(static_cast<size_t>(options.dp), [&](size_t index) {
    const int r = static_cast<int>(index);
    absl::StatusOr<std::unique_ptr<CheckpointStore>> store =
        OpenStoreOnRanks(dst_root, so, group.member(r));
    if (!store.ok()) {
      results[r] = store.status();  // Every rank failed to open: nothing began.
      return;
    }
    absl::StatusOr<std::unique_ptr<SaveTransaction>> txn =
        (*store)->BeginSave(m.step, group.member(r));
    absl::Status mine = txn.status();
    {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return turn == r; });
      if (failed && mine.ok()) mine = absl::AbortedError("an earlier rank failed");
    }
    if (mine.ok()) {
      RankWriter writer(source, plan, options, **txn, done, total);
      mine = Annotate(writer.Write(r), absl::StrCat("reshard rank ", r));
    }
    {
      std::lock_guard<std::mutex> lock(mu);
      failed |= !mine.ok();
      ++turn;
    }
    cv.notify_all();
    if (!txn.ok()) {
      results[r] = txn.status();  // BeginSave failed on every rank: nothing to commit.
      return;
    }
    if (!mine.ok()) (*txn)->stream().MarkFailed(mine);
    results[r] = (*txn)->Commit();
  });
  for (const absl::Status& s : results) {
    if (!s.ok()) return s;
  }
  ReshardReport report;
  report.step = m.step;
  report.source_world_size = m.world_size;
  report.dp = options.dp;
  report.tensors = m.tensors.size();
  report.bytes = total;
  report.optimizer_layout = plan.optimizer_layout;
  return report;
}

}  // namespace
}  // namespace ckpt::optimizer
