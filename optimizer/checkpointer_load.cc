// Load of optimizer state as a transaction (DESIGN.md §6); Save is optimizer/checkpointer.cc.
// 1. Preflight, nothing touched: rank 0 resolves LATEST and broadcasts it (one step for all);
//    the CUDA engine's last copies are awaited; open the step, check names (missing and extra ones
//    listed), dtypes, shapes, that its pieces cover every element this rank owns, and the layout
//    record (groups, valid hyper-parameters, every parameter in the same group as here). Vote.
// 2. Fix the undo source, the cheapest that holds:
//    (a') the state itself, when the step being loaded is the very step the state equals:
//    the step it was last saved as or loaded from (clean_step_), the optimizer's
//    state_version() unchanged since (every Step, SetGroup and mutable view bumps it), and the
//    step's manifest the same as then (ManifestIdentity: a checksum of the parsed manifest,
//    every chunk's checksum and every piece; recorded at that save or load, compared with the
//    one just opened, so a step replaced since, quarantined and saved again through another
//    handle, is read afresh). Then the slabs already hold exactly what step 3 would read into
//    them, and the groups and step counts what it would restore: step 3 reads only the
//    trainer's blobs and writes nothing to the state, so there is nothing to undo. Nothing is
//    written, which is how a read-only handle reloads the step it loaded, and a full disk
//    does not stop a reload (#44);
//    (a) the step the state last equalled, if the optimizer's state_version() has not moved
//    since and it is not the step being loaded (it costs nothing; outside (a') the step being
//    loaded is no undo source for itself: a chunk that fails the apply, having written into
//    the slabs, would fail the restore too); (b) the state re-derived (CopyIfDerivable: every
//    step 0 and both moments zero, as a freshly built or model-loaded optimizer's are; the
//    masters are kept in memory in the model dtype when each is a value of it, else in FP32),
//    so a resume in a new process writes nothing before it reads and works on a full disk or a
//    read-only store; otherwise (c) spill the state into a private store
//    <root>/.undo-rank-R-<nonce>/ (checksummed chunks, written straight from the slabs: memory
//    bounded by two chunks; a read-only handle refuses). Vote; a failure removes the spills,
//    the state untouched. Each rank fixes its own: one rank's (a') and another's (c) mix.
// 3. Apply: lifecycle kLoading; with (a') only the trainer's blobs are read; otherwise read
//    every piece straight into the slabs (moments converted in bounded batches when the dtypes
//    differ), then the groups. The model weights are not the Checkpointer's: the trainer writes
//    them from the masters once the load returned (StagedAdamW::WriteModelWeights).
// 4. Vote. All OK: lifecycle kClean, the loaded step is the new undo source (its manifest
//    identity remembered for (a')). Any failure: every rank restores from its undo source
//    ((a'): nothing to restore; (a), (c): as step 3; (b): masters widened from their copy,
//    moments zero, the groups as they were); a restore that fails poisons the optimizer (Step,
//    SetGroup and Save refuse until a complete Load).
// 5. Remove the spill (best effort: recovery removes .undo-* directories at the next Open).
#include <algorithm>
#include <map>
#include <set>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "ckpt/base/status_macros.h"
#include "ckpt/formats/optimizer_record.h"
#include "ckpt/optimizer/checkpointer.h"
#include "optimizer/engine.h"
#include "optimizer/state_io.h"
#include "optimizer/state_layout.h"

namespace ckpt::optimizer {
namespace {

using formats::DType;
using formats::kOptimizerRecordBlob;
using internal::kTrainerPrefix;
using internal::ListNames;
using internal::StateLayout;

// The step's optimizer record (formats/optimizer_record.h), of ckpt's optimizer (AdamW
// groups, and Muon's).
absl::StatusOr<formats::OptimizerRecord> ReadRecord(const CheckpointReader& reader,
                                                    absl::string_view where) {
  CKPT_ASSIGN_OR_RETURN(std::string text, reader.ReadBlob(kOptimizerRecordBlob, 0));
  CKPT_ASSIGN_OR_RETURN(formats::OptimizerRecord record,
                        formats::ParseOptimizerRecord(text, where));
  if (!internal::FindRuleByKey(record.kind).ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, " holds the state of a \"", record.kind,
                     "\" optimizer, which this build of ckpt does not know"));
  }
  return record;
}

