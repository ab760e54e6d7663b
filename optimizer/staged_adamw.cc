#include "ckpt/optimizer/staged_adamw.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "ckpt/base/status_macros.h"
#include "ckpt/formats/convert.h"
#include "optimizer/cpu_kernels.h"
#include "optimizer/engine.h"
#include "optimizer/host_buffer.h"
#include "optimizer/rules/update_rule.h"
#include "optimizer/slabs.h"
#include "optimizer/thread_pool.h"
#include "optimizer/unit_fence.h"

namespace ckpt::optimizer {

using formats::DType;


StepConstants ComputeStepConstants(const ParamGroup& g, uint64_t t) {
  StepConstants c{};
  internal::RuleFor(g.algorithm).SetConstants(g, t, c);
  return c;
}

namespace {

bool SupportedFloat(DType d) { return d == DType::kF32 || d == DType::kBF16 || d == DType::kF16; }

}  // namespace

absl::Status ValidateHyperParameters(const ParamGroup& g, size_t index) {
  CKPT_ASSIGN_OR_RETURN(const internal::UpdateRule* rule, internal::FindRule(g.algorithm),
                        absl::StrCat("param group ", index));
  return rule->Validate(g, index);
}

namespace {

absl::Status ValidateGroups(const StagedAdamWOptions& o) {
  if (o.groups.empty()) return absl::InvalidArgumentError("no param groups");
  std::vector<bool> used(o.groups.size(), false);
  for (const ParamSpec& p : o.params) {
    if (p.group >= o.groups.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("param \"", p.name, "\" names group ", p.group, " of ", o.groups.size()));
    }
    used[p.group] = true;
  }
  for (size_t i = 0; i < o.groups.size(); ++i) {
    if (!used[i])
      return absl::InvalidArgumentError(absl::StrCat("param group ", i, " has no parameters"));
    CKPT_RETURN_IF_ERROR(ValidateHyperParameters(o.groups[i], i));
  }
  return absl::OkStatus();
}

absl::StatusOr<DType> ValidateParams(const StagedAdamWOptions& o) {
  if (o.params.empty()) return absl::InvalidArgumentError("no parameters");
  for (const ParamSpec& p : o.params) {
    if (!SupportedFloat(p.dtype)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "param \"", p.name, "\" has unsupported dtype ", formats::DTypeName(p.dtype)));
    }
  }
  return o.params[0].dtype;
}

absl::StatusOr<uint64_t> ValidatePieces(const StagedAdamWOptions& o) {
  std::map<uint32_t, std::vector<std::pair<uint64_t, uint64_t>>> ranges;
  uint64_t total = 0;
  for (const Piece& p : o.pieces) {
    if (p.param >= o.params.size())
      return absl::InvalidArgumentError(
          absl::StrCat("piece names param ", p.param, " of ", o.params.size()));
    const uint64_t numel = o.params[p.param].numel();
    // A parameter of no elements has one empty piece (torch steps such a parameter: its
    // state is its step count); any other piece holds elements.
    if ((p.count == 0 && numel != 0) || p.begin > numel || p.count > numel - p.begin) {
      return absl::InvalidArgumentError(
          absl::StrCat("piece [", p.begin, ", +", p.count, ") of \"", o.params[p.param].name,
                       "\" is empty or outside its ", numel, " elements"));
    }
    ranges[p.param].push_back({p.begin, p.begin + p.count});
    total += p.count;
  }
  for (auto& [param, rs] : ranges) {
    std::sort(rs.begin(), rs.end());
    for (size_t i = 1; i < rs.size(); ++i) {
      if (rs[i].first < rs[i - 1].second) {
        return absl::InvalidArgumentError(absl::StrCat("pieces of \"", o.params[param].name,
                                                       "\" overlap at element ", rs[i].first));
      }
    }
  }
  return total;
}

// Each parameter is one its group's rule can step, and this rank holds whole each parameter
// whose rule keeps parameters whole (Muon's orthogonalisation needs all of a matrix,
// docs/design/muon.md). REQUIRES: the groups validated.
absl::Status ValidateRules(const StagedAdamWOptions& o) {
  auto rule = [&](uint32_t param) -> const internal::UpdateRule& {
    return internal::RuleFor(o.groups[o.params[param].group].algorithm);
  };
  for (uint32_t i = 0; i < o.params.size(); ++i) {
    CKPT_RETURN_IF_ERROR(rule(i).CheckParam(o.params[i]));
  }
  for (const Piece& p : o.pieces) {
    if (!rule(p.param).keeps_params_whole()) continue;
    if (p.begin != 0 || p.count != o.params[p.param].numel()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "piece [", p.begin, ", +", p.count, ") of \"", o.params[p.param].name,
          "\" is part of a ", rule(p.param).name(), " parameter: ", rule(p.param).name(),
          " steps each parameter whole, so one rank must hold all of it"));
    }
  }
  return absl::OkStatus();
}

std::vector<Unit> BuildUnits(const StagedAdamWOptions& o) {
  const uint64_t unit_elems = std::max<uint64_t>(16, o.unit_bytes / 4);
  std::vector<Unit> units;
  uint64_t offset = 0;
  for (const Piece& p : o.pieces) {
    if (p.count == 0) continue;  // A parameter of no elements: nothing to update.
    const uint32_t group = o.params[p.param].group;
    const internal::UpdateRule& rule = internal::RuleFor(o.groups[group].algorithm);
    if (rule.keeps_params_whole()) {  // One unit of the whole parameter.
      units.push_back({offset, p.count, group, rule.UnitRows(o.params[p.param])});
      offset += p.count;
      continue;
    }
    uint64_t left = p.count;
    while (left > 0) {
      if (units.empty() || units.back().group != group || units.back().count == unit_elems ||
          units.back().rows != 0) {
        units.push_back({offset, 0, group});
      }
      const uint64_t n = std::min(left, unit_elems - units.back().count);
      units.back().count += n;
      offset += n;
      left -= n;
    }
  }
  return units;
}

