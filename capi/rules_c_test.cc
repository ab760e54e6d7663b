// ABI 16 through the C header alone: an Adafactor group created with its rule's defaults, its
// own hyper-parameters set, read, unset and refused by name, kept by ckpt_optimizer_set_group;
// its aux state (the factors) located, read and replaced with the rest of the state.
#include <cmath>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "ckpt/ckpt.h"

namespace {

ckpt_group Adafactor(double lr) {
  ckpt_group g{};
  g.lr = lr;
  g.algorithm = CKPT_ADAFACTOR;
  return g;
}

class RulesCTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // A 3 x 4 matrix (row_var 3, col_var 4) and a vector of 5 (variance 5).
    ckpt_group group = Adafactor(0.01);
    ASSERT_EQ(ckpt_optimizer_create(params_, 2, &group, 1, pieces_, 2, nullptr, w_.data(),
                                    w_.size() * 4, &opt_),
              CKPT_OK)
        << ckpt_last_error();
  }
  void TearDown() override { ckpt_optimizer_destroy(opt_); }

  const uint64_t matrix_[2] = {3, 4}, vector_[1] = {5};
  ckpt_param params_[2] = {{"w", matrix_, 2, CKPT_F32, 0}, {"b", vector_, 1, CKPT_F32, 0}};
  ckpt_piece pieces_[2] = {{0, 0, 12}, {1, 0, 5}};
  std::vector<float> w_ = std::vector<float>(17, 0.5f);
  ckpt_optimizer* opt_ = nullptr;
};

TEST_F(RulesCTest, HyperParametersAreSetReadAndUnsetByName) {
  double value = 0;
  int present = -1;
  ASSERT_EQ(ckpt_optimizer_get_hyper(opt_, 0, "beta2_decay", &value, &present), CKPT_OK);
  EXPECT_EQ(value, -0.8);  // torch's default.
  EXPECT_EQ(present, 1);
  ASSERT_EQ(ckpt_optimizer_get_hyper(opt_, 0, "eps1", &value, &present), CKPT_OK);
  EXPECT_EQ(present, 0);  // None.
  const double eps1 = 1e-30, decay = -0.5, bad_d = 0.5;
  ASSERT_EQ(ckpt_optimizer_set_hyper(opt_, 0, "eps1", &eps1), CKPT_OK) << ckpt_last_error();
  ASSERT_EQ(ckpt_optimizer_set_hyper(opt_, 0, "beta2_decay", &decay), CKPT_OK);
  ASSERT_EQ(ckpt_optimizer_get_hyper(opt_, 0, "eps1", &value, &present), CKPT_OK);
  EXPECT_EQ(value, 1e-30);
  EXPECT_EQ(present, 1);
  // set_group takes ckpt_group's fields and keeps the rule's own.
  ckpt_group lr = Adafactor(0.5);
  ASSERT_EQ(ckpt_optimizer_set_group(opt_, 0, &lr), CKPT_OK) << ckpt_last_error();
  ASSERT_EQ(ckpt_optimizer_get_hyper(opt_, 0, "beta2_decay", &value, &present), CKPT_OK);
  EXPECT_EQ(value, -0.5);
  ASSERT_EQ(ckpt_optimizer_get_hyper(opt_, 0, "lr", &value, &present), CKPT_OK);
  EXPECT_EQ(value, 0.5);
  ASSERT_EQ(ckpt_optimizer_set_hyper(opt_, 0, "eps1", nullptr), CKPT_OK);
  ASSERT_EQ(ckpt_optimizer_get_hyper(opt_, 0, "eps1", &value, &present), CKPT_OK);
  EXPECT_EQ(present, 0);
  // Refused, with the group unchanged: out of range, unknown, a field, a required one unset.
  EXPECT_EQ(ckpt_optimizer_set_hyper(opt_, 0, "d", &bad_d), CKPT_INVALID_ARGUMENT);
  EXPECT_NE(std::string(ckpt_last_error()).find("d = 0.5"), std::string::npos);
  EXPECT_EQ(ckpt_optimizer_set_hyper(opt_, 0, "beta3", &decay), CKPT_INVALID_ARGUMENT);
  EXPECT_NE(std::string(ckpt_last_error()).find("\"beta3\""), std::string::npos);
  EXPECT_EQ(ckpt_optimizer_set_hyper(opt_, 0, "lr", &decay), CKPT_INVALID_ARGUMENT);
  EXPECT_EQ(ckpt_optimizer_set_hyper(opt_, 0, "d", nullptr), CKPT_INVALID_ARGUMENT);
  EXPECT_EQ(ckpt_optimizer_set_hyper(opt_, 1, "d", &decay), CKPT_INVALID_ARGUMENT);
  ASSERT_EQ(ckpt_optimizer_get_hyper(opt_, 0, "d", &value, &present), CKPT_OK);
  EXPECT_EQ(value, 1.0);
}

