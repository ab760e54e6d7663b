// The layout of optimizer state: parameters as named tensors, param groups with their own
// hyper-parameters, and the pieces (tensor, begin, count) of the flat index each data-parallel
// rank owns, as Megatron's distributed optimizer assigns contiguous ranges of padded buckets
// (DESIGN.md §2). One definition shared by the optimizer, the tests and resharding.
#ifndef CKPT_OPTIMIZER_LAYOUT_H_
#define CKPT_OPTIMIZER_LAYOUT_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "ckpt/formats/dtype.h"

namespace ckpt::optimizer {

struct ParamSpec {
  std::string name;
  std::vector<uint64_t> shape;                   // Global shape; {} is a scalar.
  formats::DType dtype = formats::DType::kBF16;  // Model dtype: kF32, kBF16 or kF16.
  uint32_t group = 0;                            // Index into the optimizer's param groups.
  uint64_t numel() const;
};

// The update rule of a param group (docs/design/muon.md).
enum class Algorithm : uint8_t {
  kAdamW,      // torch.optim.AdamW.
  kMuon,       // torch.optim.Muon: 2-D parameters only, each stepped whole.
  kAdafactor,  // torch.optim.Adafactor: each parameter stepped whole (docs/design/adafactor.md).
};
// The last Algorithm: they are numbered 0 to this, each with its rule (optimizer/rules/).
inline constexpr Algorithm kLastAlgorithm = Algorithm::kAdafactor;

// Muon's learning-rate adjustment by matrix shape (torch's adjust_lr_fn), for an A x B matrix:
// lr * sqrt(max(1, A / B)) ("original", torch's default) or lr * 0.2 * sqrt(max(A, B))
// ("match_rms_adamw").
enum class MuonLrAdjust : uint8_t { kOriginal, kMatchRmsAdamW };

// Muon's own hyper-parameters (torch.optim.Muon's defaults); lr, weight_decay and eps are the
// group's. The momentum buffer is buf.lerp_(grad, 1 - momentum), AdamW's exp_avg with
// beta1 = momentum, and lives where exp_avg does.
struct MuonParams {
  double momentum = 0.95;
  bool nesterov = true;
  double ns_a = 3.4445, ns_b = -4.7750, ns_c = 2.0315;  // Newton-Schulz coefficients.
  uint32_t ns_steps = 5;                                // Fewer than 100, as torch.
  MuonLrAdjust adjust_lr = MuonLrAdjust::kOriginal;
  friend bool operator==(const MuonParams&, const MuonParams&) = default;
};

// Hyper-parameters of one group, kept in double as torch keeps Python floats: each step's
// constants (1 - beta, bias corrections, lr * weight_decay) are derived from them in double and
// rounded to float once (with beta2 = 0.999 held as a float, 1 - beta2 would be off by 1.3e-5).
// AdamW's by default; `algorithm` kMuon steps the group with Muon (`muon`, and lr, eps and
// weight_decay; beta1, beta2 and amsgrad unused).
struct ParamGroup {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;
  uint64_t step = 0;  // Steps taken by this group (the bias-correction exponent is step + 1).
  // AMSGrad (torch's amsgrad=True): the denominator uses the running maximum of exp_avg_sq,
  // kept per element as max_exp_avg_sq (a fourth slab, which exists once any group of the
  // optimizer asks for it).
  bool amsgrad = false;
  Algorithm algorithm = Algorithm::kAdamW;
  MuonParams muon{};
  // The hyper-parameters of the group's rule that have no field above, by the names torch's
  // param_groups give them (Adafactor's "beta2_decay", "eps1", "eps2", "d", "maximize"); one the
  // group does not set takes the rule's default. A name the rule does not know is refused.
  std::map<std::string, double, std::less<>> hyper{};
};

// Elements [begin, begin + count) of params[param], in row-major flat order (count is 0 only
// for a parameter of no elements).
struct Piece {
  uint32_t param = 0;
  uint64_t begin = 0;
  uint64_t count = 0;
  friend bool operator==(const Piece&, const Piece&) = default;
};

struct BucketOptions {
  // A bucket closes once it holds at least this many elements (a parameter is never split
  // across buckets), as in Megatron's param-and-grad buffer.
  uint64_t bucket_elems = 40'000'000;
  // Each bucket is padded to a multiple of lcm(dp_size, pad_to) elements.
  uint64_t pad_to = 128;
  // Megatron fills buckets walking the parameters in reverse (backward) order.
  bool reverse_order = true;
};

struct Bucket {
  struct Entry {
    uint32_t param;
    uint64_t offset;  // Where the parameter starts in the bucket's flat buffer.
  };
  std::vector<Entry> entries;
  uint64_t elems = 0;         // Unpadded.
  uint64_t padded_elems = 0;  // A multiple of dp_size; rank r owns [r, r + 1) * padded / dp.
};

// kInvalidArgument for dp_size < 1 or bucket_elems == 0.
absl::StatusOr<std::vector<Bucket>> BuildBuckets(const std::vector<ParamSpec>& params,
                                                 const BucketOptions& options, int dp_size);

// The pieces each rank owns, rank by rank, in bucket order then flat order: rank r owns the
// r-th contiguous 1/dp of each padded bucket, intersected with the parameters in it (padding
// belongs to nobody). A rank's range may cut tensors; a rank may own nothing.
std::vector<std::vector<Piece>> RankPieces(const std::vector<Bucket>& buckets, int dp_size);

// The pieces of each rank when the parameters `whole` flags must each lie whole on one rank
// (Muon's matrices, docs/design/muon.md): the others are cut as RankPieces cuts them (their
// own buckets), then each whole parameter, the largest first, goes to the rank holding the
// fewest elements so far (the lowest such rank on a tie), after that rank's cut pieces. A rank
// may own nothing. kInvalidArgument as BuildBuckets, or for `whole` not one flag per parameter.
absl::StatusOr<std::vector<std::vector<Piece>>> RankPiecesKeepingWhole(
    const std::vector<ParamSpec>& params, const std::vector<bool>& whole,
    const BucketOptions& options, int dp_size);

}  // namespace ckpt::optimizer

#endif  // CKPT_OPTIMIZER_LAYOUT_H_
