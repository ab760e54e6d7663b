// Adafactor's rule (torch.optim.Adafactor, docs/design/adafactor.md): a parameter of two or
// more dimensions keeps its second moment factored along its last two, as a row factor
// (row_var, its shape with the last dimension 1) and a column factor (col_var, the second last
// 1); a vector or scalar keeps it whole (variance). All three are FP32 in the aux slab. Each
// parameter is stepped whole on one rank (its norm and its update's norm scale the step).
#ifndef CKPT_OPTIMIZER_RULES_ADAFACTOR_ADAFACTOR_RULE_H_
#define CKPT_OPTIMIZER_RULES_ADAFACTOR_ADAFACTOR_RULE_H_

#include "optimizer/rules/update_rule.h"

namespace ckpt::optimizer::internal {

const UpdateRule& AdafactorRule();

}  // namespace ckpt::optimizer::internal

#endif  // CKPT_OPTIMIZER_RULES_ADAFACTOR_ADAFACTOR_RULE_H_