TEST_F(RulesCTest, TheFactorsAreLocatedReadAndReplacedWithTheState) {
  uint64_t offsets[3] = {};
  ASSERT_EQ(ckpt_optimizer_aux_offsets(opt_, offsets, 3), CKPT_OK);
  EXPECT_EQ(offsets[0], 0u);
  EXPECT_EQ(offsets[1], 7u);   // w: row_var 3, col_var 4.
  EXPECT_EQ(offsets[2], 12u);  // b: variance 5.
  EXPECT_EQ(ckpt_optimizer_aux_offsets(opt_, offsets, 2), CKPT_INVALID_ARGUMENT);
  std::vector<float> g(17);
  for (size_t i = 0; i < g.size(); ++i) g[i] = 0.1f * static_cast<float>(i + 1);
  ASSERT_EQ(ckpt_optimizer_step(opt_, g.data(), CKPT_F32, 1.0f, w_.data(), 0, nullptr, nullptr),
            CKPT_OK)
      << ckpt_last_error();
  std::vector<float> aux(12);
  ASSERT_EQ(ckpt_optimizer_read_state(opt_, CKPT_AUX, aux.data(), 12), CKPT_OK);
  // At step 1 the weight is 1^-0.8 = 1: each factor is the mean of its squared gradients, rows
  // (3) then columns (4) of w, then b's variance (5): every one tells where it lies.
  for (int r = 0; r < 3; ++r) {
    double sum = 0;
    for (int c = 0; c < 4; ++c) sum += double(g[r * 4 + c]) * g[r * 4 + c];
    EXPECT_NEAR(aux[r], sum / 4, 1e-5) << "row_var " << r;
  }
  for (int c = 0; c < 4; ++c) {
    double sum = 0;
    for (int r = 0; r < 3; ++r) sum += double(g[r * 4 + c]) * g[r * 4 + c];
    EXPECT_NEAR(aux[3 + c], sum / 3, 1e-5) << "col_var " << c;
  }
  for (int i = 0; i < 5; ++i) EXPECT_NEAR(aux[7 + i], g[12 + i] * g[12 + i], 1e-5) << i;
  float one = 0;
  EXPECT_EQ(ckpt_optimizer_read_state_range(opt_, CKPT_AUX, 11, &one, 1), CKPT_OK);
  EXPECT_EQ(ckpt_optimizer_read_state_range(opt_, CKPT_AUX, 12, &one, 1), CKPT_OUT_OF_RANGE);

  std::vector<float> master(17, 0.25f), zero(17, 0.0f), factors(12);
  for (size_t i = 0; i < factors.size(); ++i) factors[i] = 0.01f * static_cast<float>(i);
  const uint64_t steps[2] = {4, 4};
  ckpt_state state{};
  state.struct_size = sizeof(ckpt_state);
  state.master = master.data();
  state.exp_avg = zero.data();
  state.exp_avg_sq = zero.data();
  state.count = 17;
  state.param_steps = steps;
  state.nparams = 2;
  state.aux = factors.data();
  state.aux_count = 12;
  ckpt_state short_state = state;
  short_state.struct_size = 8;
  EXPECT_EQ(ckpt_optimizer_set_state_with(opt_, &short_state), CKPT_INVALID_ARGUMENT);
  ckpt_state wrong = state;
  wrong.aux_count = 11;
  EXPECT_EQ(ckpt_optimizer_set_state_with(opt_, &wrong), CKPT_INVALID_ARGUMENT);
  factors[3] = std::nanf("");
  EXPECT_EQ(ckpt_optimizer_set_state_with(opt_, &state), CKPT_INVALID_ARGUMENT);
  ASSERT_EQ(ckpt_optimizer_read_state(opt_, CKPT_AUX, aux.data(), 12), CKPT_OK);
  EXPECT_NEAR(aux[3], (0.01 + 0.25 + 0.81) / 3, 1e-5);  // Nothing changed.
  factors[3] = 0.03f;
  // A caller built against a later header passes a larger struct: what ABI 16 knows is read.
  struct {
    ckpt_state state;
    uint64_t appended_by_a_later_version;
  } later{state, 7};
  later.state.struct_size = sizeof(later);
  ASSERT_EQ(ckpt_optimizer_set_state_with(opt_, &later.state), CKPT_OK) << ckpt_last_error();
  ASSERT_EQ(ckpt_optimizer_read_state(opt_, CKPT_AUX, aux.data(), 12), CKPT_OK);
  EXPECT_EQ(aux, factors);
  uint64_t got_steps[2] = {};
  ASSERT_EQ(ckpt_optimizer_param_steps(opt_, got_steps, 2), CKPT_OK);
  EXPECT_EQ(got_steps[0], 4u);
}

}  // namespace
