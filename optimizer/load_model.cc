// Model-only load (Checkpointer::LoadModel, DESIGN.md §6): new weights under a running
// optimizer. A transaction like Load; its steps 2 to 5 are Checkpointer::Transact
// (optimizer/checkpointer.cc), so a failure anywhere rolls back or poisons exactly as there.
//
// M1. Preflight, nothing touched: resolve the source (a .safetensors file, an HF directory, or
//     a ckpt root whose step, LATEST unless given, rank 0 reads and broadcasts); compile the
//     rename rules; map the source's tensors to the parameters (renames first, then tied
//     weights for parameters still missing); check the names (missing and unexpected ones
//     listed), shapes, dtypes (F32, BF16, F16) and, for a ckpt step, that its pieces cover
//     every element this rank owns. Vote: one rank's refusal ends the load on all.
// M2. Fix the undo source (Load's step 2). A model load from a step of this very store never
//     takes that step as its undo source: a chunk that fails the apply would fail the restore.
// M3. Apply under kLoading: read this rank's elements of every parameter as FP32 straight into
//     the master slab (exact widening from BF16 and F16); zero both moment slabs; every group's
//     step becomes 0, its hyper-parameters stay. The trainer then writes the model weights
//     from the masters (StagedAdamW::WriteModelWeights).
// M4. Vote; on failure every rank restores from its undo source or is poisoned (Load's step 4);
//     remove the spill (step 5).
// M5. The state now equals no committed step but is a construction state, so the next load
//     re-derives it from a copy of the masters (Load's step 2 (b)) and writes nothing.
#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <vector>

#include <re2/re2.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "ckpt/base/status_macros.h"
#include "ckpt/hf_checkpoint.h"
#include "ckpt/tensor_source.h"
#include "ckpt/optimizer/checkpointer.h"
#include "optimizer/state_layout.h"

