// Muon's rule (torch.optim.Muon, docs/design/muon.md): one momentum buffer per parameter, kept
// where AdamW keeps exp_avg (the same EMA); 2-D parameters only, each whole on one rank, one
// unit each; its kernels are rules/muon/muon.h (CPU) and optimizer/cuda/muon_kernel.h (CUDA).
#ifndef CKPT_OPTIMIZER_RULES_MUON_MUON_RULE_H_
#define CKPT_OPTIMIZER_RULES_MUON_MUON_RULE_H_

#include "optimizer/rules/update_rule.h"

namespace ckpt::optimizer::internal {

const UpdateRule& MuonRule();

}  // namespace ckpt::optimizer::internal

#endif  // CKPT_OPTIMIZER_RULES_MUON_MUON_RULE_H_