bool Aligned(const void* p, size_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

}  // namespace

StagedAdamW::StagedAdamW() = default;
StagedAdamW::~StagedAdamW() {
  // An overlapped step still open: its feeder stops and the weights it wrote go back, before
  // the engine and the slabs go.
  if (overlap_ != nullptr) AbandonOverlap().IgnoreError();
}

absl::StatusOr<std::unique_ptr<StagedAdamW>> StagedAdamW::Create(
    StagedAdamWOptions options, std::span<const std::byte> model_weights) {
  return CreateWith(std::move(options), model_weights, false);
}

absl::StatusOr<std::unique_ptr<StagedAdamW>> StagedAdamW::CreateWith(
    StagedAdamWOptions options, std::span<const std::byte> model_weights, bool keep_max) {
  CKPT_RETURN_IF_ERROR(ValidateGroups(options));
  CKPT_ASSIGN_OR_RETURN(DType dtype, ValidateParams(options));
  CKPT_ASSIGN_OR_RETURN(uint64_t size, ValidatePieces(options));
  CKPT_RETURN_IF_ERROR(ValidateRules(options));
  if (options.unit_bytes < 64) return absl::InvalidArgumentError("unit_bytes must be at least 64");
  std::unique_ptr<StagedAdamW> opt(new StagedAdamW());
  // Where each piece lies in the slabs and in a flat model-weight buffer: back to back, each
  // at a multiple of its element size (no gap at all when the parameters share one dtype).
  uint64_t start = 0, bytes = 0;
  size_t widest = 1;
  for (const Piece& p : options.pieces) {
    const DType d = options.params[p.param].dtype;
    const size_t psize = formats::DTypeSize(d);
    bytes = (bytes + psize - 1) / psize * psize;
    opt->piece_starts_.push_back(start);
    opt->piece_bytes_.push_back(bytes);
    opt->piece_dtypes_.push_back(d);
    opt->mixed_dtypes_ |= d != dtype;
    widest = std::max(widest, psize);
    start += p.count;
    bytes += p.count * psize;
  }
  opt->piece_starts_.push_back(start);
  opt->piece_bytes_.push_back(bytes);
  opt->widest_ = widest;
  uint64_t aux = 0;
  for (const Piece& p : options.pieces) {
    opt->piece_aux_.push_back(aux);
    const ParamSpec& param = options.params[p.param];
    aux += internal::AuxElements(internal::RuleFor(options.groups[param.group].algorithm),
                                 param.shape);
  }
  opt->piece_aux_.push_back(aux);
  if (model_weights.size() != bytes) {
    return absl::InvalidArgumentError(absl::StrCat("model weights hold ", model_weights.size(),
                                                   " bytes, this rank's pieces need ", bytes));
  }
  if (size > 0 && (model_weights.data() == nullptr || !Aligned(model_weights.data(), widest))) {
    return absl::InvalidArgumentError("model weights are null or misaligned");
  }
  opt->options_ = std::move(options);
  opt->model_dtype_ = dtype;
  opt->size_ = size;
  opt->units_ = BuildUnits(opt->options_);
  opt->param_steps_.assign(opt->options_.params.size(), 0);
  opt->has_max_ = keep_max;
  for (const ParamGroup& g : opt->options_.groups) opt->has_max_ |= g.amsgrad;
  for (size_t i = 0; i < opt->param_steps_.size(); ++i) {
    opt->param_steps_[i] = opt->options_.groups[opt->options_.params[i].group].step;
  }
  if (opt->options_.engine == EngineKind::kCpu) {
    CKPT_ASSIGN_OR_RETURN(opt->engine_, NewCpuEngine(opt->options_.threads, opt->options_.isa));
  } else {
    for (const ParamGroup& g : opt->options_.groups) {
      const internal::UpdateRule& rule = internal::RuleFor(g.algorithm);
      if (!rule.has_cuda_kernels()) {
        return absl::UnimplementedError(absl::StrCat(
            "the CUDA engine has no ", rule.name(), " kernels yet: step ", rule.name(),
            " groups on the CPU engine"));
      }
    }
    CKPT_ASSIGN_OR_RETURN(opt->engine_, NewCudaEngine(opt->options_, opt->units_, opt->has_max_));
  }
  const bool pinned = opt->engine_->wants_pinned_slabs();
  const size_t moment_bytes = MomentBytes(opt->options_.moment_dtype);
  opt->slabs_ = std::make_unique<Slabs>();
  CKPT_ASSIGN_OR_RETURN(opt->slabs_->master, internal::HostBuffer::Create(size * 4, 0, pinned));
  CKPT_ASSIGN_OR_RETURN(
      opt->slabs_->exp_avg,
      internal::HostBuffer::Create(size * moment_bytes, internal::kSlabStagger, pinned));
  CKPT_ASSIGN_OR_RETURN(
      opt->slabs_->exp_avg_sq,
      internal::HostBuffer::Create(size * moment_bytes, 2 * internal::kSlabStagger, pinned));
  if (opt->has_max_) {
    CKPT_ASSIGN_OR_RETURN(
        opt->slabs_->max_exp_avg_sq,
        internal::HostBuffer::Create(size * moment_bytes, 3 * internal::kSlabStagger, pinned));
  }
  if (aux > 0) {
    CKPT_ASSIGN_OR_RETURN(opt->slabs_->aux,
                          internal::HostBuffer::Create(aux * 4, 4 * internal::kSlabStagger, pinned));
  }
  // The first copy of the weights into the masters, on every core: (piece, block) tasks.
  constexpr uint64_t kBlock = uint64_t{1} << 22;
  std::vector<std::pair<size_t, uint64_t>> tasks;
  for (size_t k = 0; k < opt->piece_dtypes_.size(); ++k) {
    const uint64_t n = opt->piece_starts_[k + 1] - opt->piece_starts_[k];
    for (uint64_t b = 0; b < n; b += kBlock) tasks.emplace_back(k, b);
  }
  const std::span<float> master = opt->mutable_master();
  internal::ThreadPool pool(static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  pool.ParallelFor(tasks.size(), [&](size_t t) {
    const auto [k, b] = tasks[t];
    const uint64_t at = opt->piece_starts_[k] + b;
    const uint64_t n = std::min(kBlock, opt->piece_starts_[k + 1] - at);
    const size_t esize = formats::DTypeSize(opt->piece_dtypes_[k]);
    formats::Convert(opt->piece_dtypes_[k],
                     model_weights.subspan(opt->piece_bytes_[k] + b * esize, n * esize),
                     DType::kF32, std::as_writable_bytes(master.subspan(at, n)));
  });
  return opt;
}

absl::Status StagedAdamW::AddParams(const std::vector<ParamSpec>& params,
                                    const std::vector<ParamGroup>& groups,
                                    const std::vector<Piece>& pieces,
                                    std::span<const std::byte> weights) {
  CKPT_RETURN_IF_ERROR(CheckClean("add parameters"));
  CKPT_RETURN_IF_ERROR(CheckNoOverlap("add parameters"));
  if (fence_ != nullptr) {
    return absl::FailedPreconditionError(
        "add parameters: an async save is in flight (its writer reads the slabs); finalize it "
        "first");
  }
  std::set<std::string> taken;
  for (const ParamSpec& p : options_.params) taken.insert(p.name);
  for (const ParamSpec& p : params) {
    if (!taken.insert(p.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("add parameters: \"", p.name, "\" is already a parameter"));
    }
  }
  StagedAdamWOptions grown = options_;
  grown.params.insert(grown.params.end(), params.begin(), params.end());
  grown.groups.insert(grown.groups.end(), groups.begin(), groups.end());
  for (size_t g = options_.groups.size(); g < grown.groups.size(); ++g) grown.groups[g].step = 0;
  grown.pieces.insert(grown.pieces.end(), pieces.begin(), pieces.end());
  // `weights` is the new pieces' own flat buffer: each at a multiple of its element size.
  uint64_t need = 0;
  for (const Piece& p : pieces) {
    if (p.param >= grown.params.size()) {
      return absl::InvalidArgumentError(absl::StrCat("add parameters: a piece names param ",
                                                     p.param, " of ", grown.params.size()));
    }
    const size_t psize = formats::DTypeSize(grown.params[p.param].dtype);
    need = (need + psize - 1) / psize * psize + p.count * psize;
  }
  if (weights.size() != need) {
    return absl::InvalidArgumentError(absl::StrCat("add parameters: the new weights hold ",
                                                   weights.size(), " bytes, the new pieces need ",
                                                   need));
  }
  // The grown flat weight buffer: the current pieces as they are (their offsets do not move),
  // then the new ones.
  CKPT_RETURN_IF_ERROR(Synchronize());
  std::vector<std::byte> all(weight_bytes());
  if (size_ > 0) {
    // The current weights are the masters rounded; they only seed masters overwritten below.
    StepArgs where;
    where.params = all.data();
    CKPT_RETURN_IF_ERROR(engine_->WriteWeights(View(), units_, where, std::nullopt));
  }
  uint64_t from = 0;
  for (const Piece& p : pieces) {
    const size_t psize = formats::DTypeSize(grown.params[p.param].dtype);
    from = (from + psize - 1) / psize * psize;
    all.resize((all.size() + psize - 1) / psize * psize);
    all.insert(all.end(), weights.begin() + static_cast<ptrdiff_t>(from),
               weights.begin() + static_cast<ptrdiff_t>(from + p.count * psize));
    from += p.count * psize;
  }
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<StagedAdamW> next, CreateWith(std::move(grown), all, has_max_));
  // The current state, bit for bit, into the prefix of the grown slabs.
  std::memcpy(next->mutable_master().data(), master().data(), size_ * 4);
  if (!moments_untouched_) {
    std::memcpy(next->mutable_exp_avg_bytes().data(), exp_avg_bytes().data(),
                size_ * moment_bytes());
    std::memcpy(next->mutable_exp_avg_sq_bytes().data(), exp_avg_sq_bytes().data(),
                size_ * moment_bytes());
    if (has_max_) {
      std::memcpy(next->mutable_max_exp_avg_sq_bytes().data(), max_exp_avg_sq_bytes().data(),
                  size_ * moment_bytes());
    }
  }
  // The aux state of the current pieces, which come first in the grown aux slab too.
  if (!aux().empty()) std::memcpy(next->mutable_aux().data(), aux().data(), aux().size_bytes());
  // The current counts; the new parameters start at 0 (Create gave them their group's).
  std::fill(next->param_steps_.begin(), next->param_steps_.end(), 0);
  std::copy(param_steps_.begin(), param_steps_.end(), next->param_steps_.begin());
  for (size_t g = 0; g < options_.groups.size(); ++g) next->options_.groups[g] = options_.groups[g];
  next->SyncGroupSteps();
  // Take the grown layout; the old slabs and engine go (the engine drained first).
  CKPT_RETURN_IF_ERROR(engine_->Synchronize());
  engine_ = std::move(next->engine_);
  slabs_ = std::move(next->slabs_);
  spare_.reset();  // The next overlapped step allocates one of the grown size.
  options_ = std::move(next->options_);
  size_ = next->size_;
  units_ = std::move(next->units_);
  piece_starts_ = std::move(next->piece_starts_);
  piece_dtypes_ = std::move(next->piece_dtypes_);
  piece_bytes_ = std::move(next->piece_bytes_);
  mixed_dtypes_ = next->mixed_dtypes_;
  has_max_ = next->has_max_;
  widest_ = next->widest_;
  param_steps_ = std::move(next->param_steps_);
  ++state_version_;
  return absl::OkStatus();
}