// The first moment tensor of the layout (the moments' dtype in a step is one for all), or
// empty when no parameter keeps one.
std::string FirstMomentName(const StateLayout& layout) {
  for (uint32_t p = 0; p < layout.params().size(); ++p) {
    for (const internal::ParamState& s : layout.states(p)) {
      if (s.moment) return s.name;
    }
  }
  return "";
}

// Refuses a record whose groups step with another algorithm than this optimizer's: AdamW's
// moments are no Muon momentum, nor the reverse.
absl::Status CheckAlgorithms(const formats::OptimizerRecord& record,
                             const std::vector<ParamGroup>& groups, absl::string_view where) {
  for (size_t g = 0; g < groups.size() && g < record.groups.size(); ++g) {
    CKPT_ASSIGN_OR_RETURN(const Algorithm saved,
                          internal::RecordAlgorithm(record.groups[g], g, where));
    if (saved != groups[g].algorithm) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": param group ", g, " is ", internal::RuleFor(saved).name(),
          "'s in the checkpoint and ", internal::RuleFor(groups[g].algorithm).name(),
          "'s here, and its state does not carry over; nothing was loaded. "
          "To keep the masters and start the moments afresh, load the model from them "
          "(Checkpointer::LoadModel with ModelLoadOptions::masters; Python: "
          "Checkpointer.load_model(root, masters=True))"));
    }
  }
  return absl::OkStatus();
}

// The record's groups, validated, as this optimizer's `expected` groups.
absl::StatusOr<std::vector<ParamGroup>> RecordGroups(const formats::OptimizerRecord& record,
                                                     size_t expected, absl::string_view where) {
  if (record.groups.size() != expected) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": ", record.groups.size(),
                                                   " param groups, the optimizer has ", expected));
  }
  std::vector<ParamGroup> out;
  for (const formats::OptimizerRecordGroup& g : record.groups) {
    ParamGroup p;
    p.lr = g.lr;
    p.beta1 = g.beta1;
    p.beta2 = g.beta2;
    p.eps = g.eps;
    p.weight_decay = g.weight_decay;
    p.step = g.step;
    p.amsgrad = g.amsgrad;
    CKPT_ASSIGN_OR_RETURN(p.algorithm, internal::RecordAlgorithm(g, out.size(), where));
    p.hyper.insert(g.hyper.begin(), g.hyper.end());
    if (g.muon.has_value()) {
      const formats::OptimizerRecordMuon& m = *g.muon;
      p.muon = {m.momentum, m.nesterov, m.ns_a, m.ns_b, m.ns_c, m.ns_steps,
                m.adjust_lr == formats::kMuonLrOriginal ? MuonLrAdjust::kOriginal
                                                        : MuonLrAdjust::kMatchRmsAdamW};
    }
    CKPT_RETURN_IF_ERROR(ValidateHyperParameters(p, out.size()));
    out.push_back(p);
  }
  return out;
}

// Each of `params`' step count in `record`, found by name (the record's order may differ); a
// parameter the record lacks (the tensor check refuses that load) counts 0.
std::vector<uint64_t> RecordParamSteps(const formats::OptimizerRecord& record,
                                       const std::vector<ParamSpec>& params) {
  std::map<std::string, uint64_t> saved;
  for (size_t i = 0; i < record.params.size(); ++i) {
    saved[record.params[i].name] = formats::ParamStep(record, i);
  }
  std::vector<uint64_t> out;
  for (const ParamSpec& p : params) {
    auto it = saved.find(p.name);
    out.push_back(it == saved.end() ? 0 : it->second);
  }
  return out;
}

