// The optimizer record of a step (blob "optimizer.layout", docs/formats/optimizer-record.md):
// which parameters the optimizer state belongs to, their param groups with hyper-parameters
// and step counters, the optimizer's kind and its moments' dtype. Pure functions over bytes,
// reached by the fuzzer (formats/fuzz/optimizer_record_fuzz.cc).
#ifndef CKPT_FORMATS_OPTIMIZER_RECORD_H_
#define CKPT_FORMATS_OPTIMIZER_RECORD_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "ckpt/formats/dtype.h"

namespace ckpt::formats {

// The name of the blob a step keeps its optimizer record under (rank 0's; every rank writes one).
inline constexpr char kOptimizerRecordBlob[] = "optimizer.layout";
inline constexpr char kOptimizerRecordFormat[] = "ckpt-optimizer";
// Version 2 adds a parameter's own "step", written only when some parameter's step count
// differs from its group's (version 1 readers would otherwise misread those counts). Version 3
// adds a group's "amsgrad", written only when some group uses it (its steps hold
// optimizer.max_exp_avg_sq.* tensors older readers do not know). Version 4 adds a group's
// "algorithm" and Muon's hyper-parameters, written when some group is Muon's (its steps hold
// optimizer.momentum.* tensors and no second moments for Muon's parameters). Version 5 adds
// groups of other rules ("algorithm" naming one, such as "adafactor") and a group's own
// hyper-parameters by name ("hyper_parameters"), written when some group has either.
inline constexpr int kOptimizerRecordVersion = 5;
// The optimizer kinds a record may name; a record without "kind" (written before kinds were
// recorded) is AdamW's. "muon": some group is Muon's (the others AdamW's, each group saying
// which).
inline constexpr char kOptimizerKindAdamW[] = "adamw";
inline constexpr char kOptimizerKindMuon[] = "muon";
// A group's "algorithm" (version 4), and a Muon group's "adjust_lr".
inline constexpr char kAlgorithmAdamW[] = "adamw";
inline constexpr char kAlgorithmMuon[] = "muon";
inline constexpr char kMuonLrOriginal[] = "original";
inline constexpr char kMuonLrMatchRmsAdamW[] = "match_rms_adamw";
// Bounds a reader holds a record to (a record is read whole into memory).
inline constexpr uint64_t kMaxOptimizerRecordBytes = uint64_t{256} << 20;

struct OptimizerRecordParam {
  std::string name;
  std::vector<uint64_t> shape;
  DType dtype = DType::kF32;  // The model dtype.
  uint32_t group = 0;         // Index into OptimizerRecord::groups.
  // The parameter's own step count; unset: its group's (every parameter of a group stepped
  // together, and every record of version 1).
  std::optional<uint64_t> step;
  bool operator==(const OptimizerRecordParam&) const = default;
};

// A Muon group's own hyper-parameters (torch.optim.Muon's).
struct OptimizerRecordMuon {
  double momentum = 0;
  bool nesterov = false;
  double ns_a = 0, ns_b = 0, ns_c = 0;
  uint32_t ns_steps = 0;
  std::string adjust_lr = kMuonLrOriginal;  // kMuonLrOriginal or kMuonLrMatchRmsAdamW.
  bool operator==(const OptimizerRecordMuon&) const = default;
};

struct OptimizerRecordGroup {
  double lr = 0, beta1 = 0, beta2 = 0, eps = 0, weight_decay = 0;
  uint64_t step = 0;  // The largest step count of the group's parameters.
  bool amsgrad = false;
  std::optional<OptimizerRecordMuon> muon{};  // Set: a Muon group (version 4).
  // Version 5: the rule of a group that is neither AdamW's nor Muon's ("adafactor"; empty for
  // those two, which `muon` tells apart), and the hyper-parameters of its rule that the fields
  // above do not hold, by name. Which names and values a rule takes is the optimizer's to judge.
  std::string algorithm{};
  std::map<std::string, double> hyper{};
  bool operator==(const OptimizerRecordGroup&) const = default;
};

struct OptimizerRecord {
  std::string kind = kOptimizerKindAdamW;
  DType moment_dtype = DType::kF32;  // kF32 or kBF16.
  uint32_t world_size = 1;           // The ranks that saved the step.
  std::vector<OptimizerRecordParam> params;
  std::vector<OptimizerRecordGroup> groups;
  bool operator==(const OptimizerRecord&) const = default;
};

// JSON, one line: {"format":"ckpt-optimizer","version":1,"kind":...,"moment_dtype":...,
// "world_size":...,"params":[{"name","shape","dtype","group"}...],"groups":[{"lr","beta1",
// "beta2","eps","weight_decay","step"[,"amsgrad"][,"algorithm"[,"momentum","nesterov",
// "ns_coefficients","ns_steps","adjust_lr"]][,"hyper_parameters":{name:number...}]}...]};
// version 2 when some parameter has its own "step", 3 when some group has "amsgrad": true, 4
// when some group is Muon's (every group then says its "algorithm"), 5 when some group is of
// another rule or has "hyper_parameters" (every group then says its "algorithm").
// Doubles round-trip exactly.
std::string EncodeOptimizerRecord(const OptimizerRecord& record);

// Parameter `i`'s step count: its own, or its group's. REQUIRES: a parsed or valid record.
uint64_t ParamStep(const OptimizerRecord& record, size_t i);

// kDataLoss naming `where` and the field for anything malformed: not strict JSON (a repeated
// key), another format, a missing or mistyped field, a dtype ckpt does not know, a moment
// dtype other than F32 or BF16, world_size 0, a parameter named twice, or one in a group the
// record lacks; kUnimplemented for a newer version. Hyper-parameter ranges are the optimizer's
// to judge.
absl::StatusOr<OptimizerRecord> ParseOptimizerRecord(absl::string_view text,
                                                     absl::string_view where);

}  // namespace ckpt::formats

#endif  // CKPT_FORMATS_OPTIMIZER_RECORD_H_