absl::Status StagedAdamW::CheckClean(absl::string_view what) const {
  if (lifecycle_ == Lifecycle::kClean) return absl::OkStatus();
  if (lifecycle_ == Lifecycle::kLoading) {
    return absl::FailedPreconditionError(absl::StrCat(what, ": a load is being applied"));
  }
  return absl::FailedPreconditionError(absl::StrCat(
      what, ": the optimizer is poisoned by a failed load that could not be rolled back (",
      poison_reason_, "); a complete load clears it"));
}

StagedAdamW::LoadScope StagedAdamW::BeginLoad() {
  const Lifecycle before = lifecycle_;
  lifecycle_ = Lifecycle::kLoading;
  return LoadScope(this, before);
}

StagedAdamW::LoadScope::LoadScope(LoadScope&& other) noexcept
    : optimizer_(std::exchange(other.optimizer_, nullptr)), before_(other.before_) {}

StagedAdamW::LoadScope::~LoadScope() {
  if (optimizer_ != nullptr) Poison("a load ended without committing or rolling back");
}

void StagedAdamW::LoadScope::RestoreGroups(const std::vector<ParamGroup>& groups,
                                           const std::vector<uint64_t>& param_steps) {
  optimizer_->options_.groups = groups;
  optimizer_->param_steps_ = param_steps;
  optimizer_->SyncGroupSteps();
  ++optimizer_->state_version_;
}