namespace ckpt::optimizer {
namespace {

using formats::DType;
using internal::ListNames;

// What the path names: an HF checkpoint (a file, or a directory with model.safetensors or its
// index) or a ckpt root (what LooksLikeStore says is one).
absl::StatusOr<bool> IsHfPath(Env* env, const std::string& path) {
  absl::StatusOr<bool> dir = env->IsDirectory(path);
  if (!dir.ok()) return Annotate(dir.status(), absl::StrCat("model source ", path));
  if (!*dir) return true;
  CKPT_ASSIGN_OR_RETURN(std::vector<std::string> children, env->GetChildren(path));
  const std::set<std::string> names(children.begin(), children.end());
  if (names.count(std::string(kHfSingleFileName)) || names.count(std::string(kHfIndexFileName))) {
    return true;
  }
  CKPT_ASSIGN_OR_RETURN(bool store, LooksLikeStore(env, path));
  if (store) return false;
  return absl::NotFoundError(absl::StrCat("model source ", path, " holds neither ",
                                          kHfSingleFileName, ", ", kHfIndexFileName,
                                          " nor what a ckpt root holds"));
}

// A step's tensors a model-only load reads: the model's, not the optimizer's state (unless
// `masters`: the masters are what it reads then).
TensorSource::NameFilter ModelTensorsUnless(bool masters) {
  if (masters) return nullptr;
  return [](absl::string_view name) { return !absl::StartsWith(name, internal::kOptimizerPrefix); };
}

// Which source tensor each parameter takes.
struct Mapping {
  std::vector<std::string> source_of;  // By parameter index.
  std::vector<std::string> tied;       // Parameters taken from their tied tensor.
  uint64_t ignored = 0;
};

// `prefix`: only the source tensors whose names start with it, named without it.
absl::StatusOr<Mapping> MapNames(const TensorSource& source, const std::vector<ParamSpec>& params,
                                 const ModelLoadOptions& options, absl::string_view prefix) {
  const std::string where = absl::StrCat("model load from ", source.Describe());
  std::vector<std::unique_ptr<RE2>> rules;
  for (const RenameRule& rule : options.rename) {
    auto re = std::make_unique<RE2>(rule.pattern, RE2::Quiet);
    std::string why = re->ok() ? "" : re->error();
    if (why.empty() && !re->CheckRewriteString(rule.replacement, &why) && why.empty()) {
      why = "invalid replacement";
    }
    if (!why.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": rename rule \"", rule.pattern,
                                                     "\" -> \"", rule.replacement, "\": ", why));
    }
    rules.push_back(std::move(re));
  }
  std::map<std::string, std::string> renamed;  // Name after the rules -> name in the source.
  for (const auto& [name, tensor] : source.tensors()) {
    if (!absl::StartsWith(name, prefix)) continue;
    std::string to = name.substr(prefix.size());
    for (size_t i = 0; i < rules.size(); ++i) {
      RE2::Replace(&to, *rules[i], options.rename[i].replacement);
    }
    auto [it, inserted] = renamed.emplace(to, name);
    if (!inserted) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": source tensors \"", it->second,
                                                     "\" and \"", name, "\" are both renamed to \"",
                                                     to, "\""));
    }
  }
  Mapping out;
  out.source_of.resize(params.size());
  std::set<std::string> used;
  std::vector<std::string> missing;
  for (size_t p = 0; p < params.size(); ++p) {
    auto found = renamed.find(params[p].name);
    if (found == renamed.end()) {
      auto tie = options.tied.find(params[p].name);
      if (tie != options.tied.end()) found = renamed.find(tie->second);
      if (found != renamed.end()) out.tied.push_back(params[p].name);
    }
    if (found == renamed.end()) {
      missing.push_back(params[p].name);
      continue;
    }
    out.source_of[p] = found->second;
    used.insert(found->second);
  }
  std::vector<std::string> unexpected;
  for (const auto& [to, name] : renamed) {
    if (used.count(name)) continue;
    unexpected.push_back(to == name ? name : absl::StrCat(name, " (renamed ", to, ")"));
  }
  if (!missing.empty() || (!unexpected.empty() && !options.ignore_unexpected)) {
    std::string message = absl::StrCat(where, " does not match the optimizer's parameters");
    if (!missing.empty()) {
      absl::StrAppend(&message, "; missing ", missing.size(), ": ", ListNames(missing));
    }
    if (!unexpected.empty() && !options.ignore_unexpected) {
      absl::StrAppend(&message, "; unexpected ", unexpected.size(), ": ", ListNames(unexpected));
    }
    return absl::InvalidArgumentError(message);
  }
  out.ignored = unexpected.size();
  for (size_t p = 0; p < params.size(); ++p) {
    const SourceTensor& t = source.tensors().at(out.source_of[p]);
    if (t.shape != params[p].shape || !t.floating()) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": tensor \"", out.source_of[p], "\" is ", t.dtype_name, " [",
          absl::StrJoin(t.shape, ", "), "]; parameter \"", params[p].name, "\" needs [",
          absl::StrJoin(params[p].shape, ", "), "] in F32, BF16 or F16"));
    }
  }
  return out;
}

// Step M1's source: whether `source` is HuggingFace safetensors (an error when a step or the
// masters are asked of it, or when it cannot be told), and the ckpt root it names, opened
// read-only, when that is not `own`'s.
struct ResolvedSource {
  absl::StatusOr<bool> hf;
  std::unique_ptr<CheckpointStore> other;  // Null: `own`'s root, or not a ckpt root.
};

ResolvedSource ResolveSource(Env* env, const std::string& source,
                             const ModelLoadOptions& options, const CheckpointStore& own) {
  ResolvedSource out{source.empty() ? false : IsHfPath(env, source), nullptr};
  absl::StatusOr<bool>& hf = out.hf;
  const std::optional<uint64_t>& step = options.step;
  if (hf.ok() && *hf && step.has_value()) {
    hf = absl::InvalidArgumentError(
        absl::StrCat("model source ", source, " is HuggingFace safetensors; it has no step ",
                     *step));
  }
  if (hf.ok() && *hf && options.masters) {
    hf = absl::InvalidArgumentError(absl::StrCat(
        "model source ", source, " is HuggingFace safetensors; it holds no optimizer masters"));
  }
  if (hf.ok() && !*hf && !source.empty()) {
    absl::StatusOr<std::string> real = env->RealPath(source);
    if (!real.ok()) {
      hf = real.status();
    } else if (*real != own.root()) {
      StoreOptions so = own.options();
      so.primary = false;
      so.read_only = true;
      so.logger = nullptr;
      absl::StatusOr<std::unique_ptr<CheckpointStore>> opened = CheckpointStore::Open(*real, so);
      if (opened.ok()) {
        out.other = *std::move(opened);
      } else {
        hf = opened.status();
      }
    }
  }
  return out;
}

