// AdamW's rule (torch.optim.AdamW, with AMSGrad): the moments exp_avg and exp_avg_sq per
// parameter, and max_exp_avg_sq while the optimizer keeps AMSGrad's slab; any parameter, cut
// anywhere; its kernels are the CPU engine's fused pass (optimizer/cpu_kernels.h) and the CUDA
// engine's (optimizer/cuda/adamw_kernel.h).
#ifndef CKPT_OPTIMIZER_RULES_ADAMW_ADAMW_RULE_H_
#define CKPT_OPTIMIZER_RULES_ADAMW_ADAMW_RULE_H_

#include "optimizer/rules/update_rule.h"

namespace ckpt::optimizer::internal {

const UpdateRule& AdamWRule();

}  // namespace ckpt::optimizer::internal

#endif  // CKPT_OPTIMIZER_RULES_ADAMW_ADAMW_RULE_H_