void StagedAdamW::SyncGroupSteps() {
  for (ParamGroup& g : options_.groups) g.step = 0;
  for (size_t i = 0; i < param_steps_.size(); ++i) {
    uint64_t& step = options_.groups[options_.params[i].group].step;
    step = std::max(step, param_steps_[i]);
  }
}

void StagedAdamW::LoadScope::Commit() {
  optimizer_->lifecycle_ = Lifecycle::kClean;
  optimizer_->poison_reason_.clear();
  optimizer_ = nullptr;
}

void StagedAdamW::LoadScope::RolledBack() {
  optimizer_->lifecycle_ = before_;
  optimizer_ = nullptr;
}

void StagedAdamW::LoadScope::Poison(std::string why) {
  optimizer_->lifecycle_ = Lifecycle::kPoisoned;
  optimizer_->poison_reason_ = std::move(why);
  optimizer_ = nullptr;
}

StagedAdamW::FenceScope StagedAdamW::InstallFence(internal::UnitFence* fence) {
  if (overlap_ != nullptr) {
    // The open overlapped step's feeder speculates nothing more (docs/design/overlap.md).
    std::lock_guard<std::mutex> lock(overlap_->mu);
    overlap_->fenced = true;
  }
  fence_ = fence;
  return FenceScope(this);
}

StagedAdamW::FenceScope::FenceScope(FenceScope&& other) noexcept
    : optimizer_(std::exchange(other.optimizer_, nullptr)) {}

StagedAdamW::FenceScope::~FenceScope() {
  if (optimizer_ != nullptr) optimizer_->fence_ = nullptr;
}

SlabView StagedAdamW::View() const {
  return SlabView{size_ > 0 ? reinterpret_cast<float*>(slabs_->master.data()) : nullptr,
                  slabs_->exp_avg.data(),
                  slabs_->exp_avg_sq.data(),
                  slabs_->max_exp_avg_sq.data(),
                  options_.moment_dtype,
                  piece_starts_,
                  piece_dtypes_,
                  piece_bytes_,
                  options_.pieces,
                  options_.params,
                  slabs_->aux.valid() ? reinterpret_cast<float*>(slabs_->aux.data()) : nullptr,
                  piece_aux_};
}

absl::Status StagedAdamW::CheckPieceBuffers(std::span<const PieceBuffers> pieces,
                                            std::optional<DType> grad_dtype,
                                            std::span<const uint8_t> stepped,
                                            absl::string_view what) const {
  if (pieces.size() != options_.pieces.size()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", pieces.size(),
                                                   " piece buffers for ",
                                                   options_.pieces.size(), " pieces"));
  }
  for (size_t k = 0; k < pieces.size(); ++k) {
    const PieceBuffers& b = pieces[k];
    const uint32_t param = options_.pieces[k].param;
    if (!stepped.empty() && stepped[param] == 0) {
      continue;  // Not stepped: its buffers are not touched and may be null.
    }
    if (options_.pieces[k].count == 0) continue;  // A parameter of no elements: none either.
    const std::string& name = options_.params[param].name;
    if ((grad_dtype.has_value() && b.grads == nullptr) || b.params == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": null gradient or parameter buffer of piece ", k, " (", name, ")"));
    }
    if ((grad_dtype.has_value() && !Aligned(b.grads, formats::DTypeSize(*grad_dtype))) ||
        !Aligned(b.params, formats::DTypeSize(piece_dtypes_[k]))) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": gradient or parameter buffer of piece ", k, " (", name,
          ") is misaligned for its dtype"));
    }
  }
  return absl::OkStatus();
}