// Refuses a record that puts any of `params` in another group than the optimizer does: each
// group's hyper-parameters would land on other parameters. The record's parameter order may
// differ (a checkpoint loads at any parameter order, DESIGN.md §2); names it lacks are the
// tensor check's to report.
absl::Status CheckParamGroups(const formats::OptimizerRecord& record,
                              const std::vector<ParamSpec>& params, absl::string_view where) {
  std::map<std::string, uint64_t> saved;
  for (const formats::OptimizerRecordParam& p : record.params) saved[p.name] = p.group;
  std::vector<std::string> moved;
  for (const ParamSpec& p : params) {
    auto it = saved.find(p.name);
    if (it != saved.end() && it->second != p.group) {
      moved.push_back(absl::StrCat(p.name, " (group ", it->second, " in the checkpoint, ", p.group,
                                   " here)"));
    }
  }
  if (moved.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      where, " puts ", moved.size(), " parameter(s) in other param groups than this optimizer: ",
      internal::ListNames(moved), "; their hyper-parameters would change, so nothing was loaded"));
}

// Preflight's check of each state tensor's shape and dtype (the moments F32 or BF16, both
// alike: a load converts them). REQUIRES: every tensor of `layout` in `reader`.
absl::Status CheckShapes(const CheckpointReader& reader, const StateLayout& layout,
                         size_t params, const std::string& where) {
  const absl::StatusOr<const formats::TensorInfo*> first =
      reader.FindTensor(FirstMomentName(layout));
  const DType moments = first.ok() ? (*first)->dtype : layout.moment_dtype();
  for (uint32_t p = 0; p < params; ++p) {
    for (const internal::ParamState& s : layout.states(p)) {
      const bool moment = s.moment;
      const DType want = moment ? moments : s.dtype;
      const std::string& name = s.name;
      const formats::TensorInfo& t = **reader.FindTensor(name);
      if (t.shape != s.shape || t.dtype != want ||
          (moment && t.dtype != DType::kF32 && t.dtype != DType::kBF16)) {
        return absl::InvalidArgumentError(absl::StrCat(
            where, ": tensor \"", name, "\" is ", formats::DTypeName(t.dtype), " [",
            absl::StrJoin(t.shape, ", "), "], the optimizer needs ", formats::DTypeName(want),
            " [", absl::StrJoin(s.shape, ", "), "]"));
      }
    }
  }
  return absl::OkStatus();
}

