// The C ABI: bad handles and arguments come back as codes with a message (never a crash); a
// single-process cycle through it (create, step, save, load, model-only load, blobs) works.
#include "ckpt/ckpt.h"

#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/support/temp_dir.h"

namespace {

// An AdamW group (betas 0.9, 0.999, eps 1e-8).
ckpt_group AdamW(double lr, double weight_decay) {
  ckpt_group g{};
  g.lr = lr;
  g.beta1 = 0.9;
  g.beta2 = 0.999;
  g.eps = 1e-8;
  g.weight_decay = weight_decay;
  g.algorithm = CKPT_ADAMW;
  return g;
}

// ckpt_abi_layout() lists every function, constant and struct that ckpt.h declares, so that a
// binding comparing itself with the layout (python/ckpt/_lib.py) covers the whole header.
TEST(CkptCTest, TheAbiLayoutListsEveryFunctionConstantAndStructOfTheHeader) {
  std::ifstream in(CKPT_C_HEADER);
  ASSERT_TRUE(in.good()) << CKPT_C_HEADER;
  std::stringstream text;
  text << in.rdbuf();
  const std::string header = text.str();
  const std::string layout = ckpt_abi_layout();
  std::set<std::string> lines;
  std::istringstream layout_lines(layout);
  for (std::string line; std::getline(layout_lines, line);) lines.insert(line);
  auto listed = [&](const std::string& prefix) {
    for (const std::string& l : lines) {
      if (l.rfind(prefix, 0) == 0) return true;
    }
    return false;
  };
  int functions = 0, constants = 0, structs = 0;
  const std::regex function(R"(CKPT_C_EXPORT[^(;]*?\b(ckpt_[a-z_]+)\s*\()");
  for (std::sregex_iterator it(header.begin(), header.end(), function), end; it != end; ++it) {
    EXPECT_TRUE(listed("func " + (*it)[1].str() + " ")) << (*it)[1];
    ++functions;
  }
  const std::regex constant(R"(\b(CKPT_[A-Z0-9_]+) = (-?[0-9]+))");
  for (std::sregex_iterator it(header.begin(), header.end(), constant), end; it != end; ++it) {
    EXPECT_TRUE(lines.count("const " + (*it)[1].str() + " " + (*it)[2].str())) << (*it)[1];
    ++constants;
  }
  const std::regex record(R"(\}\s*(ckpt_[a-z_]+);)");
  for (std::sregex_iterator it(header.begin(), header.end(), record), end; it != end; ++it) {
    EXPECT_TRUE(listed("struct " + (*it)[1].str() + " ")) << (*it)[1];
    ++structs;
  }
  EXPECT_TRUE(lines.count("const CKPT_ABI_VERSION " + std::to_string(CKPT_ABI_VERSION)));
  EXPECT_TRUE(lines.count("field ckpt_coordinator.all_gather " +
                          std::to_string(offsetof(ckpt_coordinator, all_gather)) + " p"));
  EXPECT_TRUE(lines.count("func ckpt_optimizer_step i32 p p i32 f32 p i32 p p")) << layout;
  // The header as written today: a regex that matched nothing would pass everything above.
  EXPECT_EQ(functions, 75);
  EXPECT_EQ(constants, 45);
  EXPECT_EQ(structs, 7);
}

TEST(CkptCTest, NullAndBadArgumentsAreCodesWithMessages) {
  EXPECT_EQ(ckpt_abi_version(), CKPT_ABI_VERSION);
  uint64_t n = 0;
  EXPECT_EQ(ckpt_optimizer_size(nullptr, &n), CKPT_INVALID_ARGUMENT);
  EXPECT_NE(std::string(ckpt_last_error()), "");
  EXPECT_EQ(ckpt_optimizer_step(nullptr, nullptr, CKPT_F32, 1, nullptr, 0, nullptr, nullptr),
            CKPT_INVALID_ARGUMENT);
  EXPECT_EQ(ckpt_checkpointer_save(nullptr, 1, nullptr, nullptr, nullptr, 0),
            CKPT_INVALID_ARGUMENT);
  EXPECT_EQ(ckpt_pending_save_finalize(nullptr), CKPT_INVALID_ARGUMENT);
  EXPECT_EQ(ckpt_store_open(nullptr, 1, 0, nullptr), CKPT_INVALID_ARGUMENT);
  ckpt_store* store = nullptr;
  EXPECT_EQ(ckpt_store_open("/nonexistent/ckpt-root", 0, 1, &store), CKPT_NOT_FOUND);
  EXPECT_EQ(store, nullptr);
  ckpt_store_options so{};
  EXPECT_EQ(ckpt_store_open_with("/nonexistent/ckpt-root", &so, &store), CKPT_INVALID_ARGUMENT);
  EXPECT_NE(std::string(ckpt_last_error()).find("struct_size"), std::string::npos);
  so.struct_size = sizeof(so);
  so.write_threads = 65;
  EXPECT_EQ(ckpt_store_open_with("/nonexistent/ckpt-root", &so, &store), CKPT_INVALID_ARGUMENT);
  EXPECT_NE(std::string(ckpt_last_error()).find("write_threads 65"), std::string::npos);
  so.write_threads = 0;
  so.read_only = 1;
  EXPECT_EQ(ckpt_store_open_with("/nonexistent/ckpt-root", &so, &store), CKPT_NOT_FOUND);
  EXPECT_EQ(store, nullptr);
  // Opening on the ranks of a job needs a coordinator that can run.
  EXPECT_EQ(ckpt_store_open_on_ranks("/nonexistent/ckpt-root", &so, nullptr, &store),
            CKPT_INVALID_ARGUMENT);
  ckpt_coordinator no_gather = {nullptr, 0, 2, nullptr, nullptr};
  EXPECT_EQ(ckpt_store_open_on_ranks("/nonexistent/ckpt-root", &so, &no_gather, &store),
            CKPT_INVALID_ARGUMENT);
  EXPECT_NE(std::string(ckpt_last_error()).find("no all_gather"), std::string::npos);
  EXPECT_EQ(store, nullptr);
  // A parameter with a dtype that does not exist, and one without a name.
  const uint64_t shape[1] = {4};
  ckpt_param bad = {"w", shape, 1, 7, 0};
  ckpt_group group = AdamW(1e-3, 0.01);
  ckpt_piece piece = {0, 0, 4};
  float weights[4] = {1, 2, 3, 4};
  ckpt_optimizer* opt = nullptr;
  EXPECT_EQ(ckpt_optimizer_create(&bad, 1, &group, 1, &piece, 1, nullptr, weights, 16, &opt),
            CKPT_INVALID_ARGUMENT);
  EXPECT_NE(std::string(ckpt_last_error()).find("dtype 7"), std::string::npos);
  bad = {nullptr, shape, 1, CKPT_F32, 0};
  EXPECT_EQ(ckpt_optimizer_create(&bad, 1, &group, 1, &piece, 1, nullptr, weights, 16, &opt),
            CKPT_INVALID_ARGUMENT);
  // Weights of the wrong size: the C++ API's own refusal, as a code.
  ckpt_param good = {"w", shape, 1, CKPT_F32, 0};
  EXPECT_EQ(ckpt_optimizer_create(&good, 1, &group, 1, &piece, 1, nullptr, weights, 12, &opt),
            CKPT_INVALID_ARGUMENT);
  EXPECT_EQ(opt, nullptr);
  ckpt_optimizer_destroy(nullptr);
  ckpt_store_close(nullptr);
  ckpt_checkpointer_destroy(nullptr);
}

TEST(CkptCTest, CreateStepSaveLoadThroughTheAbi) {
  ckpt::testing::ScopedTempDir tmp;
  const uint64_t shape[2] = {2, 3};
  ckpt_param param = {"w", shape, 2, CKPT_F32, 0};
  ckpt_group group = AdamW(0.1, 0.0);
  size_t count = 0;
  ckpt_piece pieces[4];
  ASSERT_EQ(ckpt_rank_pieces(&param, 1, 0, 1, 0, pieces, 4, &count), CKPT_OK);
  ASSERT_EQ(count, 1u);
  std::vector<float> w = {1, 2, 3, 4, 5, 6}, g(6, 0.5f);
  ckpt_optimizer* opt = nullptr;
  ASSERT_EQ(ckpt_optimizer_create(&param, 1, &group, 1, pieces, count, nullptr, w.data(),
                                  w.size() * 4, &opt),
            CKPT_OK)
      << ckpt_last_error();
  ASSERT_EQ(ckpt_optimizer_step(opt, g.data(), CKPT_F32, 1.0f, w.data(), 0, nullptr, nullptr),
            CKPT_OK);
  EXPECT_NEAR(w[0], 1 - 0.1f, 1e-6);  // The first Adam step moves by lr against the gradient.
  ckpt_store* store = nullptr;
  ASSERT_EQ(ckpt_store_open((tmp.path() + "/root").c_str(), 1, 0, &store), CKPT_OK);
  ckpt_checkpointer* ck = nullptr;
  ASSERT_EQ(ckpt_checkpointer_create(opt, w.data(), w.size() * 4, store, nullptr, 0, &ck), CKPT_OK);
  const char* keys[1] = {"note"};
  const void* values[1] = {"hi"};
  const size_t lens[1] = {2};
  ASSERT_EQ(ckpt_checkpointer_save(ck, 1, keys, values, lens, 1), CKPT_OK) << ckpt_last_error();
  const std::vector<float> saved = w;
  ASSERT_EQ(ckpt_optimizer_step(opt, g.data(), CKPT_F32, 1.0f, w.data(), 0, nullptr, nullptr),
            CKPT_OK);
  ckpt_pending_save* pending = nullptr;
  ASSERT_EQ(ckpt_checkpointer_save_async(ck, 2, nullptr, nullptr, nullptr, 0, &pending), CKPT_OK);
  ASSERT_EQ(ckpt_pending_save_finalize(pending), CKPT_OK);
  ckpt_pending_save_destroy(pending);
  ckpt_blobs* blobs = nullptr;
  uint64_t loaded = 0;
  ASSERT_EQ(ckpt_checkpointer_load(ck, 1, 1, &blobs, &loaded), CKPT_OK) << ckpt_last_error();
  EXPECT_EQ(loaded, 1u);
  EXPECT_EQ(w, saved);
  size_t n = 0;
  ASSERT_EQ(ckpt_blobs_count(blobs, &n), CKPT_OK);
  ASSERT_EQ(n, 1u);
  const char* key = nullptr;
  const void* value = nullptr;
  size_t len = 0;
  ASSERT_EQ(ckpt_blobs_get(blobs, 0, &key, &value, &len), CKPT_OK);
  EXPECT_STREQ(key, "note");
  EXPECT_EQ(std::string(static_cast<const char*>(value), len), "hi");
  EXPECT_EQ(ckpt_blobs_get(blobs, 1, &key, &value, &len), CKPT_INVALID_ARGUMENT);
  ckpt_blobs_free(blobs);
  EXPECT_EQ(ckpt_checkpointer_load(ck, 1, 9, nullptr, nullptr), CKPT_NOT_FOUND);
  ckpt_group got;
  ASSERT_EQ(ckpt_optimizer_get_group(opt, 0, &got), CKPT_OK);
  EXPECT_EQ(got.step, 1u);
  EXPECT_EQ(ckpt_optimizer_get_group(opt, 1, &got), CKPT_INVALID_ARGUMENT);
  std::vector<float> master(6);
  ASSERT_EQ(ckpt_optimizer_read_state(opt, CKPT_MASTER, master.data(), 6), CKPT_OK);
  EXPECT_EQ(master, saved);
  EXPECT_EQ(ckpt_optimizer_read_state(opt, CKPT_MASTER, master.data(), 5), CKPT_INVALID_ARGUMENT);
  ckpt_checkpointer_destroy(ck);
  ckpt_store_close(store);
  ckpt_optimizer_destroy(opt);
}

// ABI 14: a range of a state tensor is the whole tensor's slice (FP32 and BF16 moments, widened
// exactly), a range past the end is refused, and an empty range at the end reads nothing.
TEST(CkptCTest, ReadStateRangeIsTheSliceOfTheWholeState) {
  const uint64_t shape[1] = {10};
  ckpt_param param = {"w", shape, 1, CKPT_F32, 0};
  ckpt_group group = AdamW(0.1, 0.0);
  ckpt_piece piece = {0, 0, 10};
  for (int moments : {CKPT_MOMENTS_F32, CKPT_MOMENTS_BF16}) {
    ckpt_optimizer_options options = {CKPT_ENGINE_CPU, 0, 1, 0, moments};
    std::vector<float> w(10), g(10);
    for (int i = 0; i < 10; ++i) {
      w[i] = 1.0f + 0.37f * i;
      g[i] = 0.1f * (i - 4.5f);
    }
    ckpt_optimizer* opt = nullptr;
    ASSERT_EQ(ckpt_optimizer_create(&param, 1, &group, 1, &piece, 1, &options, w.data(), 40, &opt),
              CKPT_OK)
        << ckpt_last_error();
    ASSERT_EQ(ckpt_optimizer_step(opt, g.data(), CKPT_F32, 1.0f, w.data(), 0, nullptr, nullptr),
              CKPT_OK);
    for (int which : {CKPT_MASTER, CKPT_EXP_AVG, CKPT_EXP_AVG_SQ}) {
      std::vector<float> whole(10), range(4, -1.0f);
      ASSERT_EQ(ckpt_optimizer_read_state(opt, which, whole.data(), 10), CKPT_OK);
      ASSERT_EQ(ckpt_optimizer_read_state_range(opt, which, 3, range.data(), 4), CKPT_OK);
      EXPECT_EQ(range, std::vector<float>(whole.begin() + 3, whole.begin() + 7)) << which;
      EXPECT_EQ(ckpt_optimizer_read_state_range(opt, which, 7, range.data(), 4),
                CKPT_OUT_OF_RANGE);
      EXPECT_EQ(ckpt_optimizer_read_state_range(opt, which, 10, nullptr, 0), CKPT_OK);
    }
    float one = 0;
    EXPECT_EQ(ckpt_optimizer_read_state_range(opt, CKPT_MAX_EXP_AVG_SQ, 0, &one, 1),
              CKPT_INVALID_ARGUMENT);
    EXPECT_EQ(ckpt_optimizer_read_state_range(opt, 99, 0, &one, 1), CKPT_INVALID_ARGUMENT);
    ckpt_optimizer_destroy(opt);
  }
}

// ABI 11: a Muon group beside an AdamW one, its hyper-parameters kept and read back, the Muon
// matrix stepped (its weights change, its momentum is the gradient's share), a bad rule named,
// the algorithm fixed, and a checkpointer refusing what it cannot save yet.
TEST(CkptCTest, AMuonGroupThroughTheAbi) {
  const uint64_t matrix[2] = {4, 3}, vector[1] = {5};
  ckpt_param params[2] = {{"w", matrix, 2, CKPT_F32, 0}, {"b", vector, 1, CKPT_F32, 1}};
  ckpt_group groups[2] = {AdamW(0.02, 0.1), AdamW(1e-3, 0.0)};
  groups[0].algorithm = CKPT_MUON;
  groups[0].eps = 1e-7;
  groups[0].momentum = 0.9;
  groups[0].nesterov = 0;
  groups[0].ns_a = 3.4445;
  groups[0].ns_b = -4.775;
  groups[0].ns_c = 2.0315;
  groups[0].ns_steps = 5;
  groups[0].adjust_lr = CKPT_MUON_LR_MATCH_RMS_ADAMW;
  ckpt_piece pieces[2] = {{0, 0, 12}, {1, 0, 5}};
  std::vector<float> w(17, 0.5f), g(17, 0.25f), before = w;
  ckpt_optimizer* opt = nullptr;
  ckpt_group bad[2] = {groups[0], groups[1]};
  bad[0].adjust_lr = 7;
  EXPECT_EQ(ckpt_optimizer_create(params, 2, bad, 2, pieces, 2, nullptr, w.data(), 68, &opt),
            CKPT_INVALID_ARGUMENT);
  EXPECT_NE(std::string(ckpt_last_error()).find("adjust_lr"), std::string::npos);
  ASSERT_EQ(ckpt_optimizer_create(params, 2, groups, 2, pieces, 2, nullptr, w.data(), 68, &opt),
            CKPT_OK)
      << ckpt_last_error();
  ckpt_group got;
  ASSERT_EQ(ckpt_optimizer_get_group(opt, 0, &got), CKPT_OK);
  EXPECT_EQ(got.algorithm, CKPT_MUON);
  EXPECT_EQ(got.momentum, 0.9);
  EXPECT_EQ(got.nesterov, 0);
  EXPECT_EQ(got.ns_steps, 5u);
  EXPECT_EQ(got.adjust_lr, CKPT_MUON_LR_MATCH_RMS_ADAMW);
  ASSERT_EQ(ckpt_optimizer_step(opt, g.data(), CKPT_F32, 1.0f, w.data(), 0, nullptr, nullptr),
            CKPT_OK)
      << ckpt_last_error();
  for (int i = 0; i < 12; ++i) EXPECT_NE(w[i], before[i]) << i;
  std::vector<float> momentum(17);
  ASSERT_EQ(ckpt_optimizer_read_state(opt, CKPT_EXP_AVG, momentum.data(), 17), CKPT_OK);
  EXPECT_FLOAT_EQ(momentum[0], 0.25f * (1 - 0.9f));  // buf.lerp_(g, 1 - momentum) from zero.
  ckpt_group adamw = AdamW(0.02, 0.1);
  EXPECT_EQ(ckpt_optimizer_set_group(opt, 0, &adamw), CKPT_INVALID_ARGUMENT);
  ckpt_optimizer_destroy(opt);
}

// ABI 10: an overlapped step through the ABI gives the bits of ckpt_optimizer_step_masked, held
// or redone; a piece released twice is refused and the step abandoned. ABI 12: the gated
// entry point on the CPU engine opens no gate; ABI 13's gated plain step neither.
TEST(CkptCTest, AnOverlappedStepThroughTheAbiEqualsTheMaskedStep) {
  const uint64_t shape_a[1] = {300}, shape_b[1] = {70};
  ckpt_param params[2] = {{"a", shape_a, 1, CKPT_F32, 0}, {"b", shape_b, 1, CKPT_F32, 0}};
  ckpt_group group = AdamW(0.01, 0.1);
  ckpt_piece pieces[2] = {{0, 0, 300}, {1, 0, 70}};
  std::vector<float> init(370);
  for (size_t i = 0; i < init.size(); ++i) init[i] = 0.01f * static_cast<float>(i % 17) - 0.05f;
  ckpt_optimizer* plain = nullptr;
  ckpt_optimizer* overlapped = nullptr;
  for (ckpt_optimizer** o : {&plain, &overlapped}) {
    ASSERT_EQ(ckpt_optimizer_create(params, 2, &group, 1, pieces, 2, nullptr, init.data(),
                                    init.size() * 4, o),
              CKPT_OK)
        << ckpt_last_error();
  }
  std::vector<float> wp = init, wo = init, g(370);
  const uint8_t stepped[2] = {1, 1};
  for (int s = 0; s < 3; ++s) {
    for (size_t i = 0; i < g.size(); ++i) g[i] = 0.003f * static_cast<float>((i * (s + 3)) % 29) - 0.04f;
    const float scale = s == 1 ? 0.5f : 1.0f;  // Clipping fires at step 1.
    const void* pg[2] = {g.data(), g.data() + 300};
    void* pp[2] = {wp.data(), wp.data() + 300};
    void* po[2] = {wo.data(), wo.data() + 300};
    ASSERT_EQ(ckpt_optimizer_step_masked(plain, pg, pp, 2, stepped, 2, CKPT_F32, scale, 0,
                                         nullptr, nullptr),
              CKPT_OK);
    ckpt_overlap* ov = nullptr;
    // ABI 12's gated step at step 2: on the CPU engine it is the ungated one.
    ASSERT_EQ(s == 2 ? ckpt_overlap_begin_gated(overlapped, CKPT_F32, 1.0f, nullptr, 1, &ov)
                     : ckpt_overlap_begin(overlapped, CKPT_F32, 1.0f, nullptr, 1, &ov),
              CKPT_OK)
        << ckpt_last_error();
    const uint32_t order[2] = {1, 0};
    const void* rg[2] = {pg[1], pg[0]};
    void* rp[2] = {po[1], po[0]};
    ASSERT_EQ(ckpt_overlap_release(ov, order, rg, rp, 2), CKPT_OK) << ckpt_last_error();
    ASSERT_EQ(ckpt_overlap_drain(ov), CKPT_OK);
    int skipped = -1, held = -1;
    uint64_t speculated = 0;
    ASSERT_EQ(ckpt_overlap_finish(ov, pg, po, 2, stepped, 2, CKPT_F32, scale, 0, nullptr,
                                  &skipped, &speculated, &held),
              CKPT_OK)
        << ckpt_last_error();
    ckpt_overlap_destroy(ov);
    EXPECT_EQ(skipped, 0);
    EXPECT_GT(speculated, 0u);
    EXPECT_EQ(held, s == 1 ? 0 : 1);
    int open = -1;
    ASSERT_EQ(ckpt_optimizer_gate_open(overlapped, &open), CKPT_OK);
    EXPECT_EQ(open, 0);  // The CPU engine wrote every weight before finish returned.
    EXPECT_EQ(ckpt_optimizer_await_pieces(overlapped, order, 2, nullptr), CKPT_OK);
    const uint32_t missing = 2;
    EXPECT_EQ(ckpt_optimizer_await_pieces(overlapped, &missing, 1, nullptr),
              CKPT_INVALID_ARGUMENT);
    EXPECT_EQ(ckpt_optimizer_await_step(overlapped, nullptr), CKPT_OK);
    EXPECT_EQ(0, std::memcmp(wp.data(), wo.data(), wp.size() * 4)) << "step " << s;
  }
  // ABI 13: a gated plain step on the CPU engine opens no gate and is the masked step.
  {
    const void* pg[2] = {g.data(), g.data() + 300};
    void* pp[2] = {wp.data(), wp.data() + 300};
    void* po[2] = {wo.data(), wo.data() + 300};
    ASSERT_EQ(ckpt_optimizer_step_masked(plain, pg, pp, 2, stepped, 2, CKPT_F32, 0.5f, 0,
                                         nullptr, nullptr),
              CKPT_OK);
    int skipped = -1, gated = -1;
    ASSERT_EQ(ckpt_optimizer_step_gated(overlapped, pg, po, 2, stepped, 2, CKPT_F32, 0.5f, 0,
                                        nullptr, &skipped, &gated),
              CKPT_OK)
        << ckpt_last_error();
    EXPECT_EQ(skipped, 0);
    EXPECT_EQ(gated, 0);
    EXPECT_EQ(0, std::memcmp(wp.data(), wo.data(), wp.size() * 4));
    EXPECT_EQ(ckpt_optimizer_step_gated(overlapped, pg, po, 2, stepped, 1, CKPT_F32, 0.5f, 0,
                                        nullptr, nullptr, nullptr),
              CKPT_INVALID_ARGUMENT);
    EXPECT_NE(std::string(ckpt_last_error()).find("1 stepped flags for 2"), std::string::npos);
  }
  ckpt_overlap* ov = nullptr;
  ASSERT_EQ(ckpt_overlap_begin(overlapped, CKPT_F32, 1.0f, nullptr, 1, &ov), CKPT_OK);
  const uint32_t piece = 1;
  const void* rg[1] = {g.data() + 300};
  void* rp[1] = {wo.data() + 300};
  ASSERT_EQ(ckpt_overlap_release(ov, &piece, rg, rp, 1), CKPT_OK);
  EXPECT_EQ(ckpt_overlap_release(ov, &piece, rg, rp, 1), CKPT_FAILED_PRECONDITION);
  EXPECT_NE(std::string(ckpt_last_error()).find("released twice"), std::string::npos);
  ckpt_overlap_destroy(ov);
  EXPECT_EQ(0, std::memcmp(wp.data(), wo.data(), wp.size() * 4));  // Put back.
  ckpt_optimizer_destroy(plain);
  ckpt_optimizer_destroy(overlapped);
}

// ABI 6: a checkpointer opened without a weight buffer changes the optimizer's state only; the
// caller writes its weights with ckpt_optimizer_write_weights. ABI 1 to 5's create (above)
// still rewrites its buffer on every load.
TEST(CkptCTest, OpenedCheckpointersLeaveTheWeightsToWriteWeights) {
  ckpt::testing::ScopedTempDir tmp;
  const uint64_t shape[1] = {5};
  ckpt_param param = {"w", shape, 1, CKPT_BF16, 0};
  ckpt_group group = AdamW(0.1, 0.0);
  ckpt_piece piece = {0, 0, 5};
  // 1.0, 2.0, -0.5, 0.25, 3.0 in BF16.
  std::vector<uint16_t> w = {0x3f80, 0x4000, 0xbf00, 0x3e80, 0x4040};
  std::vector<float> g(5, 0.5f);
  ckpt_optimizer* opt = nullptr;
  ASSERT_EQ(ckpt_optimizer_create(&param, 1, &group, 1, &piece, 1, nullptr, w.data(), 10, &opt),
            CKPT_OK)
      << ckpt_last_error();
  ckpt_store* store = nullptr;
  ASSERT_EQ(ckpt_store_open((tmp.path() + "/root").c_str(), 1, 0, &store), CKPT_OK);
  ckpt_checkpointer* ck = nullptr;
  EXPECT_EQ(ckpt_checkpointer_create(opt, w.data(), 8, store, nullptr, 0, &ck),
            CKPT_INVALID_ARGUMENT);
  EXPECT_EQ(ck, nullptr);
  ASSERT_EQ(ckpt_checkpointer_open(opt, store, nullptr, 0, &ck), CKPT_OK) << ckpt_last_error();
  ASSERT_EQ(ckpt_optimizer_step(opt, g.data(), CKPT_F32, 1.0f, w.data(), 0, nullptr, nullptr),
            CKPT_OK);
  ASSERT_EQ(ckpt_checkpointer_save(ck, 1, nullptr, nullptr, nullptr, 0), CKPT_OK);
  const std::vector<uint16_t> saved = w;
  ASSERT_EQ(ckpt_optimizer_step(opt, g.data(), CKPT_F32, 1.0f, w.data(), 0, nullptr, nullptr),
            CKPT_OK);
  const std::vector<uint16_t> stepped = w;
  ASSERT_NE(stepped, saved);
  ASSERT_EQ(ckpt_checkpointer_load(ck, 1, 1, nullptr, nullptr), CKPT_OK) << ckpt_last_error();
  EXPECT_EQ(w, stepped) << "the load wrote the caller's weights";
  std::vector<uint16_t> out(5, 0);
  ASSERT_EQ(ckpt_optimizer_write_weights(opt, out.data(), 0, nullptr), CKPT_OK)
      << ckpt_last_error();
  EXPECT_EQ(out, saved);
  EXPECT_EQ(ckpt_optimizer_write_weights(opt, nullptr, 0, nullptr), CKPT_INVALID_ARGUMENT);
  // The CPU engine has no device to write to.
  EXPECT_EQ(ckpt_optimizer_write_weights(opt, out.data(), 1, nullptr), CKPT_INVALID_ARGUMENT);
  EXPECT_EQ(ckpt_optimizer_write_weights(nullptr, out.data(), 0, nullptr), CKPT_INVALID_ARGUMENT);
  EXPECT_EQ(ckpt_checkpointer_open(nullptr, store, nullptr, 0, &ck), CKPT_INVALID_ARGUMENT);
  ckpt_checkpointer_destroy(ck);
  ckpt_store_close(store);
  ckpt_optimizer_destroy(opt);
}

// ABI 9: a caller's own tensors and blobs saved as one step and read back by range.
TEST(CkptCTest, StoreTransactionsAndReadersRoundTripTensorsAndBlobs) {
  ckpt::testing::ScopedTempDir tmp;
  ckpt_store* store = nullptr;
  ASSERT_EQ(ckpt_store_open((tmp.path() + "/root").c_str(), 1, 0, &store), CKPT_OK);
  ckpt_save* save = nullptr;
  ASSERT_EQ(ckpt_save_begin(store, 5, nullptr, &save), CKPT_OK) << ckpt_last_error();
  const uint64_t shape[2] = {2, 3};
  ASSERT_EQ(ckpt_save_declare(save, "ids", CKPT_I64, shape, 2), CKPT_OK) << ckpt_last_error();
  EXPECT_EQ(ckpt_save_declare(save, "bad", 10, shape, 2), CKPT_INVALID_ARGUMENT);
  const int64_t ids[6] = {1, -2, 3, -4, 5, -6};
  EXPECT_EQ(ckpt_save_write(save, "ids", 0, 4, ids, 3 * sizeof(int64_t)), CKPT_INVALID_ARGUMENT);
  ASSERT_EQ(ckpt_save_write(save, "ids", 0, 4, ids, 4 * sizeof(int64_t)), CKPT_OK);
  ASSERT_EQ(ckpt_save_write(save, "ids", 4, 2, ids + 4, 2 * sizeof(int64_t)), CKPT_OK);
  ASSERT_EQ(ckpt_save_write_blob(save, "meta", "hello", 5), CKPT_OK);
  ASSERT_EQ(ckpt_save_commit(save), CKPT_OK) << ckpt_last_error();
  ckpt_save_destroy(save);
  int has = 0;
  uint64_t latest = 0;
  ASSERT_EQ(ckpt_store_latest(store, &has, &latest), CKPT_OK);
  EXPECT_EQ(latest, 5u);

  ckpt_reader* reader = nullptr;
  ASSERT_EQ(ckpt_reader_open(store, 5, &reader), CKPT_OK) << ckpt_last_error();
  int dtype = -1;
  uint64_t dims[4] = {};
  size_t ndim = 0;
  ASSERT_EQ(ckpt_reader_tensor(reader, "ids", &dtype, dims, 4, &ndim), CKPT_OK);
  EXPECT_EQ(dtype, CKPT_I64);
  ASSERT_EQ(ndim, 2u);
  EXPECT_EQ(dims[0], 2u);
  EXPECT_EQ(dims[1], 3u);
  EXPECT_EQ(ckpt_reader_tensor(reader, "nope", &dtype, dims, 4, &ndim), CKPT_NOT_FOUND);
  int64_t back[3] = {};
  ASSERT_EQ(ckpt_reader_read(reader, "ids", 2, 3, back, sizeof(back)), CKPT_OK);  // Two pieces.
  EXPECT_EQ(back[0], 3);
  EXPECT_EQ(back[1], -4);
  EXPECT_EQ(back[2], 5);
  EXPECT_EQ(ckpt_reader_read(reader, "ids", 4, 3, back, sizeof(back)), CKPT_INVALID_ARGUMENT);
  int64_t first[2] = {}, last[1] = {};
  const char* names[2] = {"ids", "ids"};
  const uint64_t begins[2] = {0, 5}, counts[2] = {2, 1};
  void* const outs[2] = {first, last};
  const size_t sizes[2] = {sizeof(first), sizeof(last)};
  ASSERT_EQ(ckpt_reader_read_many(reader, 2, names, begins, counts, outs, sizes), CKPT_OK);
  EXPECT_EQ(first[0], 1);
  EXPECT_EQ(first[1], -2);
  EXPECT_EQ(last[0], -6);
  EXPECT_EQ(ckpt_reader_read(reader, "ids", 0, 3, back, 2), CKPT_INVALID_ARGUMENT);
  size_t len = 0;
  ASSERT_EQ(ckpt_reader_blob(reader, "meta", 0, nullptr, 0, &len), CKPT_OK);
  ASSERT_EQ(len, 5u);
  char text[5] = {};
  EXPECT_EQ(ckpt_reader_blob(reader, "meta", 0, text, 4, &len), CKPT_OUT_OF_RANGE);
  ASSERT_EQ(ckpt_reader_blob(reader, "meta", 0, text, sizeof(text), &len), CKPT_OK);
  EXPECT_EQ(std::string(text, 5), "hello");
  EXPECT_EQ(ckpt_reader_blob(reader, "meta", 1, text, sizeof(text), &len), CKPT_NOT_FOUND);
  ckpt_reader_close(reader);

  // A step that is not newer than LATEST is refused; an aborted or abandoned save publishes
  // nothing and leaves the store ready for the next.
  EXPECT_EQ(ckpt_save_begin(store, 5, nullptr, &save), CKPT_FAILED_PRECONDITION);
  ASSERT_EQ(ckpt_save_begin(store, 6, nullptr, &save), CKPT_OK);
  ASSERT_EQ(ckpt_save_declare(save, "ids", CKPT_I64, shape, 2), CKPT_OK);
  ASSERT_EQ(ckpt_save_write(save, "ids", 0, 2, ids, 2 * sizeof(int64_t)), CKPT_OK);
  ASSERT_EQ(ckpt_save_abort(save), CKPT_OK);
  ckpt_save_destroy(save);
  ASSERT_EQ(ckpt_save_begin(store, 7, nullptr, &save), CKPT_OK) << ckpt_last_error();
  ckpt_save_destroy(save);  // Never committed: aborted.
  ASSERT_EQ(ckpt_store_latest(store, &has, &latest), CKPT_OK);
  EXPECT_EQ(latest, 5u);
  EXPECT_EQ(ckpt_reader_open(store, 6, &reader), CKPT_NOT_FOUND);

  // A step whose pieces do not cover a range: reading it is NOT_FOUND, not zeros.
  ASSERT_EQ(ckpt_save_begin(store, 8, nullptr, &save), CKPT_OK);
  ASSERT_EQ(ckpt_save_declare(save, "ids", CKPT_I64, shape, 2), CKPT_OK);
  ASSERT_EQ(ckpt_save_write(save, "ids", 0, 2, ids, 2 * sizeof(int64_t)), CKPT_OK);
  ASSERT_EQ(ckpt_save_commit(save), CKPT_OK) << ckpt_last_error();
  ckpt_save_destroy(save);
  ASSERT_EQ(ckpt_reader_open(store, 8, &reader), CKPT_OK);
  EXPECT_EQ(ckpt_reader_read(reader, "ids", 0, 3, back, sizeof(back)), CKPT_NOT_FOUND);
  ckpt_reader_close(reader);

  // The committed steps' directories, by the library's naming (a user's "step-9" is none).
  std::filesystem::create_directory(tmp.path() + "/root/step-9");
  size_t count = 0;
  EXPECT_EQ(ckpt_store_steps(store, nullptr, 0, &count), CKPT_OK);
  EXPECT_EQ(count, 2u);
  uint64_t steps[1] = {};
  ASSERT_EQ(ckpt_store_steps(store, steps, 1, &count), CKPT_OK);
  EXPECT_EQ(count, 2u);
  EXPECT_EQ(steps[0], 5u);
  uint64_t all[4] = {};
  ASSERT_EQ(ckpt_store_steps(store, all, 4, &count), CKPT_OK);
  EXPECT_EQ(std::vector<uint64_t>(all, all + count), (std::vector<uint64_t>{5, 8}));
  EXPECT_EQ(ckpt_store_steps(store, nullptr, 4, &count), CKPT_INVALID_ARGUMENT);
  ckpt_store_close(store);
}

}  // namespace