absl::Status StagedAdamW::WriteModelWeights(void* dest, std::optional<CudaStreamView> stream) {
  if (size_ > 0 && (dest == nullptr || !Aligned(dest, widest_))) {
    return absl::InvalidArgumentError("model weights destination is null or misaligned");
  }
  StepArgs where;
  where.params = dest;
  return WriteWeightsTo(where, stream);
}

absl::Status StagedAdamW::WriteModelWeights(std::span<const PieceBuffers> pieces,
                                            std::optional<CudaStreamView> stream) {
  CKPT_RETURN_IF_ERROR(CheckPieceBuffers(pieces, std::nullopt, {}, "write the model weights"));
  StepArgs where;
  where.pieces = pieces;
  return WriteWeightsTo(where, stream);
}

absl::Status StagedAdamW::WriteWeightsTo(const StepArgs& where,
                                         const std::optional<CudaStreamView>& stream) {
  CKPT_RETURN_IF_ERROR(CheckClean("write the model weights"));
  CKPT_RETURN_IF_ERROR(CheckNoOverlap("write the model weights"));
  if (size_ == 0) return absl::OkStatus();
  if (gate_open()) {  // Written after the last step's writes, on the stream or the host.
    if (stream.has_value()) {
      CKPT_RETURN_IF_ERROR(AwaitStep(*stream));
    } else {
      CKPT_RETURN_IF_ERROR(Synchronize());
    }
  }
  if (stream.has_value() && options_.engine == EngineKind::kCpu) {
    return absl::InvalidArgumentError(
        "the CPU engine writes host memory: WriteModelWeights takes no stream there");
  }
  return engine_->WriteWeights(View(), units_, where, stream);
}

absl::Status StagedAdamW::ValidateStepArgs(const StepArgs& args) {
  if (!SupportedFloat(args.grad_dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat("unsupported gradient dtype ", formats::DTypeName(args.grad_dtype)));
  }
  if (!args.stepped.empty() && args.stepped.size() != options_.params.size()) {
    return absl::InvalidArgumentError(absl::StrCat("step: ", args.stepped.size(),
                                                   " stepped flags for ",
                                                   options_.params.size(), " parameters"));
  }
  if (!args.pieces.empty()) {
    CKPT_RETURN_IF_ERROR(CheckPieceBuffers(args.pieces, args.grad_dtype, args.stepped, "step"));
  } else if (size_ > 0) {
    if (args.grads == nullptr || args.params == nullptr)
      return absl::InvalidArgumentError("null gradient or parameter buffer");
    if (!Aligned(args.grads, formats::DTypeSize(args.grad_dtype)) ||
        !Aligned(args.params, widest_)) {
      return absl::InvalidArgumentError("gradient or parameter buffer is misaligned for its dtype");
    }
  }
  if (!std::isfinite(args.grad_scale))
    return absl::InvalidArgumentError("gradient scale is not finite");
  return absl::OkStatus();
}

StepPlan StagedAdamW::PlanStep(const StepArgs& args) const {
  // Per piece, the constants of its parameter's group at the parameter's own next step, each
  // distinct (group, step) pair computed once.
  StepPlan plan;
  std::map<std::pair<uint32_t, uint64_t>, uint32_t> index;
  plan.piece_constants.reserve(options_.pieces.size());
  for (const Piece& piece : options_.pieces) {
    if (!args.stepped.empty() && args.stepped[piece.param] == 0) {
      plan.piece_constants.push_back(StepPlan::kSkipped);
      continue;
    }
    const uint32_t group = options_.params[piece.param].group;
    const uint64_t t = param_steps_[piece.param] + 1;
    auto [it, added] = index.try_emplace({group, t}, static_cast<uint32_t>(plan.constants.size()));
    if (added) plan.constants.push_back(ComputeStepConstants(options_.groups[group], t));
    plan.piece_constants.push_back(it->second);
  }
  return plan;
}

void StagedAdamW::AdvanceSteps(const StepArgs& args) {
  for (uint32_t i = 0; i < param_steps_.size(); ++i) {
    if (args.stepped.empty() || args.stepped[i] != 0) ++param_steps_[i];
  }
  SyncGroupSteps();
}

absl::StatusOr<StepReport> StagedAdamW::Step(const StepArgs& args) {
  CKPT_RETURN_IF_ERROR(CheckClean("step"));
  CKPT_RETURN_IF_ERROR(CheckNoOverlap("step"));
  CKPT_RETURN_IF_ERROR(ValidateStepArgs(args));
  // The last step's gate: this step's writes, and what the stream queues after them, come
  // after the last step's writes.
  if (gate_open() && args.stream.has_value()) CKPT_RETURN_IF_ERROR(AwaitStep(*args.stream));
  ++state_version_;
  moments_untouched_ = false;
  const StepPlan plan = PlanStep(args);
  CKPT_ASSIGN_OR_RETURN(StepReport report, StepUnits(args, plan));
  if (!report.skipped) AdvanceSteps(args);
  return report;
}

