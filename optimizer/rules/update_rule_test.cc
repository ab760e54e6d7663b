// The list of rules: every Algorithm from 0 to kLastAlgorithm has a rule, whose key() finds it
// again (the optimizer record names groups by key) and whose states are declared consistently.
#include "optimizer/rules/update_rule.h"

#include <set>
#include <string>

#include <gtest/gtest.h>

namespace ckpt::optimizer::internal {
namespace {

TEST(UpdateRuleTest, EveryAlgorithmHasARuleWhoseKeyFindsIt) {
  std::set<std::string> keys;
  for (int a = 0; a <= static_cast<int>(kLastAlgorithm); ++a) {
    const auto algorithm = static_cast<Algorithm>(a);
    auto rule = FindRule(algorithm);
    ASSERT_TRUE(rule.ok()) << a;
    EXPECT_EQ((*rule)->algorithm(), algorithm);
    auto by_key = FindRuleByKey((*rule)->key());
    ASSERT_TRUE(by_key.ok()) << (*rule)->key();
    EXPECT_EQ(*by_key, *rule);
    EXPECT_TRUE(keys.insert(std::string((*rule)->key())).second) << "two rules keyed " << a;
    for (const StateDecl& d : (*rule)->states()) {
      EXPECT_FALSE(d.slab == Slab::kAux && d.only_with_max_slab) << d.key;
      // State shaped unlike its parameter lives in the aux slab, of parameters kept whole.
      if (d.shape != nullptr) {
        EXPECT_EQ(d.slab, Slab::kAux) << d.key;
      }
      if (d.slab == Slab::kAux) {
        EXPECT_TRUE((*rule)->keeps_params_whole()) << d.key;
      }
    }
  }
  EXPECT_FALSE(FindRule(static_cast<Algorithm>(static_cast<int>(kLastAlgorithm) + 1)).ok());
  EXPECT_FALSE(FindRuleByKey("sgd").ok());
}

}  // namespace
}  // namespace ckpt::optimizer::internal