// Step M3: this rank's elements of every parameter read as FP32 into the master slab (from the
// source tensors `mapping` names), the moment and aux slabs zeroed, every step count 0.
absl::Status ApplyModel(StagedAdamW& optimizer, TensorSource& from, const Mapping& mapping,
                        StagedAdamW::LoadScope& scope) {
  const std::span<float> master = optimizer.mutable_master();
  std::vector<TensorSource::F32Request> requests;
  for (const internal::StateRun& run : internal::StateLayout::Of(optimizer).Runs()) {
    requests.push_back({mapping.source_of[run.param], run.tensor_begin, run.count,
                        master.subspan(run.slab_offset, run.count)});
  }
  CKPT_RETURN_IF_ERROR(from.ReadF32(requests));
  for (std::span<std::byte> moment :
       {optimizer.mutable_exp_avg_bytes(), optimizer.mutable_exp_avg_sq_bytes(),
        optimizer.mutable_max_exp_avg_sq_bytes(),
        std::as_writable_bytes(optimizer.mutable_aux())}) {
    if (!moment.empty()) std::memset(moment.data(), 0, moment.size());
  }
  std::vector<ParamGroup> groups = optimizer.groups();
  for (ParamGroup& g : groups) g.step = 0;
  scope.RestoreGroups(groups, std::vector<uint64_t>(optimizer.options().params.size(), 0));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ModelLoadReport> Checkpointer::LoadModel(const std::string& source,
                                                        const ModelLoadOptions& options) {
  CKPT_RETURN_IF_ERROR(NoSaveInFlight("model load"));
  Env* env = store_->env();
  ModelLoadReport report;
  // Step M1. What the source is, and which step of a ckpt root (agreed by every rank).
  ResolvedSource resolved = ResolveSource(env, source, options, *store_);
  const absl::StatusOr<bool>& hf = resolved.hf;
  const CheckpointStore* store = resolved.other != nullptr ? resolved.other.get() : store_;
  std::optional<uint64_t> step = options.step;
  // Every rank agrees on the kind of source before rank 0 reads a root's LATEST for all.
  CKPT_RETURN_IF_ERROR(Vote(hf.status()));
  if (!*hf && !step.has_value()) {
    CKPT_ASSIGN_OR_RETURN(step, AgreeOnLatest(env, store->root()));
  }
  absl::Status checked = optimizer_->Synchronize();
  std::unique_ptr<TensorSource> from;
  if (checked.ok()) {
    report.hf = *hf;
    if (!*hf) report.step = *step;
    absl::StatusOr<std::unique_ptr<TensorSource>> opened =
        *hf ? TensorSource::OpenHf(source, env)
            : TensorSource::OpenStep(*store, *step, ModelTensorsUnless(options.masters));
    if (opened.ok()) from = *std::move(opened);
    checked = opened.status();
  }
  const StagedAdamWOptions& o = optimizer_->options();
  Mapping mapping;
  if (checked.ok()) {
    const std::string prefix =
        options.masters ? internal::StateTensorName(internal::kMasterKey, "") : "";
    absl::StatusOr<Mapping> mapped = MapNames(*from, o.params, options, prefix);
    if (mapped.ok()) mapping = *std::move(mapped);
    checked = mapped.status();
  }
  for (const Piece& piece : o.pieces) {
    if (!checked.ok()) break;
    checked = from->CheckCovers(mapping.source_of[piece.param], piece.begin, piece.count);
  }
  CKPT_RETURN_IF_ERROR(Vote(checked));
  report.tensors = o.params.size();
  report.tied = mapping.tied;
  report.ignored = mapping.ignored;
  // Steps M2 to M4.
  auto apply = [&](StagedAdamW::LoadScope& scope) {
    return ApplyModel(*optimizer_, *from, mapping, scope);
  };
  const std::optional<uint64_t> exclude =
      !report.hf && store == store_ ? std::optional<uint64_t>(report.step) : std::nullopt;
  CKPT_RETURN_IF_ERROR(Transact(exclude, apply, absl::StrCat("model load from ", from->Describe()),
                                &report.undo_spilled, &report.undo_derived));
  // Step M5.
  clean_step_.reset();
  return report;
}

}  // namespace ckpt::optimizer