absl::StatusOr<StepReport> StagedAdamW::StepUnits(const StepArgs& args, const StepPlan& plan) {
  const SlabView view = View();
  // A Muon matrix records no written event: a gate could not order its readers.
  if (args.gate && fence_ == nullptr && !units_.empty() && engine_->queues_only() &&
      !has_whole_params()) {
    return StepGated(args, plan);
  }
  if (fence_ == nullptr || units_.empty()) {
    CKPT_ASSIGN_OR_RETURN(StepReport report,
                          engine_->Step(args, units_, plan, view, size_));
    if (!report.skipped) CKPT_RETURN_IF_ERROR(engine_->OrderCallerAfterStep(args));
    return report;
  }
  // An async save is writing: the whole step is checked first (a skipped step changes
  // nothing), then the units go through the engine in batches, each once the fence lets it go.
  StepReport report;
  if (args.check_finite) {
    CKPT_ASSIGN_OR_RETURN(report, engine_->CheckFinite(args, units_, plan, view, size_));
    if (report.skipped) return report;
  }
  StepArgs unchecked = args;
  unchecked.check_finite = false;
  // The writer needs a core of its own while the step runs beside it.
  engine_->SetSpareCores(1);
  absl::Cleanup all_cores = [&] { engine_->SetSpareCores(0); };
  // Units the step leaves alone (every piece skipped) need not pass the fence: the writer
  // takes them as they are, with no copy and no wait.
  std::vector<bool> done(units_.size(), false);
  size_t left = units_.size();
  for (size_t u = 0; u < units_.size(); ++u) {
    bool active = false;
    ForEachSegment(args, view, plan, units_[u].offset, units_[u].count, 0,
                   [&](uint64_t, uint64_t, const std::byte*, std::byte*, uint32_t c, DType) {
                     active |= c != StepPlan::kSkipped;
                   });
    if (!active) {
      done[u] = true;
      --left;
    }
  }
  std::vector<size_t> ready;
  std::vector<Unit> batch;
  for (; left > 0; left -= ready.size()) {
    ready.clear();
    fence_->Acquire(done, &ready);
    batch.clear();
    for (size_t i : ready) {
      batch.push_back(units_[i]);
      done[i] = true;
    }
    CKPT_ASSIGN_OR_RETURN(StepReport part,
                          engine_->Step(unchecked, batch, plan, view, size_));
    report.done = part.done;
  }
  // Once, after the last batch: the batches' kernels overlap across slots as in a plain step.
  CKPT_RETURN_IF_ERROR(engine_->OrderCallerAfterStep(args));
  return report;
}

// StepArgs::gate: every unit in slab order, each recording its written event; the units that
// step await their readers (AwaitPieces) instead of the caller's stream waiting for them all.
absl::StatusOr<StepReport> StagedAdamW::StepGated(const StepArgs& args, const StepPlan& plan) {
  const SlabView view = View();
  CKPT_RETURN_IF_ERROR(engine_->PrepareUnitEvents(units_.size()));
  std::vector<uint32_t> ids(units_.size());
  for (size_t u = 0; u < units_.size(); ++u) ids[u] = static_cast<uint32_t>(u);
  StepPlan gated = plan;
  gated.unit_ids = ids;
  CKPT_ASSIGN_OR_RETURN(StepReport report, engine_->Step(args, units_, gated, view, size_));
  if (report.skipped) return report;
  gate_units_.assign(units_.size(), 0);
  for (size_t u = 0; u < units_.size(); ++u) {
    ForEachSegment(args, view, plan, units_[u].offset, units_[u].count, 0,
                   [&](uint64_t, uint64_t, const std::byte*, std::byte*, uint32_t c, DType) {
                     if (c != StepPlan::kSkipped) gate_units_[u] = 1;
                   });
  }
  gate_left_ = static_cast<uint64_t>(std::count(gate_units_.begin(), gate_units_.end(), 1));
  if (gate_left_ == 0) gate_units_.clear();
  report.gated = gate_left_ > 0;
  return report;
}

std::span<const float> StagedAdamW::aux() const {
  return {reinterpret_cast<const float*>(slabs_->aux.data()), piece_aux_.back()};
}

std::span<float> StagedAdamW::mutable_aux() {
  ++state_version_;
  return {reinterpret_cast<float*>(slabs_->aux.data()), piece_aux_.back()};
}

uint64_t StagedAdamW::AuxStart(uint64_t slab_offset) const {
  const auto k = static_cast<size_t>(
      std::lower_bound(piece_starts_.begin(), piece_starts_.end() - 1, slab_offset) -
      piece_starts_.begin());
  return piece_aux_[k];
}

bool StagedAdamW::has_whole_params() const {
  return std::any_of(options_.groups.begin(), options_.groups.end(),
                     [](const ParamGroup& g) {
                       return internal::RuleFor(g.algorithm).keeps_params_whole();
                     });
}

absl::Status StagedAdamW::SetGroup(size_t index, const ParamGroup& group) {
  if (index >= options_.groups.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("param group ", index, " does not exist (", options_.groups.size(), ")"));
  }
  CKPT_RETURN_IF_ERROR(CheckClean("set a param group"));
  CKPT_RETURN_IF_ERROR(ValidateHyperParameters(group, index));
  if (group.amsgrad && !has_max_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "param group ", index, ": amsgrad needs the max_exp_avg_sq slab, which this optimizer "
        "does not have: build it with amsgrad set in some group"));
  }
  if (group.algorithm != options_.groups[index].algorithm) {
    return absl::InvalidArgumentError(absl::StrCat(
        "param group ", index, ": its algorithm (AdamW or Muon) is fixed when it is added"));
  }
  ++state_version_;
  ParamGroup& g = options_.groups[index];
  const uint64_t step = g.step;
  g = group;
  g.step = step;
  return absl::OkStatus();
}

