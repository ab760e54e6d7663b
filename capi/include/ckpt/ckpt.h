/* ckpt's stable C ABI (DESIGN.md §9): StagedAdamW, its Checkpointer and a checkpoint store
 * behind opaque handles, so that Python (through ctypes) and any other language call one build
 * of the library whatever their version. Shared library: libckpt_c.so.
 *
 * Conventions:
 * - Every call that can fail returns a status code: CKPT_OK (0) or one of absl's canonical
 *   codes (CKPT_INVALID_ARGUMENT, CKPT_NOT_FOUND, CKPT_DATA_LOSS, ...). The message of the last
 *   failure on the calling thread is ckpt_last_error(). No C++ exception and no abort crosses
 *   this boundary for bad input (a null handle, a wrong size, a closed store: an error code).
 * - Handles are created by *_create / *_open and released by *_destroy / *_close (NULL is
 *   accepted and ignored). A handle must outlive the handles made from it: the store and the
 *   optimizer outlive their checkpointer, the checkpointer its pending saves.
 * - Pointers to tensors are host memory for the CPU engine and device memory for the CUDA
 *   engine; element counts and dtypes travel with them. Dtypes: CKPT_F32, CKPT_BF16, CKPT_F16.
 * - Not thread-safe per handle (one call at a time on an optimizer and its checkpointer), as
 *   the C++ API.
 */
