// ckpt_abi_layout(): the ABI as the compiler laid it out, for bindings that cannot read ckpt.h
// (Python's ctypes table, python/ckpt/_lib.py, compares itself with it at import). One line
// per item, in this grammar:
//   struct <name> <sizeof>
//   field <struct>.<field> <offsetof> <kind>
//   func <name> <return kind> <argument kinds...>
//   const <name> <value>
// where a kind is p (any pointer, function pointers too), void, i32, u32, i64, u64, f32, f64.
// Every function ckpt.h exports is listed (ckpt_c_test checks the header against this list).
#include <cstddef>
#include <string>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "ckpt/ckpt.h"

namespace {

template <typename T>
std::string Kind() {
  if constexpr (std::is_void_v<T>) {
    return "void";
  } else if constexpr (std::is_pointer_v<T>) {
    return "p";
  } else if constexpr (std::is_floating_point_v<T>) {
    return absl::StrCat("f", 8 * sizeof(T));
  } else {
    static_assert(std::is_integral_v<T>, "an ABI type is a pointer, an integer or a float");
    return absl::StrCat(std::is_signed_v<T> ? "i" : "u", 8 * sizeof(T));
  }
}

template <typename R, typename... Args>
std::string Func(const char* name, R (*)(Args...)) {
  std::string line = absl::StrCat("func ", name, " ", Kind<R>());
  ((line += " " + Kind<Args>()), ...);
  return line + "\n";
}

// The struct and field lines, in ckpt.h's order.
#define CKPT_STRUCT(s) absl::StrAppend(&out, "struct " #s " ", sizeof(s), "\n")
#define CKPT_FIELD(s, f)                                                     \
  absl::StrAppend(&out, "field " #s "." #f " ", offsetof(s, f), " ",         \
                  Kind<decltype(s::f)>(), "\n")
std::string Structs() {
  std::string out;
  CKPT_STRUCT(ckpt_param);
  CKPT_FIELD(ckpt_param, name);
  CKPT_FIELD(ckpt_param, shape);
  CKPT_FIELD(ckpt_param, ndim);
  CKPT_FIELD(ckpt_param, dtype);
  CKPT_FIELD(ckpt_param, group);
  CKPT_STRUCT(ckpt_group);
  CKPT_FIELD(ckpt_group, lr);
  CKPT_FIELD(ckpt_group, beta1);
  CKPT_FIELD(ckpt_group, beta2);
  CKPT_FIELD(ckpt_group, eps);
  CKPT_FIELD(ckpt_group, weight_decay);
  CKPT_FIELD(ckpt_group, step);
  CKPT_FIELD(ckpt_group, amsgrad);
  CKPT_FIELD(ckpt_group, algorithm);
  CKPT_FIELD(ckpt_group, momentum);
  CKPT_FIELD(ckpt_group, nesterov);
  CKPT_FIELD(ckpt_group, ns_a);
  CKPT_FIELD(ckpt_group, ns_b);
  CKPT_FIELD(ckpt_group, ns_c);
  CKPT_FIELD(ckpt_group, ns_steps);
  CKPT_FIELD(ckpt_group, adjust_lr);
  CKPT_STRUCT(ckpt_state);
  CKPT_FIELD(ckpt_state, struct_size);
  CKPT_FIELD(ckpt_state, master);
  CKPT_FIELD(ckpt_state, exp_avg);
  CKPT_FIELD(ckpt_state, exp_avg_sq);
  CKPT_FIELD(ckpt_state, max_exp_avg_sq);
  CKPT_FIELD(ckpt_state, count);
  CKPT_FIELD(ckpt_state, param_steps);
  CKPT_FIELD(ckpt_state, nparams);
  CKPT_FIELD(ckpt_state, aux);
  CKPT_FIELD(ckpt_state, aux_count);
  CKPT_STRUCT(ckpt_piece);
  CKPT_FIELD(ckpt_piece, param);
  CKPT_FIELD(ckpt_piece, begin);
  CKPT_FIELD(ckpt_piece, count);
  CKPT_STRUCT(ckpt_optimizer_options);
  CKPT_FIELD(ckpt_optimizer_options, engine);
  CKPT_FIELD(ckpt_optimizer_options, unit_bytes);
  CKPT_FIELD(ckpt_optimizer_options, threads);
  CKPT_FIELD(ckpt_optimizer_options, slot_count);
  CKPT_FIELD(ckpt_optimizer_options, moment_dtype);
  CKPT_STRUCT(ckpt_store_options);
  CKPT_FIELD(ckpt_store_options, struct_size);
  CKPT_FIELD(ckpt_store_options, primary);
  CKPT_FIELD(ckpt_store_options, read_only);
  CKPT_FIELD(ckpt_store_options, keep_last);
  CKPT_FIELD(ckpt_store_options, keep_every);
  CKPT_FIELD(ckpt_store_options, write_threads);
  CKPT_STRUCT(ckpt_coordinator);
  CKPT_FIELD(ckpt_coordinator, user);
  CKPT_FIELD(ckpt_coordinator, rank);
  CKPT_FIELD(ckpt_coordinator, size);
  CKPT_FIELD(ckpt_coordinator, all_gather);
  CKPT_FIELD(ckpt_coordinator, barrier);
  return out;
}
#undef CKPT_STRUCT
#undef CKPT_FIELD

// The func lines: every function ckpt.h exports.
#define CKPT_FUNC(f) out += Func(#f, &f)
std::string Funcs() {
  std::string out;
  CKPT_FUNC(ckpt_abi_version);
  CKPT_FUNC(ckpt_abi_layout);
  CKPT_FUNC(ckpt_last_error);
  CKPT_FUNC(ckpt_alloc);
  CKPT_FUNC(ckpt_rank_pieces);
  CKPT_FUNC(ckpt_rank_pieces_keeping_whole);
  CKPT_FUNC(ckpt_optimizer_create);
  CKPT_FUNC(ckpt_optimizer_destroy);
  CKPT_FUNC(ckpt_optimizer_size);
  CKPT_FUNC(ckpt_optimizer_step);
  CKPT_FUNC(ckpt_optimizer_step_pieces);
  CKPT_FUNC(ckpt_optimizer_write_weights);
  CKPT_FUNC(ckpt_optimizer_num_groups);
  CKPT_FUNC(ckpt_optimizer_get_group);
  CKPT_FUNC(ckpt_optimizer_set_group);
  CKPT_FUNC(ckpt_optimizer_read_state);
  CKPT_FUNC(ckpt_optimizer_read_state_range);
  CKPT_FUNC(ckpt_optimizer_set_state);
  CKPT_FUNC(ckpt_optimizer_step_masked);
  CKPT_FUNC(ckpt_optimizer_param_steps);
  CKPT_FUNC(ckpt_optimizer_set_param_state);
  CKPT_FUNC(ckpt_store_keep_only);
  CKPT_FUNC(ckpt_store_adopt);
  CKPT_FUNC(ckpt_store_steps);
  CKPT_FUNC(ckpt_optimizer_get_hyper);
  CKPT_FUNC(ckpt_optimizer_set_hyper);
  CKPT_FUNC(ckpt_optimizer_aux_offsets);
  CKPT_FUNC(ckpt_optimizer_set_state_with);
  CKPT_FUNC(ckpt_optimizer_set_masters);
  CKPT_FUNC(ckpt_optimizer_write_piece_weights);
  CKPT_FUNC(ckpt_optimizer_add_params);
  CKPT_FUNC(ckpt_optimizer_lifecycle);
  CKPT_FUNC(ckpt_store_open);
  CKPT_FUNC(ckpt_store_open_with);
  CKPT_FUNC(ckpt_store_open_on_ranks);
  CKPT_FUNC(ckpt_store_close);
  CKPT_FUNC(ckpt_store_latest);
  CKPT_FUNC(ckpt_checkpointer_open);
  CKPT_FUNC(ckpt_checkpointer_create);
  CKPT_FUNC(ckpt_checkpointer_destroy);
  CKPT_FUNC(ckpt_checkpointer_save);
  CKPT_FUNC(ckpt_checkpointer_save_async);
  CKPT_FUNC(ckpt_pending_save_finalize);
  CKPT_FUNC(ckpt_pending_save_writer_done);
  CKPT_FUNC(ckpt_pending_save_destroy);
  CKPT_FUNC(ckpt_checkpointer_load);
  CKPT_FUNC(ckpt_checkpointer_load_newest_intact);
  CKPT_FUNC(ckpt_checkpointer_load_model);
  CKPT_FUNC(ckpt_blobs_count);
  CKPT_FUNC(ckpt_blobs_get);
  CKPT_FUNC(ckpt_blobs_free);
  CKPT_FUNC(ckpt_save_begin);
  CKPT_FUNC(ckpt_save_declare);
  CKPT_FUNC(ckpt_save_write);
  CKPT_FUNC(ckpt_save_write_blob);
  CKPT_FUNC(ckpt_save_commit);
  CKPT_FUNC(ckpt_save_abort);
  CKPT_FUNC(ckpt_save_destroy);
  CKPT_FUNC(ckpt_reader_open);
  CKPT_FUNC(ckpt_reader_close);
  CKPT_FUNC(ckpt_overlap_begin);
  CKPT_FUNC(ckpt_overlap_release);
  CKPT_FUNC(ckpt_overlap_drain);
  CKPT_FUNC(ckpt_overlap_invalidate);
  CKPT_FUNC(ckpt_overlap_finish);
  CKPT_FUNC(ckpt_overlap_destroy);
  CKPT_FUNC(ckpt_overlap_begin_gated);
  CKPT_FUNC(ckpt_optimizer_gate_open);
  CKPT_FUNC(ckpt_optimizer_await_pieces);
  CKPT_FUNC(ckpt_optimizer_await_step);
  CKPT_FUNC(ckpt_optimizer_step_gated);
  CKPT_FUNC(ckpt_reader_tensor);
  CKPT_FUNC(ckpt_reader_read);
  CKPT_FUNC(ckpt_reader_read_many);
  CKPT_FUNC(ckpt_reader_blob);
  return out;
}
#undef CKPT_FUNC

// The const lines.
#define CKPT_CONST(c) absl::StrAppend(&out, "const " #c " ", static_cast<long long>(c), "\n")
std::string Consts() {
  std::string out;
  CKPT_CONST(CKPT_ABI_VERSION);
  CKPT_CONST(CKPT_OK);
  CKPT_CONST(CKPT_ADAMW);
  CKPT_CONST(CKPT_MUON);
  CKPT_CONST(CKPT_ADAFACTOR);
  CKPT_CONST(CKPT_MUON_LR_ORIGINAL);
  CKPT_CONST(CKPT_MUON_LR_MATCH_RMS_ADAMW);
  CKPT_CONST(CKPT_LOAD_MODEL_IGNORE_UNEXPECTED);
  CKPT_CONST(CKPT_LOAD_MODEL_MASTERS);
  CKPT_CONST(CKPT_CANCELLED);
  CKPT_CONST(CKPT_UNKNOWN);
  CKPT_CONST(CKPT_INVALID_ARGUMENT);
  CKPT_CONST(CKPT_DEADLINE_EXCEEDED);
  CKPT_CONST(CKPT_NOT_FOUND);
  CKPT_CONST(CKPT_ALREADY_EXISTS);
  CKPT_CONST(CKPT_PERMISSION_DENIED);
  CKPT_CONST(CKPT_RESOURCE_EXHAUSTED);
  CKPT_CONST(CKPT_FAILED_PRECONDITION);
  CKPT_CONST(CKPT_ABORTED);
  CKPT_CONST(CKPT_OUT_OF_RANGE);
  CKPT_CONST(CKPT_UNIMPLEMENTED);
  CKPT_CONST(CKPT_INTERNAL);
  CKPT_CONST(CKPT_UNAVAILABLE);
  CKPT_CONST(CKPT_DATA_LOSS);
  CKPT_CONST(CKPT_F32);
  CKPT_CONST(CKPT_BF16);
  CKPT_CONST(CKPT_F16);
  CKPT_CONST(CKPT_F64);
  CKPT_CONST(CKPT_I64);
  CKPT_CONST(CKPT_I32);
  CKPT_CONST(CKPT_I16);
  CKPT_CONST(CKPT_I8);
  CKPT_CONST(CKPT_U8);
  CKPT_CONST(CKPT_BOOL);
  CKPT_CONST(CKPT_ENGINE_CPU);
  CKPT_CONST(CKPT_ENGINE_CUDA);
  CKPT_CONST(CKPT_MOMENTS_F32);
  CKPT_CONST(CKPT_MOMENTS_BF16);
  CKPT_CONST(CKPT_MASTER);
  CKPT_CONST(CKPT_EXP_AVG);
  CKPT_CONST(CKPT_EXP_AVG_SQ);
  CKPT_CONST(CKPT_MAX_EXP_AVG_SQ);
  CKPT_CONST(CKPT_AUX);
  CKPT_CONST(CKPT_LIFECYCLE_CLEAN);
  CKPT_CONST(CKPT_LIFECYCLE_LOADING);
  CKPT_CONST(CKPT_LIFECYCLE_POISONED);
  return out;
}
#undef CKPT_CONST

std::string Build() { return absl::StrCat(Structs(), Funcs(), Consts()); }

}  // namespace

const char* ckpt_abi_layout(void) {
  // Built once (thread-safe static initialisation), never freed: valid for the process.
  static const std::string* const layout = new std::string(Build());
  return layout->c_str();
}