absl::Status StagedAdamW::ReleaseDevice() {
  CKPT_RETURN_IF_ERROR(CheckNoOverlap("release the device"));
  CKPT_RETURN_IF_ERROR(engine_->Release());  // Synchronizes: every write has run.
  gate_left_ = 0;
  gate_units_.clear();
  return absl::OkStatus();
}
absl::Status StagedAdamW::RestoreDevice() { return engine_->Restore(); }
absl::Status StagedAdamW::Synchronize() {
  if (overlap_ != nullptr) {  // The feeder may be in the engine.
    std::lock_guard<std::mutex> lock(overlap_->engine_mu);
    return engine_->Synchronize();
  }
  CKPT_RETURN_IF_ERROR(engine_->Synchronize());
  gate_left_ = 0;  // The host has waited for every write: no reader can race them now.
  gate_units_.clear();
  return absl::OkStatus();
}

absl::StatusOr<CudaStreamView> CudaStreamView::Of(CUstream_st* stream) {
  if (stream == nullptr) {
    return absl::InvalidArgumentError(
        "a null CUDA stream handle: name the legacy default stream with CudaStreamView::Legacy()");
  }
  return CudaStreamView(stream);
}

absl::Status StagedAdamW::CopyStateAsF32(StateTensor which, std::span<float> out) {
  const uint64_t size = which == StateTensor::kAux ? piece_aux_.back() : size_;
  if (out.size() != size) {
    return absl::InvalidArgumentError(
        absl::StrCat("state copy: ", out.size(), " elements asked, the optimizer has ", size));
  }
  return CopyStateRangeAsF32(which, 0, out);
}

absl::Status StagedAdamW::CopyStateRangeAsF32(StateTensor which, uint64_t offset,
                                              std::span<float> out) {
  if (which == StateTensor::kAux) {
    const uint64_t aux_size = piece_aux_.back();
    if (offset > aux_size || out.size() > aux_size - offset) {
      return absl::OutOfRangeError(absl::StrCat("state copy: aux elements [", offset, ", +",
                                                out.size(), ") lie past the optimizer's ",
                                                aux_size));
    }
    CKPT_RETURN_IF_ERROR(Synchronize());
    std::memcpy(out.data(), aux().data() + offset, out.size() * 4);
    return absl::OkStatus();
  }
  if (offset > size_ || out.size() > size_ - offset) {
    return absl::OutOfRangeError(absl::StrCat("state copy: elements [", offset, ", +",
                                              out.size(), ") lie past the optimizer's ", size_));
  }
  if (which == StateTensor::kMaxExpAvgSq && !has_max_) {
    return absl::InvalidArgumentError(
        "state copy: this optimizer keeps no max_exp_avg_sq (no group uses amsgrad)");
  }
  CKPT_RETURN_IF_ERROR(Synchronize());
  if (which == StateTensor::kMaster) {
    std::memcpy(out.data(), master().data() + offset, out.size() * 4);
    return absl::OkStatus();
  }
  const std::span<const std::byte> bytes = which == StateTensor::kExpAvg    ? exp_avg_bytes()
                                           : which == StateTensor::kExpAvgSq ? exp_avg_sq_bytes()
                                                                             : max_exp_avg_sq_bytes();
  const size_t esize = moment_bytes();
  const std::span<const std::byte> range = bytes.subspan(offset * esize, out.size() * esize);
  if (esize == 4) {
    std::memcpy(out.data(), range.data(), range.size());
    return absl::OkStatus();
  }
  formats::Convert(DType::kBF16, range, DType::kF32, std::as_writable_bytes(out));
  return absl::OkStatus();
}

absl::Status StagedAdamW::SetState(std::span<const float> master, std::span<const float> exp_avg,
                                   std::span<const float> exp_avg_sq,
                                   std::span<const uint64_t> param_steps,
                                   std::span<const float> max_exp_avg_sq,
                                   std::span<const float> aux_state) {
  CKPT_RETURN_IF_ERROR(CheckClean("set the state"));
  CKPT_RETURN_IF_ERROR(CheckNoOverlap("set the state"));
  if (fence_ != nullptr) {
    return absl::FailedPreconditionError(
        "set the state: an async save is in flight (its writer reads the slabs); finalize it "
        "first");
  }
  if ((!master.empty() && master.size() != size_) || exp_avg.size() != size_ ||
      exp_avg_sq.size() != size_ ||
      (!max_exp_avg_sq.empty() && max_exp_avg_sq.size() != size_)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "set the state: the optimizer has ", size_, " elements; given master ", master.size(),
        ", exp_avg ", exp_avg.size(), ", exp_avg_sq ", exp_avg_sq.size(), ", max_exp_avg_sq ",
        max_exp_avg_sq.size()));
  }
  if (!max_exp_avg_sq.empty() && !has_max_) {
    return absl::InvalidArgumentError(
        "set the state: max_exp_avg_sq given, but no group of this optimizer uses amsgrad");
  }
  if (!aux_state.empty() && aux_state.size() != piece_aux_.back()) {
    return absl::InvalidArgumentError(absl::StrCat("set the state: the optimizer keeps ",
                                                   piece_aux_.back(), " aux elements; given ",
                                                   aux_state.size()));
  }
  if (param_steps.size() != options_.params.size()) {
    return absl::InvalidArgumentError(absl::StrCat("set the state: ", param_steps.size(),
                                                   " step counts for ",
                                                   options_.params.size(), " parameters"));
  }
  const std::pair<const char*, std::span<const float>> named[] = {
      {"master", master},
      {"exp_avg", exp_avg},
      {"exp_avg_sq", exp_avg_sq},
      {"max_exp_avg_sq", max_exp_avg_sq},
      {"aux", aux_state}};
  for (const auto& [name, values] : named) {
    for (size_t i = 0; i < values.size(); ++i) {
      if (!std::isfinite(values[i])) {
        return absl::InvalidArgumentError(absl::StrCat("set the state: ", name, " element ", i,
                                                       " is ", values[i]));
      }
    }
  }
  CKPT_RETURN_IF_ERROR(Synchronize());
  if (!master.empty()) std::memcpy(mutable_master().data(), master.data(), size_ * 4);
  const std::pair<std::span<const float>, std::span<std::byte>> moments[] = {
      {exp_avg, mutable_exp_avg_bytes()}, {exp_avg_sq, mutable_exp_avg_sq_bytes()}};
  for (const auto& [from, to] : moments) {
    formats::Convert(DType::kF32, std::as_bytes(from),
                     moment_bytes() == 4 ? DType::kF32 : DType::kBF16, to);
  }
  if (has_max_) {
    const std::span<std::byte> to = mutable_max_exp_avg_sq_bytes();
    if (max_exp_avg_sq.empty()) {
      std::memset(to.data(), 0, to.size());
    } else {
      formats::Convert(DType::kF32, std::as_bytes(max_exp_avg_sq),
                       moment_bytes() == 4 ? DType::kF32 : DType::kBF16, to);
    }
  }
  if (!aux().empty()) {
    const std::span<float> to = mutable_aux();
    if (aux_state.empty()) {
      std::memset(to.data(), 0, to.size_bytes());
    } else {
      std::memcpy(to.data(), aux_state.data(), to.size_bytes());
    }
  }
  param_steps_.assign(param_steps.begin(), param_steps.end());
  SyncGroupSteps();
  ++state_version_;
  return absl::OkStatus();
}

