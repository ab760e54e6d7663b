// StagedAdamW's creation (ckpt/optimizer/staged_adamw.h): the options validated (groups, dtypes,
// pieces, each rule's parameters), the pieces laid out in the slabs and in the flat model-weight
// buffer, the units cut, the engine chosen, the slabs allocated and the masters seeded from the
// weights. The step is in optimizer/staged_adamw.cc, the state's views and setters in
// optimizer/staged_adamw_state.cc, AddParams in optimizer/staged_adamw_add_params.cc.
#include <algorithm>
#include <map>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "ckpt/base/status_macros.h"
#include "ckpt/formats/convert.h"
#include "ckpt/optimizer/staged_adamw.h"
#include "optimizer/buffer_checks.h"
#include "optimizer/engine.h"
#include "optimizer/host_buffer.h"
#include "optimizer/rules/update_rule.h"
#include "optimizer/slabs.h"
#include "optimizer/thread_pool.h"

namespace ckpt::optimizer {

using formats::DType;

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
    if (!internal::SupportedFloat(p.dtype)) {
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

// Where each piece lies in the slabs, in a flat model-weight buffer and in the aux slab; each
// vector holds one entry per piece, then the total.
struct PieceLayout {
  std::vector<uint64_t> starts;  // Slab elements.
  std::vector<uint64_t> bytes;   // Bytes of the flat model-weight buffer.
  std::vector<DType> dtypes;     // One per piece only.
  std::vector<uint64_t> aux;     // Aux slab elements.
  bool mixed = false;            // Some piece's dtype is not `dtype`'s.
  size_t widest = 1;             // The widest element: the flat buffer's alignment.
};

// Back to back, each piece at a multiple of its element size (no gap at all when the
// parameters share one dtype). REQUIRES: `o` validated.
PieceLayout LayOutPieces(const StagedAdamWOptions& o, DType dtype) {
  PieceLayout l;
  uint64_t start = 0, bytes = 0;
  for (const Piece& p : o.pieces) {
    const DType d = o.params[p.param].dtype;
    const size_t psize = formats::DTypeSize(d);
    bytes = (bytes + psize - 1) / psize * psize;
    l.starts.push_back(start);
    l.bytes.push_back(bytes);
    l.dtypes.push_back(d);
    l.mixed |= d != dtype;
    l.widest = std::max(l.widest, psize);
    start += p.count;
    bytes += p.count * psize;
  }
  l.starts.push_back(start);
  l.bytes.push_back(bytes);
  uint64_t aux = 0;
  for (const Piece& p : o.pieces) {
    l.aux.push_back(aux);
    const ParamSpec& param = o.params[p.param];
    aux += internal::AuxElements(internal::RuleFor(o.groups[param.group].algorithm), param.shape);
  }
  l.aux.push_back(aux);
  return l;
}

// The engine `o` names; kUnimplemented for the CUDA engine when a group's rule has no CUDA
// kernels.
absl::StatusOr<std::unique_ptr<internal::Engine>> NewEngine(const StagedAdamWOptions& o,
                                                            const std::vector<Unit>& units,
                                                            bool has_max) {
  if (o.engine == EngineKind::kCpu) return NewCpuEngine(o.threads, o.isa);
  for (const ParamGroup& g : o.groups) {
    const internal::UpdateRule& rule = internal::RuleFor(g.algorithm);
    if (!rule.has_cuda_kernels()) {
      return absl::UnimplementedError(absl::StrCat(
          "the CUDA engine has no ", rule.name(), " kernels yet: step ", rule.name(),
          " groups on the CPU engine"));
    }
  }
  return NewCudaEngine(o, units, has_max);
}

// The first copy of the weights into the masters, on every core: (piece, block) tasks.
void SeedMasters(std::span<const std::byte> model_weights, const std::vector<uint64_t>& starts,
                 const std::vector<uint64_t>& bytes, const std::vector<DType>& dtypes,
                 std::span<float> master) {
  constexpr uint64_t kBlock = uint64_t{1} << 22;
  std::vector<std::pair<size_t, uint64_t>> tasks;
  for (size_t k = 0; k < dtypes.size(); ++k) {
    const uint64_t n = starts[k + 1] - starts[k];
    for (uint64_t b = 0; b < n; b += kBlock) tasks.emplace_back(k, b);
  }
  internal::ThreadPool pool(static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  pool.ParallelFor(tasks.size(), [&](size_t t) {
    const auto [k, b] = tasks[t];
    const uint64_t at = starts[k] + b;
    const uint64_t n = std::min(kBlock, starts[k + 1] - at);
    const size_t esize = formats::DTypeSize(dtypes[k]);
    formats::Convert(dtypes[k], model_weights.subspan(bytes[k] + b * esize, n * esize),
                     DType::kF32, std::as_writable_bytes(master.subspan(at, n)));
  });
}

}  // namespace

absl::StatusOr<std::unique_ptr<StagedAdamW::Slabs>> StagedAdamW::Slabs::Allocate(
    uint64_t elements, size_t moment_bytes, bool max, uint64_t aux_elements, bool pinned) {
  auto slabs = std::make_unique<Slabs>();
  CKPT_ASSIGN_OR_RETURN(slabs->master, internal::HostBuffer::Create(elements * 4, 0, pinned));
  CKPT_ASSIGN_OR_RETURN(
      slabs->exp_avg,
      internal::HostBuffer::Create(elements * moment_bytes, internal::kSlabStagger, pinned));
  CKPT_ASSIGN_OR_RETURN(
      slabs->exp_avg_sq,
      internal::HostBuffer::Create(elements * moment_bytes, 2 * internal::kSlabStagger, pinned));
  if (max) {
    CKPT_ASSIGN_OR_RETURN(
        slabs->max_exp_avg_sq,
        internal::HostBuffer::Create(elements * moment_bytes, 3 * internal::kSlabStagger, pinned));
  }
  if (aux_elements > 0) {
    CKPT_ASSIGN_OR_RETURN(slabs->aux, internal::HostBuffer::Create(
                                          aux_elements * 4, 4 * internal::kSlabStagger, pinned));
  }
  return slabs;
}

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
  PieceLayout layout = LayOutPieces(options, dtype);
  const uint64_t bytes = layout.bytes.back();
  const uint64_t aux = layout.aux.back();
  opt->piece_starts_ = std::move(layout.starts);
  opt->piece_bytes_ = std::move(layout.bytes);
  opt->piece_dtypes_ = std::move(layout.dtypes);
  opt->piece_aux_ = std::move(layout.aux);
  opt->mixed_dtypes_ = layout.mixed;
  opt->widest_ = layout.widest;
  if (model_weights.size() != bytes) {
    return absl::InvalidArgumentError(absl::StrCat("model weights hold ", model_weights.size(),
                                                   " bytes, this rank's pieces need ", bytes));
  }
  if (size > 0 && (model_weights.data() == nullptr ||
                   !internal::Aligned(model_weights.data(), layout.widest))) {
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
  CKPT_ASSIGN_OR_RETURN(opt->engine_, NewEngine(opt->options_, opt->units_, opt->has_max_));
  CKPT_ASSIGN_OR_RETURN(opt->slabs_,
                        Slabs::Allocate(size, MomentBytes(opt->options_.moment_dtype),
                                        opt->has_max_, aux, opt->engine_->wants_pinned_slabs()));
  SeedMasters(model_weights, opt->piece_starts_, opt->piece_bytes_, opt->piece_dtypes_,
              opt->mutable_master());
  return opt;
}

bool StagedAdamW::has_whole_params() const {
  return std::any_of(options_.groups.begin(), options_.groups.end(),
                     [](const ParamGroup& g) {
                       return internal::RuleFor(g.algorithm).keeps_params_whole();
                     });
}

}  // namespace ckpt::optimizer
