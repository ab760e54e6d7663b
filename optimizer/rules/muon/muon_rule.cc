#include "optimizer/rules/muon/muon_rule.h"

#include "absl/strings/str_cat.h"
#include "optimizer/engine.h"
#include "optimizer/rules/muon/muon.h"

namespace ckpt::optimizer::internal {
namespace {

constexpr StateDecl kStates[] = {{"momentum", Slab::kExpAvg}};

double Momentum(const ParamGroup& g) { return g.muon.momentum; }
double NsA(const ParamGroup& g) { return g.muon.ns_a; }
double NsB(const ParamGroup& g) { return g.muon.ns_b; }
double NsC(const ParamGroup& g) { return g.muon.ns_c; }
double NsSteps(const ParamGroup& g) { return g.muon.ns_steps; }
double AdjustLr(const ParamGroup& g) { return static_cast<double>(g.muon.adjust_lr); }

constexpr HyperParam kSchema[] = {
    {"lr", GroupLr, HyperParam::Range::kNonNegative},
    {"eps", GroupEps, HyperParam::Range::kNonNegative},
    {"weight_decay", GroupWeightDecay, HyperParam::Range::kNonNegative},
    {"momentum", Momentum, HyperParam::Range::kNonNegative},
    {"ns_a", NsA, HyperParam::Range::kFinite},
    {"ns_b", NsB, HyperParam::Range::kFinite},
    {"ns_c", NsC, HyperParam::Range::kFinite},
    {"ns_steps", NsSteps, HyperParam::Range::kBelow100},
    {"adjust_lr", AdjustLr, HyperParam::Range::kBool},
};

class Muon final : public UpdateRule {
 public:
  struct Scratch : CpuScratch {
    MuonScratch buffers;
  };

  Algorithm algorithm() const override { return Algorithm::kMuon; }
  absl::string_view name() const override { return "Muon"; }
  absl::string_view key() const override { return "muon"; }
  std::span<const StateDecl> states() const override { return kStates; }
  // The orthogonalisation needs the whole matrix.
  bool keeps_params_whole() const override { return true; }
  std::span<const HyperParam> schema() const override { return kSchema; }

  std::unique_ptr<CpuScratch> NewCpuScratch() const override {
    return std::make_unique<Scratch>();
  }

  // Each product of the orthogonalisation runs on OpenBLAS's threads (SetBlasThreads, set by
  // the engine), its elementwise passes on `parallel`.
  void StepWholeCpu(const WholeParamStep& w, const StepConstants& c, CpuScratch* scratch,
                    const ParallelFor& parallel) const override {
    const MuonMatrixArgs m{w.master,       w.master,       w.exp_avg, w.exp_avg,
                           w.moment_dtype, w.grads,        w.grad_dtype, w.grad_scale,
                           w.params,       w.param_dtype,  w.rows,    w.count / w.rows};
    MuonStepMatrix(m, c.muon, static_cast<Scratch*>(scratch)->buffers, parallel);
  }

  absl::Status CheckParam(const ParamSpec& p) const override {
    if (p.shape.size() == 2) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat("param \"", p.name, "\" is in Muon group ", p.group, " but has ",
                     p.shape.size(),
                     " dimensions: Muon steps 2-D matrices only (step the others with AdamW)"));
  }

  void SetConstants(const ParamGroup& g, uint64_t t, StepConstants& c) const override {
    (void)t;  // Muon has no bias correction.
    c.rule = this;
    c.is_muon = true;
    c.muon = ComputeMuonConstants(g);
  }

 protected:
  absl::Status CheckGroup(const ParamGroup& g, size_t index) const override {
    if (!g.amsgrad) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat("param group ", index, ": amsgrad is AdamW's; a Muon group has none"));
  }
};

}  // namespace

const UpdateRule& MuonRule() {
  static const Muon rule;
  return rule;
}

}  // namespace ckpt::optimizer::internal