absl::Status StagedAdamW::SetMasters(uint64_t offset, std::span<const float> values) {
  CKPT_RETURN_IF_ERROR(CheckClean("set masters"));
  CKPT_RETURN_IF_ERROR(CheckNoOverlap("set masters"));
  if (offset > size_ || values.size() > size_ - offset) {
    return absl::InvalidArgumentError(absl::StrCat("set masters: elements [", offset, ", +",
                                                   values.size(), ") are outside the ", size_,
                                                   " this optimizer holds"));
  }
  for (size_t i = 0; i < values.size(); ++i) {
    if (!std::isfinite(values[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat("set masters: slab element ", offset + i, " would be ", values[i]));
    }
  }
  if (values.empty()) return absl::OkStatus();
  CKPT_RETURN_IF_ERROR(Synchronize());
  if (fence_ != nullptr) {
    // The save must keep the masters from before: wait until the fence has let every unit
    // that holds one of the elements go (written, or copied aside).
    std::vector<bool> done(units_.size(), true);
    size_t left = 0;
    for (size_t u = 0; u < units_.size(); ++u) {
      if (units_[u].offset < offset + values.size() &&
          offset < units_[u].offset + units_[u].count) {
        done[u] = false;
        ++left;
      }
    }
    std::vector<size_t> ready;
    while (left > 0) {
      ready.clear();
      fence_->Acquire(done, &ready);
      for (size_t u : ready) done[u] = true;
      left -= ready.size();
    }
  }
  std::memcpy(mutable_master().data() + offset, values.data(), values.size() * 4);
  return absl::OkStatus();
}

uint64_t StagedAdamW::device_bytes() const { return engine_->device_bytes(); }
std::string StagedAdamW::engine_name() const { return engine_->name(); }

std::span<const float> StagedAdamW::master() const {
  return {reinterpret_cast<const float*>(slabs_->master.data()), size_};
}
std::span<const float> StagedAdamW::exp_avg() const {
  if (options_.moment_dtype != MomentDType::kF32) return {};
  return {reinterpret_cast<const float*>(slabs_->exp_avg.data()), size_};
}
std::span<const float> StagedAdamW::exp_avg_sq() const {
  if (options_.moment_dtype != MomentDType::kF32) return {};
  return {reinterpret_cast<const float*>(slabs_->exp_avg_sq.data()), size_};
}
std::span<const std::byte> StagedAdamW::exp_avg_bytes() const {
  return {slabs_->exp_avg.data(), size_ * moment_bytes()};
}
std::span<const std::byte> StagedAdamW::exp_avg_sq_bytes() const {
  return {slabs_->exp_avg_sq.data(), size_ * moment_bytes()};
}
std::span<const std::byte> StagedAdamW::max_exp_avg_sq_bytes() const {
  if (!has_max_) return {};
  return {slabs_->max_exp_avg_sq.data(), size_ * moment_bytes()};
}
std::span<float> StagedAdamW::mutable_master() {
  ++state_version_;
  return {reinterpret_cast<float*>(slabs_->master.data()), size_};
}
std::span<std::byte> StagedAdamW::mutable_exp_avg_bytes() {
  ++state_version_;
  moments_untouched_ = false;
  return {slabs_->exp_avg.data(), size_ * moment_bytes()};
}
std::span<std::byte> StagedAdamW::mutable_exp_avg_sq_bytes() {
  ++state_version_;
  moments_untouched_ = false;
  return {slabs_->exp_avg_sq.data(), size_ * moment_bytes()};
}

std::span<std::byte> StagedAdamW::mutable_max_exp_avg_sq_bytes() {
  if (!has_max_) return {};
  ++state_version_;
  moments_untouched_ = false;
  return {slabs_->max_exp_avg_sq.data(), size_ * moment_bytes()};
}

}  // namespace ckpt::optimizer