// Preflight's check that `reader` holds every element of `pieces` (this rank's) of every state
// tensor. REQUIRES: every tensor of `layout` in `reader`.
absl::Status CheckCoverage(const CheckpointReader& reader, const StateLayout& layout,
                           const std::vector<Piece>& pieces, const std::string& where) {
  for (const Piece& piece : pieces) {
    for (const internal::ParamState& s : layout.states(piece.param)) {
      const std::string& name = s.name;
      // An aux state goes whole with its parameter's one piece.
      const bool whole = s.slab == internal::Slab::kAux;
      const uint64_t begin = whole ? 0 : piece.begin;
      const uint64_t count = whole ? (*reader.FindTensor(name))->numel() : piece.count;
      if (!reader.Covers(name, begin, count)) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, " does not cover elements [", begin, ", ", begin + count,
                         ") of \"", name, "\", which this rank owns"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status Checkpointer::Preflight(const CheckpointReader& reader) const {
  const formats::Manifest& m = reader.manifest();
  const StagedAdamWOptions& o = optimizer_->options();
  const std::string where = absl::StrCat("step ", m.step);
  // Read once (its failure is reported last, after what the tensors say).
  const absl::StatusOr<formats::OptimizerRecord> record = ReadRecord(reader, where);
  // Groups of another algorithm first: that, not the tensors it makes differ, is what to say.
  if (record.ok()) CKPT_RETURN_IF_ERROR(CheckAlgorithms(*record, o.groups, where));
  // Names are looked up in the reader's index, and in a hash set of views into the layout: a
  // step of many small tensors costs no ordered copies of every name.
  absl::flat_hash_set<absl::string_view> expected;
  std::vector<std::string> missing, extra;
  const StateLayout layout = StateLayout::Of(*optimizer_);
  for (uint32_t p = 0; p < o.params.size(); ++p) {
    for (const internal::ParamState& s : layout.states(p)) {
      if (expected.insert(s.name).second && !reader.FindTensor(s.name).ok()) {
        missing.push_back(s.name);
      }
    }
  }
  for (const formats::TensorInfo& t : m.tensors) {
    if (!expected.contains(t.name)) extra.push_back(t.name);
  }
  std::sort(missing.begin(), missing.end());
  std::sort(extra.begin(), extra.end());
  // AMSGrad's maximum on one side only: say so before listing every tensor it makes differ.
  const std::string max_prefix = internal::StateTensorName("max_exp_avg_sq", "");
  const bool saved_max = std::any_of(m.tensors.begin(), m.tensors.end(), [&](const auto& t) {
    return absl::StartsWith(t.name, max_prefix);
  });
  if (saved_max != layout.has_max_exp_avg_sq()) {
    return absl::InvalidArgumentError(absl::StrCat(
        where,
        saved_max ? " was saved by an optimizer with amsgrad (it holds max_exp_avg_sq); build "
                    "this one with amsgrad in the same param groups"
                  : " was saved without amsgrad (it holds no max_exp_avg_sq), and this "
                    "optimizer keeps one (some param group has amsgrad)",
        "; nothing was loaded"));
  }
  if (!missing.empty() || !extra.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, " does not hold this optimizer's state",
        missing.empty() ? "" : absl::StrCat("; missing ", missing.size(), ": ", ListNames(missing)),
        extra.empty() ? ""
                      : absl::StrCat("; not in the optimizer ", extra.size(), ": ",
                                     ListNames(extra))));
  }
  CKPT_RETURN_IF_ERROR(CheckShapes(reader, layout, o.params.size(), where));
  CKPT_RETURN_IF_ERROR(CheckCoverage(reader, layout, o.pieces, where));
  CKPT_RETURN_IF_ERROR(record.status());
  CKPT_RETURN_IF_ERROR(RecordGroups(*record, o.groups.size(), where).status());
  return CheckParamGroups(*record, o.params, where);
}

absl::Status Checkpointer::Apply(const CheckpointReader& reader, Blobs* blobs,
                                 StagedAdamW::LoadScope& scope) {
  const formats::Manifest& m = reader.manifest();
  const StagedAdamWOptions& o = optimizer_->options();
  const std::string where = absl::StrCat("step ", m.step);
  CKPT_ASSIGN_OR_RETURN(formats::OptimizerRecord record, ReadRecord(reader, where));
  CKPT_ASSIGN_OR_RETURN(std::vector<ParamGroup> groups,
                        RecordGroups(record, o.groups.size(), where));
  // The weights are not read: they are the masters rounded (StagedAdamW::WriteModelWeights).
  CKPT_RETURN_IF_ERROR(internal::ReadState(
      reader, StateLayout::Of(*optimizer_),
      {reinterpret_cast<std::byte*>(optimizer_->mutable_master().data()),
       optimizer_->mutable_exp_avg_bytes().data(), optimizer_->mutable_exp_avg_sq_bytes().data(),
       optimizer_->has_max_exp_avg_sq() ? optimizer_->mutable_max_exp_avg_sq_bytes().data()
                                        : nullptr,
       reinterpret_cast<std::byte*>(optimizer_->mutable_aux().data())}));
  scope.RestoreGroups(groups, RecordParamSteps(record, o.params));
  return ReadTrainerBlobs(reader, blobs);
}

absl::Status Checkpointer::ReadTrainerBlobs(const CheckpointReader& reader, Blobs* blobs) const {
  if (blobs == nullptr) return absl::OkStatus();
  const formats::Manifest& m = reader.manifest();
  // This rank's trainer blobs, or rank 0's when the checkpoint was saved by fewer ranks.
  const uint32_t rank = static_cast<uint32_t>(coordinator_->rank()) < m.world_size
                            ? static_cast<uint32_t>(coordinator_->rank())
                            : 0;
  Blobs out;
  for (const formats::BlobInfo& b : m.blobs) {
    if (b.rank != rank || b.name.rfind(kTrainerPrefix, 0) != 0) continue;
    CKPT_ASSIGN_OR_RETURN(out[b.name.substr(sizeof(kTrainerPrefix) - 1)],
                          reader.ReadBlob(b.name, rank));
  }
  *blobs = std::move(out);
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> Checkpointer::AgreeOnLatest(Env* env, const std::string& root) {
  absl::StatusOr<std::string> named = std::string();
  if (coordinator_->rank() == 0) {
    absl::StatusOr<std::optional<uint64_t>> latest = ReadLatest(env, root);
    if (latest.ok() && !latest->has_value()) {
      latest = absl::NotFoundError(absl::StrCat(root, ": no committed step to load"));
    }
    named = latest.ok() ? absl::StatusOr<std::string>(absl::StrCat(**latest)) : latest.status();
  }
  CKPT_ASSIGN_OR_RETURN(named, BroadcastResult(*coordinator_, named, 0));
  uint64_t latest = 0;
  if (!absl::SimpleAtoi(*named, &latest)) {
    return absl::InternalError(absl::StrCat("malformed LATEST from rank 0: ", *named));
  }
  return latest;
}

absl::StatusOr<LoadReport> Checkpointer::Load(std::optional<uint64_t> step, Blobs* blobs) {
  absl::StatusOr<LoadReport> loaded = LoadStep(step, blobs);
  if (!absl::IsDataLoss(loaded.status())) return loaded;
  return Annotate(loaded.status(),
                  "the state is as before the load. To go on, load the newest older step that "
                  "loads intact (Checkpointer::LoadNewestIntact; Python: load(fallback=True)), "
                  "or set the damaged step aside: ckpt-tool quarantine ROOT STEP");
}

absl::StatusOr<LoadReport> Checkpointer::LoadNewestIntact(Blobs* blobs) {
  CKPT_RETURN_IF_ERROR(NoSaveInFlight("load"));
  // LATEST as rank 0 reads it; a damaged LATEST (a read-only handle runs no recovery) leaves
  // every step a candidate.
  absl::StatusOr<uint64_t> latest = AgreeOnLatest(store_->env(), store_->root());
  if (!latest.ok() && !absl::IsDataLoss(latest.status())) return latest.status();
  // The candidates as rank 0 lists them, so that every rank walks the same steps.
  absl::StatusOr<std::string> listed = std::string();
  if (coordinator_->rank() == 0) {
    absl::StatusOr<std::vector<uint64_t>> steps = RetainableSteps(store_->env(), store_->root());
    listed = steps.ok() ? absl::StatusOr<std::string>(absl::StrJoin(*steps, " ")) : steps.status();
  }
  CKPT_ASSIGN_OR_RETURN(listed, BroadcastResult(*coordinator_, listed, 0));
  absl::string_view view = *listed;
  std::vector<uint64_t> candidates;
  if (latest.ok()) candidates.push_back(*latest);
  std::vector<uint64_t> older;
  for (absl::string_view token : absl::StrSplit(view, ' ', absl::SkipEmpty())) {
    uint64_t s = 0;
    if (!absl::SimpleAtoi(token, &s)) return absl::InternalError("malformed step list from rank 0");
    if (!latest.ok() || s < *latest) older.push_back(s);
  }
  candidates.insert(candidates.end(), older.rbegin(), older.rend());
  std::vector<std::string> skipped;
  std::vector<uint64_t> skipped_steps;
  for (uint64_t step : candidates) {
    absl::StatusOr<LoadReport> r = LoadStep(step, blobs);
    if (r.ok()) {
      SetAsideSkipped(skipped_steps, skipped);
      r->skipped = std::move(skipped);
      return r;
    }
    // Only damage passes over a step (a poisoned optimizer, a refusal or an IO error ends it).
    if (!absl::IsDataLoss(r.status())) return r.status();
    skipped.push_back(absl::StrCat("step ", step, ": ", r.status().message()));
    skipped_steps.push_back(step);
  }
  return absl::DataLossError(absl::StrCat(store_->root(), ": no step loads intact (",
                                          absl::StrJoin(skipped, "; "),
                                          "); the state is as before the call"));
}

void Checkpointer::SetAsideSkipped(const std::vector<uint64_t>& steps,
                                   std::vector<std::string>& skipped) {
  // Rank 0's primary, writable handle moves the damaged steps it passed over into quarantine/
  // (newest first, so that LATEST falls back onto the step loaded): the next save then need
  // not be newer than a damaged step, and nothing is deleted. Elsewhere they stay, said so.
  const bool writable = store_->options().primary && !store_->options().read_only;
  for (size_t i = 0; i < steps.size(); ++i) {
    if (coordinator_->rank() != 0) continue;
    if (!writable) {
      absl::StrAppend(&skipped[i], " (left in place: a read-only handle; ckpt-tool quarantine "
                                   "ROOT STEP sets it aside)");
      continue;
    }
    absl::StatusOr<std::string> moved = store_->QuarantineStep(steps[i]);
    absl::StrAppend(&skipped[i], moved.ok() ? absl::StrCat(" (moved into ", *moved, ")")
                                            : absl::StrCat(" (could not be set aside: ",
                                                           moved.status().message(), ")"));
  }
}

absl::StatusOr<LoadReport> Checkpointer::LoadStep(std::optional<uint64_t> step, Blobs* blobs) {
  CKPT_RETURN_IF_ERROR(NoSaveInFlight("load"));
  // Step 1. LATEST is read afresh (another handle may have committed since this one opened) by
  // rank 0 alone and broadcast, so no rank can load another step from a stale cache.
  if (!step.has_value()) {
    CKPT_ASSIGN_OR_RETURN(step, AgreeOnLatest(store_->env(), store_->root()));
  }
  // The CUDA engine's last copies must have reached the slabs before they are spilled or
  // overwritten.
  absl::Status checked = optimizer_->Synchronize();
  absl::StatusOr<std::unique_ptr<CheckpointReader>> reader = store_->OpenStep(*step);
  if (checked.ok()) checked = reader.ok() ? Preflight(**reader) : reader.status();
  CKPT_RETURN_IF_ERROR(Vote(checked));
  // Steps 2 to 5.
  LoadReport report;
  report.step = (*reader)->manifest().step;
  report.saved_world_size = (*reader)->manifest().world_size;
  const StateLayout layout = StateLayout::Of(*optimizer_);
  absl::StatusOr<const formats::TensorInfo*> moments =
      (*reader)->FindTensor(FirstMomentName(layout));
  if (moments.ok()) report.saved_moment_dtype = (*moments)->dtype;
  // Step 2(a'): the state is this very step already.
  report.unchanged = clean_step_ == report.step &&
                     clean_version_ == optimizer_->state_version() &&
                     clean_identity_ == internal::ManifestIdentity((*reader)->manifest());
  Blobs loaded;
  CKPT_RETURN_IF_ERROR(Transact(
      *step,
      [&](StagedAdamW::LoadScope& scope) {
        Blobs* out = blobs != nullptr ? &loaded : nullptr;
        return report.unchanged ? ReadTrainerBlobs(**reader, out) : Apply(**reader, out, scope);
      },
      absl::StrCat("load of step ", report.step), &report.undo_spilled, &report.undo_derived,
      report.unchanged));
  MarkClean(report.step, optimizer_->state_version(), reader->get());
  if (blobs != nullptr) *blobs = std::move(loaded);
  return report;
}

}  // namespace ckpt::optimizer