#ifndef CKPT_CKPT_H_
#define CKPT_CKPT_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Versions 2 to 7 only added (2: ckpt_store_open_with; 3: ckpt_checkpointer_load_newest_intact;
 * 4: ckpt_abi_layout; 5: ckpt_store_open_on_ranks; 6: ckpt_optimizer_write_weights,
 * ckpt_checkpointer_open, ckpt_optimizer_set_state, ckpt_optimizer_step_pieces; 7:
 * ckpt_optimizer_step_masked, ckpt_optimizer_param_steps, ckpt_optimizer_set_param_state,
 * ckpt_optimizer_set_masters, ckpt_optimizer_write_piece_weights, ckpt_optimizer_add_params;
 * parameters of several dtypes in one optimizer): a library of 7 serves callers of 1 to 7.
 * 8 breaks that on purpose for AMSGrad: ckpt_group grows (amsgrad) and
 * ckpt_optimizer_set_param_state takes max_exp_avg_sq; it adds ckpt_store_keep_only and
 * ckpt_store_adopt. A caller built against 7 must be rebuilt: compare ckpt_abi_layout() with
 * the layout you were built for (the Python package does, before any other call). 9 only adds
 * store transactions and readers (ckpt_save_*, ckpt_reader_*) and their dtypes: a library of 9
 * serves callers of 8. 10 only adds the overlapped step (ckpt_overlap_*). 11 breaks it again
 * for Muon: ckpt_group grows (algorithm and Muon's hyper-parameters); rebuild against 11. It
 * adds ckpt_rank_pieces_keeping_whole. 12 only adds the gated overlapped step
 * (ckpt_overlap_begin_gated, ckpt_optimizer_gate_open, ckpt_optimizer_await_pieces,
 * ckpt_optimizer_await_step): a library of 12 serves callers of 11. 13 only adds
 * ckpt_optimizer_step_gated: a library of 13 serves callers of 12. 14 only adds
 * ckpt_optimizer_read_state_range: a library of 14 serves callers of 13. 15 only adds
 * ckpt_store_steps. 16 only adds what update rules need, no struct of earlier versions changed
 * (CKPT_ADAFACTOR; a rule's own hyper-parameters by name: ckpt_optimizer_set_hyper,
 * ckpt_optimizer_get_hyper; its state shaped unlike its parameter: CKPT_AUX,
 * ckpt_optimizer_aux_offsets, and ckpt_optimizer_set_state_with with the new struct_size struct
 * ckpt_state): a library of 16 serves callers of 15, and a later rule needs no new version. */
#define CKPT_ABI_VERSION 16

/* The library exports these functions (and nothing of its C++ internals). */
#if defined(__GNUC__)
#define CKPT_C_EXPORT __attribute__((visibility("default")))
#else
#define CKPT_C_EXPORT
#endif

enum {
  CKPT_OK = 0,
  CKPT_CANCELLED = 1,
  CKPT_UNKNOWN = 2,
  CKPT_INVALID_ARGUMENT = 3,
  CKPT_DEADLINE_EXCEEDED = 4,
  CKPT_NOT_FOUND = 5,
  CKPT_ALREADY_EXISTS = 6,
  CKPT_PERMISSION_DENIED = 7,
  CKPT_RESOURCE_EXHAUSTED = 8,
  CKPT_FAILED_PRECONDITION = 9,
  CKPT_ABORTED = 10,
  CKPT_OUT_OF_RANGE = 11,
  CKPT_UNIMPLEMENTED = 12,
  CKPT_INTERNAL = 13,
  CKPT_UNAVAILABLE = 14,
  CKPT_DATA_LOSS = 15,
};

enum { CKPT_F32 = 0, CKPT_BF16 = 1, CKPT_F16 = 2 };           /* Tensor dtypes. */
enum { CKPT_ENGINE_CPU = 0, CKPT_ENGINE_CUDA = 1 };           /* Update engines. */
enum { CKPT_MOMENTS_F32 = 0, CKPT_MOMENTS_BF16 = 1 };         /* Moment dtypes in the slabs. */
/* State tensors; CKPT_MAX_EXP_AVG_SQ (ABI 8) is AMSGrad's running maximum. */
/* (ABI 16) CKPT_AUX: state shaped unlike its parameter (Adafactor's factors), FP32, addressed
 * by aux offsets (ckpt_optimizer_aux_offsets). */
enum { CKPT_MASTER = 0, CKPT_EXP_AVG = 1, CKPT_EXP_AVG_SQ = 2, CKPT_MAX_EXP_AVG_SQ = 3,
       CKPT_AUX = 4 };
enum { CKPT_LIFECYCLE_CLEAN = 0, CKPT_LIFECYCLE_LOADING = 1, CKPT_LIFECYCLE_POISONED = 2 };

/* The ABI version this library implements (CKPT_ABI_VERSION of its header). */
CKPT_C_EXPORT int ckpt_abi_version(void);
/* (ABI 4) This ABI as the compiler laid it out, one line per struct, field, function and
 * constant: "struct <name> <size>", "field <struct>.<field> <offset> <kind>", "func <name>
 * <return kind> <argument kinds>", "const <name> <value>" (kinds: p, void, i32, u32, i64, u64,
 * f32, f64). A binding that cannot include this header (ctypes) compares its own table with it
 * before the first call. Static storage, valid for the process. */
CKPT_C_EXPORT const char* ckpt_abi_layout(void);
/* The message of the last failed call on this thread ("" when none). Valid until the next
 * call on this thread. */
CKPT_C_EXPORT const char* ckpt_last_error(void);
/* Memory a coordinator callback hands to ckpt (freed by ckpt with free()). */
CKPT_C_EXPORT void* ckpt_alloc(size_t bytes);

typedef struct ckpt_store ckpt_store;
typedef struct ckpt_optimizer ckpt_optimizer;
typedef struct ckpt_checkpointer ckpt_checkpointer;
typedef struct ckpt_pending_save ckpt_pending_save;
typedef struct ckpt_blobs ckpt_blobs;

/* ---- Layout of an optimizer (ckpt/optimizer/layout.h) ---- */
typedef struct {
  const char* name;
  const uint64_t* shape;
  size_t ndim;      /* 0: a scalar. */
  int dtype;        /* The model dtype: CKPT_F32, CKPT_BF16 or CKPT_F16. */
  uint32_t group;   /* Index of its param group. */
} ckpt_param;

typedef struct {
  double lr, beta1, beta2, eps, weight_decay;
  uint64_t step; /* Steps taken; ignored by ckpt_optimizer_set_group. */
  /* (ABI 8) 1: AMSGrad (torch's amsgrad=True). The optimizer keeps max_exp_avg_sq once a group
   * of ckpt_optimizer_create or ckpt_optimizer_add_params has it; ckpt_optimizer_set_group
   * refuses it on an optimizer without. */
  int amsgrad;
  /* (ABI 11) The group's update rule, CKPT_ADAMW or CKPT_MUON (docs/design/muon.md), fixed once
   * the group is added; then Muon's hyper-parameters (torch.optim.Muon's: momentum, nesterov,
   * ns_coefficients, ns_steps, adjust_lr_fn as CKPT_MUON_LR_*), read for a Muon group only. A
   * Muon group uses lr, eps and weight_decay above, and takes 2-D parameters held whole. */
  int algorithm;
  double momentum;
  int nesterov;
  double ns_a, ns_b, ns_c;
  uint32_t ns_steps;
  int adjust_lr;
} ckpt_group;

/* (ABI 16) CKPT_ADAFACTOR: torch.optim.Adafactor (docs/design/adafactor.md); lr and
 * weight_decay above, its own hyper-parameters by name (ckpt_optimizer_set_hyper). */
enum { CKPT_ADAMW = 0, CKPT_MUON = 1, CKPT_ADAFACTOR = 2 };
/* Muon's lr for an A x B matrix: lr * sqrt(max(1, A / B)), or lr * 0.2 * sqrt(max(A, B)). */
enum { CKPT_MUON_LR_ORIGINAL = 0, CKPT_MUON_LR_MATCH_RMS_ADAMW = 1 };

typedef struct {
  uint32_t param;
  uint64_t begin, count; /* Elements [begin, begin + count) of the parameter's flat index. */
} ckpt_piece;

typedef struct {
  int engine;          /* CKPT_ENGINE_CPU or CKPT_ENGINE_CUDA. */
  uint64_t unit_bytes; /* 0: the default (8 MiB). */
  int threads;         /* CPU engine: 0 uses every core. */
  int slot_count;      /* CUDA engine: 0 for the default (2). */
  int moment_dtype;    /* CKPT_MOMENTS_F32 or CKPT_MOMENTS_BF16. */
} ckpt_optimizer_options;

/* Megatron buckets (BuildBuckets, RankPieces): the pieces rank `rank` of `dp` ranks owns.
 * Writes at most `capacity` pieces to `out` and their number to *count (when *count >
 * capacity, call again with more room). bucket_elems 0: the default (40,000,000). */
CKPT_C_EXPORT int ckpt_rank_pieces(const ckpt_param* params, size_t nparams, uint64_t bucket_elems, int dp,
                     int rank, ckpt_piece* out, size_t capacity, size_t* count);
/* (ABI 11) The same when the parameters `whole` flags (one byte each, non-zero: Muon's
 * matrices) must each lie whole on one rank (RankPiecesKeepingWhole): the others are cut as
 * ckpt_rank_pieces cuts them, then each whole one, the largest first, goes to the rank holding
 * the fewest elements so far. */
CKPT_C_EXPORT int ckpt_rank_pieces_keeping_whole(const ckpt_param* params, size_t nparams,
                                   const uint8_t* whole, uint64_t bucket_elems, int dp, int rank,
                                   ckpt_piece* out, size_t capacity, size_t* count);

/* ---- Optimizer ---- */
/* Masters from `weights`: host memory, this rank's pieces in slab order, each element in its
 * parameter's dtype (parameters may mix CKPT_F32, CKPT_BF16 and CKPT_F16), each piece at a
 * multiple of its element size (no gap when all share one dtype). The same flat layout is
 * the `params` of ckpt_optimizer_step and the `dest` of ckpt_optimizer_write_weights. */
CKPT_C_EXPORT int ckpt_optimizer_create(const ckpt_param* params, size_t nparams, const ckpt_group* groups,
                          size_t ngroups, const ckpt_piece* pieces, size_t npieces,
                          const ckpt_optimizer_options* options, const void* weights,
                          size_t weight_bytes, ckpt_optimizer** out);
CKPT_C_EXPORT void ckpt_optimizer_destroy(ckpt_optimizer* opt);
/* Elements this rank owns. */
CKPT_C_EXPORT int ckpt_optimizer_size(const ckpt_optimizer* opt, uint64_t* elements);
/* One AdamW step: `grads` (`grad_dtype`, elements in slab order) scaled by `grad_scale`;
 * the updated masters rounded into `params` (model dtype). `stream`: the CUDA engine's caller
 * stream (cudaStream_t; NULL is the legacy default stream, torch's handle 0), which is made to
 * wait for the step's writes; ignored by the CPU engine.
 * *skipped (may be NULL) is 1 when check_finite found NaN/Inf and nothing changed. */
CKPT_C_EXPORT int ckpt_optimizer_step(ckpt_optimizer* opt, const void* grads, int grad_dtype, float grad_scale,
                        void* params, int check_finite, void* stream, int* skipped);
/* (ABI 6) The model weights, which are the masters rounded to the model dtype (nearest even),
 * into `dest` (this rank's elements in slab order): what a trainer calls after a load through
 * ckpt_checkpointer_open's handle. on_device 0: `dest` is host memory (`stream` ignored; the
 * CUDA engine first waits for the last step). on_device 1 (CUDA engine): `dest` is device
 * memory, written after the work queued on `stream` (cudaStream_t; NULL is the legacy default
 * stream), which is made to wait for the writes. */
CKPT_C_EXPORT int ckpt_optimizer_write_weights(ckpt_optimizer* opt, void* dest, int on_device,
                                               void* stream);
/* (ABI 6) ckpt_optimizer_step on each piece's own buffers, read and written in place (a
 * parameter's storage: no flat copy): grads[k] and params[k] hold piece k's elements, for the
 * `npieces` pieces of the optimizer in the order it was created with. */
CKPT_C_EXPORT int ckpt_optimizer_step_pieces(ckpt_optimizer* opt, const void* const* grads,
                                             void* const* params, size_t npieces, int grad_dtype,
                                             float grad_scale, int check_finite, void* stream,
                                             int* skipped);
/* (ABI 7) ckpt_optimizer_step_pieces where only some parameters have a gradient: stepped[i]
 * (one byte per parameter of the layout, `nparams` of them, the same on every rank) 0 leaves
 * parameter i exactly as it is, as torch skips a parameter whose .grad is None: its pieces'
 * grads[k] and params[k] may be NULL, and its step count does not advance. Each parameter's
 * bias correction uses its own step count. */
CKPT_C_EXPORT int ckpt_optimizer_step_masked(ckpt_optimizer* opt, const void* const* grads,
                                             void* const* params, size_t npieces,
                                             const uint8_t* stepped, size_t nparams,
                                             int grad_dtype, float grad_scale, int check_finite,
                                             void* stream, int* skipped);
/* (ABI 10) The overlapped step (docs/design/overlap.md): each unit is updated as soon as the
 * gradients of its pieces are final, while backward goes on, bit for bit as
 * ckpt_optimizer_step_masked with the arguments of ckpt_overlap_finish. Units are updated
 * speculatively with `grad_scale` (the step's unless clipping fires) from the state into a spare
 * copy (allocated at the first speculating step: the state is then held twice in host memory);
 * finish commits them when its arguments agree and redoes the step otherwise. speculate 0
 * updates nothing before finish. `stream`: the CUDA engine's caller stream (the backward's). */
typedef struct ckpt_overlap ckpt_overlap;
CKPT_C_EXPORT int ckpt_overlap_begin(ckpt_optimizer* opt, int grad_dtype, float grad_scale,
                                     void* stream, int speculate, ckpt_overlap** out);
/* (ABI 12) ckpt_overlap_begin with speculation and a gate on the CUDA engine
 * (StagedAdamW::OverlapOptions::gate; the CPU engine ignores it): at most `window` units (0: 8)
 * on the device at once during backward, the lowest slab index first; the rest go at finish
 * in slab order; and a finish that holds leaves `stream` unordered after the weight writes
 * (ckpt_optimizer_gate_open then says 1): each reader waits with ckpt_optimizer_await_pieces
 * (or _await_step) before it reads. */
CKPT_C_EXPORT int ckpt_overlap_begin_gated(ckpt_optimizer* opt, int grad_dtype,
                                           float grad_scale, void* stream, uint32_t window,
                                           ckpt_overlap** out);
/* (ABI 12) *open: 1 while a gated step's writes have readers to wait for them, else 0. */
CKPT_C_EXPORT int ckpt_optimizer_gate_open(const ckpt_optimizer* opt, int* open);
/* (ABI 12) After a gated step: what is queued next on `stream` runs after the step's writes of
 * the weights of pieces pieces[0 .. n) (each unit is awaited once: a piece awaited already
 * costs nothing, and another stream awaits with _await_step). No-op when no gate is open. */
CKPT_C_EXPORT int ckpt_optimizer_await_pieces(ckpt_optimizer* opt, const uint32_t* pieces,
                                              size_t n, void* stream);
/* (ABI 12) The same for every piece: the gate closes. */
CKPT_C_EXPORT int ckpt_optimizer_await_step(ckpt_optimizer* opt, void* stream);
/* (ABI 13) ckpt_optimizer_step_masked whose writes are gated (StepArgs::gate): on the CUDA
 * engine the units run in slab order and `stream` is not ordered after their weight writes;
 * *gated (may be NULL) says 1 when a gate opened, and each reader then waits with
 * ckpt_optimizer_await_pieces (or _await_step). The plain step the next forward hides, for a
 * step that could not speculate (clipping that fires). The CPU engine, a step under an async
 * save's fence, an optimizer with Muon groups and a skipped step order `stream` as
 * ckpt_optimizer_step_masked does (*gated 0). */
CKPT_C_EXPORT int ckpt_optimizer_step_gated(ckpt_optimizer* opt, const void* const* grads,
                                            void* const* params, size_t npieces,
                                            const uint8_t* stepped, size_t nparams,
                                            int grad_dtype, float grad_scale, int check_finite,
                                            void* stream, int* skipped, int* gated);
/* The gradients of pieces pieces[0 .. n) are final: grads[i] and params[i] are piece
 * pieces[i]'s own buffers. A piece released twice (a second backward before the step) fails
 * with CKPT_FAILED_PRECONDITION and abandons the step (the weights written are put back). */
CKPT_C_EXPORT int ckpt_overlap_release(ckpt_overlap* ov, const uint32_t* pieces,
                                       const void* const* grads, void* const* params, size_t n);
/* Blocks until every piece released so far has been updated (queued, on the CUDA engine): a
 * thread of the library's runs the updates, and finish does what it has not taken yet itself. */
CKPT_C_EXPORT int ckpt_overlap_drain(ckpt_overlap* ov);
/* A released gradient changed after its release (an in-place clip or unscale): finish redoes
 * the step. */
CKPT_C_EXPORT int ckpt_overlap_invalidate(ckpt_overlap* ov);
/* Ends the step as ckpt_optimizer_step_masked with these arguments would have run it.
 * *speculated: units updated before finish; *held: 1 when that speculation was committed. On
 * an error the state is as before the step. The overlap is closed either way (destroy it). */
CKPT_C_EXPORT int ckpt_overlap_finish(ckpt_overlap* ov, const void* const* grads,
                                      void* const* params, size_t npieces,
                                      const uint8_t* stepped, size_t nparams, int grad_dtype,
                                      float grad_scale, int check_finite, void* stream,
                                      int* skipped, uint64_t* speculated, int* held);
/* Frees the handle; an overlap not finished is abandoned (the state as before the step, the
 * weights written put back). NULL is a no-op. The optimizer must outlive its overlap. */
CKPT_C_EXPORT void ckpt_overlap_destroy(ckpt_overlap* ov);
/* (ABI 7) ckpt_optimizer_write_weights into each piece's own buffer: params[k] holds piece
 * k's elements (in its parameter's dtype), for the `npieces` pieces of the optimizer. */
CKPT_C_EXPORT int ckpt_optimizer_write_piece_weights(ckpt_optimizer* opt, void* const* params,
                                                     size_t npieces, int on_device,
                                                     void* stream);
/* (ABI 7) Adds parameters (torch's add_param_group; StagedAdamW::AddParams): `params` (their
 * group indexes the current groups, then `groups`), this rank's `pieces` of them (param
 * indexes the current parameters, then `params`) and their initial weights (`weights`: the
 * new pieces in a flat model-weight buffer of their own). They start fresh; the others keep
 * their state. Refused, with nothing changed, during an async save or a load. */
CKPT_C_EXPORT int ckpt_optimizer_add_params(ckpt_optimizer* opt, const ckpt_param* params,
                                            size_t nparams, const ckpt_group* groups,
                                            size_t ngroups, const ckpt_piece* pieces,
                                            size_t npieces, const void* weights,
                                            size_t weight_bytes);
/* (ABI 7) Each parameter's step count (how many steps updated it) into out[0 .. nparams). */
CKPT_C_EXPORT int ckpt_optimizer_param_steps(const ckpt_optimizer* opt, uint64_t* out,
                                             size_t nparams);
/* (ABI 7) Replaces the masters of slab elements [offset, offset + count) with `values` (a
 * parameter the trainer changed in place; moments and step counts stay). An async save in
 * flight keeps the masters from before. */
CKPT_C_EXPORT int ckpt_optimizer_set_masters(ckpt_optimizer* opt, uint64_t offset,
                                             const float* values, uint64_t count);
CKPT_C_EXPORT int ckpt_optimizer_num_groups(const ckpt_optimizer* opt, size_t* count);
CKPT_C_EXPORT int ckpt_optimizer_get_group(const ckpt_optimizer* opt, size_t index, ckpt_group* out);
/* Replaces group `index`'s hyper-parameters from the next step on (its step counter kept). */
CKPT_C_EXPORT int ckpt_optimizer_set_group(ckpt_optimizer* opt, size_t index, const ckpt_group* group);
/* Copies one state tensor (CKPT_MASTER, CKPT_EXP_AVG, CKPT_EXP_AVG_SQ, or
 * CKPT_MAX_EXP_AVG_SQ when the optimizer keeps it) as FP32 into `out` (`count` = the
 * optimizer's size). */
CKPT_C_EXPORT int ckpt_optimizer_read_state(ckpt_optimizer* opt, int which, float* out, uint64_t count);
/* (ABI 14) ckpt_optimizer_read_state of slab elements [offset, offset + count) only (one
 * parameter's state, say, at the cost of its own elements); CKPT_OUT_OF_RANGE past the
 * optimizer's size. */
CKPT_C_EXPORT int ckpt_optimizer_read_state_range(ckpt_optimizer* opt, int which, uint64_t offset,
                                                  float* out, uint64_t count);
/* (ABI 6) Replaces the whole state at once (StagedAdamW::SetState): `master` (NULL: the masters
 * stay), `exp_avg` and `exp_avg_sq` as FP32, `count` (the optimizer's size) elements each, and
 * every group's step counter (`nsteps` = the number of groups). All or nothing: a size or
 * count that does not match, a non-finite value, a load in progress or an async save in flight
 * is an error and changes nothing. */
CKPT_C_EXPORT int ckpt_optimizer_set_state(ckpt_optimizer* opt, const float* master,
                                           const float* exp_avg, const float* exp_avg_sq,
                                           uint64_t count, const uint64_t* steps, size_t nsteps);
/* (ABI 8) ckpt_optimizer_set_state with each parameter's own step count (`nparams` = the
 * number of parameters of the layout) and AMSGrad's `max_exp_avg_sq` (NULL: zero; refused
 * when the optimizer keeps none). */
CKPT_C_EXPORT int ckpt_optimizer_set_param_state(ckpt_optimizer* opt, const float* master,
                                                 const float* exp_avg, const float* exp_avg_sq,
                                                 const float* max_exp_avg_sq, uint64_t count,
                                                 const uint64_t* param_steps, size_t nparams);
/* (ABI 16) A hyper-parameter of group `group` by the name its rule gives it (as torch's
 * param_groups do: "lr", "beta2_decay", "eps1"...). get: *value and *present = 1, or *present =
 * 0 for an optional one not set (Adafactor's eps1 = None). set: only a rule's own ones (not the
 * fields of ckpt_group, which ckpt_optimizer_set_group sets); value NULL unsets an optional
 * one; validated as ckpt_optimizer_set_group validates, the group unchanged on an error.
 * ckpt_optimizer_set_group keeps them. CKPT_INVALID_ARGUMENT for a name the rule lacks. */
CKPT_C_EXPORT int ckpt_optimizer_get_hyper(const ckpt_optimizer* opt, size_t group,
                                           const char* name, double* value, int* present);
CKPT_C_EXPORT int ckpt_optimizer_set_hyper(ckpt_optimizer* opt, size_t group, const char* name,
                                           const double* value);
/* (ABI 16) Where each piece's aux state begins (CKPT_AUX offsets; its states back to back in
 * the order its rule declares them, each in row-major order), then the aux size: `count` =
 * the number of pieces + 1 values into `out`. */
CKPT_C_EXPORT int ckpt_optimizer_aux_offsets(const ckpt_optimizer* opt, uint64_t* out,
                                             size_t count);
/* (ABI 16) The whole state at once (ckpt_optimizer_set_param_state's contract), aux state too.
 * struct_size = sizeof(ckpt_state) as the caller compiled it: later versions may append fields,
 * which a library reads only from callers whose struct_size holds them (others get their zero
 * meaning), and a library refuses only a size smaller than ABI 16's. NULL arrays: the masters
 * stay (master); zero (max_exp_avg_sq, aux). */
typedef struct {
  size_t struct_size;
  const float* master;
  const float* exp_avg;
  const float* exp_avg_sq;
  const float* max_exp_avg_sq;
  uint64_t count; /* Elements of each array above: the optimizer's size. */
  const uint64_t* param_steps;
  size_t nparams;
  const float* aux;
  uint64_t aux_count; /* The aux size (ckpt_optimizer_aux_offsets' last value). */
} ckpt_state;
CKPT_C_EXPORT int ckpt_optimizer_set_state_with(ckpt_optimizer* opt, const ckpt_state* state);
/* CKPT_LIFECYCLE_*; a poisoned optimizer refuses to step until a complete load. */
CKPT_C_EXPORT int ckpt_optimizer_lifecycle(const ckpt_optimizer* opt, int* lifecycle);

/* ---- Store ---- */
/* primary: this handle owns the root (rank 0 of a job; recovers it at open); read_only: only
 * reads. */
CKPT_C_EXPORT int ckpt_store_open(const char* root, int primary, int read_only, ckpt_store** out);
/* ckpt_store_open with more options. Zero the struct, set struct_size to
 * sizeof(ckpt_store_options) (later versions add fields at the end), then what you need. */
typedef struct {
  size_t struct_size;
  int primary;
  int read_only;
  /* Retention after each commit (the primary applies it; the old steps' files are removed in
   * the background): keep the newest keep_last steps (0: keep every step) and every step that
   * is a multiple of keep_every (0: none for this reason). LATEST's step is always kept. */
  uint64_t keep_last;
  uint64_t keep_every;
  /* Threads that write this rank's data file of a save, 1 to 64 (0: the default, 4). */
  int write_threads;
} ckpt_store_options;
CKPT_C_EXPORT int ckpt_store_open_with(const char* root, const ckpt_store_options* options,
                                       ckpt_store** out);
CKPT_C_EXPORT void ckpt_store_close(ckpt_store* store);
/* The step LATEST names (*has_latest 0 when nothing is committed). */
CKPT_C_EXPORT int ckpt_store_latest(const ckpt_store* store, int* has_latest, uint64_t* step);
/* (ABI 8) Retention by the caller's list: every committed step but LATEST and the `nkeep` of
 * `keep` is removed (each renamed away whole, then deleted: a crash leaves every remaining
 * step whole); a step holding anything ckpt did not write moves whole into quarantine/
 * instead, and one that is or holds a mount point stays (recovery's rule). What a trainer
 * whose own rotation decides which checkpoints exist calls (HF Trainer's save_total_limit).
 * *retired (may be NULL): how many steps went (deleted or quarantined). The primary, writable
 * handle only, with no save in flight. */
CKPT_C_EXPORT int ckpt_store_keep_only(ckpt_store* store, const uint64_t* keep, size_t nkeep,
                                       size_t* retired);
/* (ABI 8) Makes LATEST name the committed step `step` (ckpt-tool adopt), e.g. an older step a
 * trainer resumed from, so that its next saves (numbered above `step`) are accepted. Every
 * chunk of the step is verified first (DATA_LOSS naming it otherwise; LATEST unchanged). The
 * newer steps stay on disk: a later save of the same number moves its predecessor into
 * quarantine/, never deletes it. The primary, writable handle only, with no save in flight. */
CKPT_C_EXPORT int ckpt_store_adopt(ckpt_store* store, uint64_t step);
/* (ABI 15) The steps with a directory in the root (by the library's own naming of step
 * directories), ascending: the first `capacity` into `steps`, and *count (not NULL) how many
 * there are (call again with a larger array when *count > capacity). Manifests are not read:
 * a step above LATEST, or a damaged one, is listed too. */
CKPT_C_EXPORT int ckpt_store_steps(const ckpt_store* store, uint64_t* steps, size_t capacity,
                                   size_t* count);

/* ---- Coordinator: the ranks of a job (NULL everywhere: a single process) ---- */
typedef struct {
  void* user;
  int rank;
  int size;
  /* Every rank calls it with its `len` bytes at `data`; on return *out holds every rank's
   * bytes back to back in rank order (memory from ckpt_alloc; ckpt frees it) and lens[r]
   * (`size` entries) their lengths. Returns 0, or nonzero when the exchange failed. */
  int (*all_gather)(void* user, const void* data, size_t len, void** out, size_t* lens);
  /* Returns when every rank has called it: 0, or nonzero when it failed. May be NULL: an
   * all_gather of nothing then serves. */
  int (*barrier)(void* user);
} ckpt_coordinator;
/* Collective: this rank's handle on `root`, opened in the one safe order (options->primary is
 * ignored): rank 0 opens the primary handle, which creates and recovers the root, and only
 * then do the other ranks open theirs; every rank gets a handle, or every rank fails with the
 * first failure and gets none. `coordinator` is used during the call only. Every rank must pass
 * the same root and options: a rank whose arguments are refused before the collective returns
 * at once and leaves the others waiting in it. */
CKPT_C_EXPORT int ckpt_store_open_on_ranks(const char* root, const ckpt_store_options* options,
                                           const ckpt_coordinator* coordinator, ckpt_store** out);

/* ---- Checkpointer ---- */
/* (ABI 6) async_staging_bytes 0: the default (1 GiB). `coordinator` is copied; its callbacks
 * must stay callable while the checkpointer lives. Loads change the optimizer's state only:
 * the caller then writes its weights with ckpt_optimizer_write_weights. */
CKPT_C_EXPORT int ckpt_checkpointer_open(ckpt_optimizer* opt, ckpt_store* store,
                                         const ckpt_coordinator* coordinator,
                                         uint64_t async_staging_bytes, ckpt_checkpointer** out);
/* ckpt_checkpointer_open, for callers of ABI 1 to 5: `weights` is this rank's model-dtype
 * weight buffer, host memory, in slab order, `weight_bytes` exactly its size; every successful
 * load (ckpt_checkpointer_load, _load_newest_intact, _load_model) writes the masters rounded
 * into it before it returns. */
CKPT_C_EXPORT int ckpt_checkpointer_create(ckpt_optimizer* opt, void* weights, size_t weight_bytes,
                             ckpt_store* store, const ckpt_coordinator* coordinator,
                             uint64_t async_staging_bytes, ckpt_checkpointer** out);
CKPT_C_EXPORT void ckpt_checkpointer_destroy(ckpt_checkpointer* ckpt);
/* Collective. The trainer's blobs: `n` keys with their bytes. */
CKPT_C_EXPORT int ckpt_checkpointer_save(ckpt_checkpointer* ckpt, uint64_t step, const char* const* keys,
                           const void* const* values, const size_t* lens, size_t n);
CKPT_C_EXPORT int ckpt_checkpointer_save_async(ckpt_checkpointer* ckpt, uint64_t step, const char* const* keys,
                                 const void* const* values, const size_t* lens, size_t n,
                                 ckpt_pending_save** out);
/* Collective: waits for the writer, commits on every rank or on none. */
CKPT_C_EXPORT int ckpt_pending_save_finalize(ckpt_pending_save* save);
/* 1 when this rank's writer has finished. */
CKPT_C_EXPORT int ckpt_pending_save_writer_done(const ckpt_pending_save* save, int* done);
CKPT_C_EXPORT void ckpt_pending_save_destroy(ckpt_pending_save* save);
/* Collective. has_step 0: LATEST. On success *blobs (may be NULL) receives this rank's blobs
 * and *loaded_step (may be NULL) the step. On failure the state is as before, or poisoned. */
CKPT_C_EXPORT int ckpt_checkpointer_load(ckpt_checkpointer* ckpt, int has_step, uint64_t step,
                           ckpt_blobs** blobs, uint64_t* loaded_step);
/* Collective (ABI 3). LATEST, or while a step fails on damage each older one, newest first
 * (C++ Checkpointer::LoadNewestIntact): *blobs and *loaded_step as ckpt_checkpointer_load;
 * *skipped (may be NULL) is set to the number of newer steps passed over. */
CKPT_C_EXPORT int ckpt_checkpointer_load_newest_intact(ckpt_checkpointer* ckpt, ckpt_blobs** blobs,
                                                       uint64_t* loaded_step, uint64_t* skipped);
/* Collective. Model-only load from a .safetensors file, an HF directory or a ckpt root ("" for
 * this store); `n` rename rules (RE2 pattern -> replacement, in order). `flags`: any of
 * CKPT_LOAD_MODEL_IGNORE_UNEXPECTED (1; a caller of ABI 10 or older passes it as its
 * ignore_unexpected) and (ABI 11) CKPT_LOAD_MODEL_MASTERS (a ckpt root's FP32 masters rather than
 * its weights; C++ ModelLoadOptions::masters). */
enum { CKPT_LOAD_MODEL_IGNORE_UNEXPECTED = 1, CKPT_LOAD_MODEL_MASTERS = 2 };
CKPT_C_EXPORT int ckpt_checkpointer_load_model(ckpt_checkpointer* ckpt, const char* source,
                                 const char* const* patterns, const char* const* replacements,
                                 size_t n, int flags);

/* ---- Blobs returned by a load ---- */
CKPT_C_EXPORT int ckpt_blobs_count(const ckpt_blobs* blobs, size_t* count);
/* The i-th key (NUL-terminated) and its value's bytes; valid until ckpt_blobs_free. */
CKPT_C_EXPORT int ckpt_blobs_get(const ckpt_blobs* blobs, size_t i, const char** key, const void** value,
                   size_t* len);
CKPT_C_EXPORT void ckpt_blobs_free(ckpt_blobs* blobs);

/* ---- Store transactions and readers (ABI 9): any trainer's tensors and blobs as one step ----
 * What the optimizer's checkpointer does for its own state, for any state a caller holds (the
 * DCP storage layer, python/ckpt/dcp.py): a save writes tensors (name, dtype, global shape) as
 * pieces of their flat index, and opaque blobs, into a step that is committed on every rank or
 * on none (the store's save protocol, libckpt/store/transaction.cc and commit.cc); a reader
 * reads element ranges of a committed step's tensors, checksumming every chunk it touches,
 * whichever ranks wrote them. Memory is host memory. */
/* Element types of store tensors; the first three are CKPT_F32, CKPT_BF16 and CKPT_F16. */
enum { CKPT_F64 = 3, CKPT_I64 = 4, CKPT_I32 = 5, CKPT_I16 = 6, CKPT_I8 = 7, CKPT_U8 = 8,
       CKPT_BOOL = 9 };
typedef struct ckpt_save ckpt_save;
typedef struct ckpt_reader ckpt_reader;
/* Collective: begins saving `step` (newer than LATEST) on `store` (rank 0: the primary,
 * writable handle); NULL coordinator: a single process. `coordinator` is copied and its
 * callbacks must stay callable until the save is destroyed (its commit, abort and destruction
 * call them). FAILED_PRECONDITION for a step not newer than LATEST or a save in flight. */
CKPT_C_EXPORT int ckpt_save_begin(ckpt_store* store, uint64_t step,
                                  const ckpt_coordinator* coordinator, ckpt_save** out);
/* Declares tensor `name` (dtype CKPT_F32..CKPT_BOOL, global shape of `ndim` dims; 0: a
 * scalar). Ranks that declare one name must agree (checked at commit). */
CKPT_C_EXPORT int ckpt_save_declare(ckpt_save* save, const char* name, int dtype,
                                    const uint64_t* shape, size_t ndim);
/* Writes elements [begin, begin + count) of a declared tensor from `data` (`bytes` exactly
 * count elements); returns once the bytes are copied. INVALID_ARGUMENT for a bad range or size
 * (the save stays usable); an IO error makes this rank vote no at commit. */
CKPT_C_EXPORT int ckpt_save_write(ckpt_save* save, const char* tensor, uint64_t begin,
                                  uint64_t count, const void* data, size_t bytes);
/* Stores `bytes` opaque bytes under `name` (unique per rank). */
CKPT_C_EXPORT int ckpt_save_write_blob(ckpt_save* save, const char* name, const void* data,
                                       size_t bytes);
/* Collective: makes this rank's data durable, votes, and commits on every rank or on none (the
 * previous checkpoint untouched). OK once LATEST names the step. */
CKPT_C_EXPORT int ckpt_save_commit(ckpt_save* save);
/* Collective: votes no; the step is abandoned everywhere and its staging directory removed. */
CKPT_C_EXPORT int ckpt_save_abort(ckpt_save* save);
/* Destroys the save; one that neither committed nor aborted aborts first (collective). */
CKPT_C_EXPORT void ckpt_save_destroy(ckpt_save* save);
/* Opens committed step `step` of `store` for reading (NOT_FOUND when there is none; DATA_LOSS
 * naming the file for damage). The store outlives the reader. Reads on one reader may run
 * concurrently from several threads. */
CKPT_C_EXPORT int ckpt_reader_open(const ckpt_store* store, uint64_t step, ckpt_reader** out);
CKPT_C_EXPORT void ckpt_reader_close(ckpt_reader* reader);
/* Tensor `name`'s dtype and global shape: *ndim its rank; up to `max_ndim` dims are written to
 * `shape`. NOT_FOUND for an unknown name. */
CKPT_C_EXPORT int ckpt_reader_tensor(const ckpt_reader* reader, const char* name, int* dtype,
                                     uint64_t* shape, size_t max_ndim, size_t* ndim);
/* Reads elements [begin, begin + count) of `tensor` into `out` (`bytes` exactly count
 * elements), from whichever ranks' pieces hold them. NOT_FOUND when a part of the range was
 * not saved; DATA_LOSS naming the file, chunk and offset of a chunk that fails its checksum. */
CKPT_C_EXPORT int ckpt_reader_read(const ckpt_reader* reader, const char* tensor, uint64_t begin,
                                   uint64_t count, void* out, size_t bytes);
/* ckpt_reader_read of `n` ranges in one pipeline: every range's reads overlap, and a chunk
 * serving several ranges is read and checksummed once. The first failure's code; what the
 * outputs hold after a failure is unspecified. */
CKPT_C_EXPORT int ckpt_reader_read_many(const ckpt_reader* reader, size_t n,
                                        const char* const* tensors, const uint64_t* begins,
                                        const uint64_t* counts, void* const* outs,
                                        const size_t* bytes);
/* Blob `name` of rank `rank`: *len is its size, and its bytes are copied to `out` (call with
 * out NULL or capacity 0 to learn the size only; OUT_OF_RANGE, copying nothing, when
 * `capacity` is smaller than the blob). NOT_FOUND when absent. */
CKPT_C_EXPORT int ckpt_reader_blob(const ckpt_reader* reader, const char* name, uint32_t rank,
                                   void* out, size_t capacity, size_t* len);

#ifdef __cplusplus
}
#endif

#endif /* CKPT_CKPT_H_ */
