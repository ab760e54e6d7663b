// ckpt-tool diff A B: compares the tensors of two checkpoints, each a ckpt root (a committed step:
// LATEST, or --step / --step-b) or a HuggingFace path (.safetensors file or model directory).
// Tensors of both sides are read in batches of kBatchElems (bounded memory whatever the size),
// the two sides of a batch at once; floating tensors (F32, BF16, F16, in any pair) compare as
// FP32 values and F64 ones as F64 values (equal when a == b, or both NaN; within --atol when
// |a - b| <= atol), others byte for byte (sub-byte dtypes as the whole tensor's bytes). Exit 0 when every tensor is on both
// sides and equal (within --atol), 1 when anything differs, 2 for usage errors and unreadable
// input.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "ckpt/base/status_macros.h"
#include "ckpt/checkpoint_store.h"
#include "ckpt/formats/convert.h"
#include "ckpt/formats/safetensors.h"
#include "ckpt/hf_checkpoint.h"
#include "ckpt/tensor_source.h"
#include "cli/command.h"
#include "cli/commands.h"
#include "cli/common.h"
#include "cli/hf.h"

namespace ckpt::cli {
namespace {

constexpr uint64_t kBatchElems = uint64_t{1} << 22;  // 16 MiB of FP32 per side.

absl::StatusOr<std::unique_ptr<TensorSource>> OpenSource(const std::string& path,
                                                   std::optional<uint64_t> step,
                                                   const char* step_flag) {
  CKPT_ASSIGN_OR_RETURN(bool hf, TreatAsHf(path, "diff"));
  if (hf) {
    if (step.has_value()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, " is a HuggingFace checkpoint: it has no steps (", step_flag, ")"));
    }
    return TensorSource::OpenHf(path, Env::Default());
  }
  return TensorSource::OpenRoot(path, step, StoreOptions{});
}

// How one tensor present on both sides compares.
struct TensorDiff {
  std::string name;
  std::string status;  // "equal", "differs", "shape", "dtype".
  std::string detail;  // For shape and dtype mismatches.
  std::string dtype_a, dtype_b;
  bool by_value = true;  // Floating values (and --atol); false: byte for byte.
  bool whole_bytes = false;  // Sub-byte dtype: differing and numel count bytes.
  double max_abs = 0, max_rel = 0;
  uint64_t differing = 0, numel = 0;  // Elements (bytes for sub-byte dtypes) that differ.
};

// Runs read_a here and read_b on a second thread (Env::StartThread): the two sides of a batch
// decode (zstd, BF16 widening) on two cores at once.
absl::Status ReadBoth(const std::function<absl::Status()>& read_a,
                      const std::function<absl::Status()>& read_b) {
  absl::Status b;
  std::unique_ptr<EnvThread> other = Env::Default()->StartThread([&] { b = read_b(); });
  absl::Status a = read_a();
  other->Join();
  CKPT_RETURN_IF_ERROR(a);
  return b;
}

// Folds one pair of values into `d`: equal when a == b or both NaN, else within `atol`.
void CompareValues(double x, double y, double atol, TensorDiff& d) {
  if (x == y || (std::isnan(x) && std::isnan(y))) return;
  const double diff = std::fabs(x - y);
  // NaN against a number, or infinities, differ without bound.
  const double abs_diff = std::isnan(diff) || std::isinf(diff) ? INFINITY : diff;
  const double scale = std::max(std::fabs(x), std::fabs(y));
  d.max_abs = std::max(d.max_abs, abs_diff);
  d.max_rel = std::max(d.max_rel, std::isinf(abs_diff) || !(scale > 0) ? INFINITY
                                                                         : abs_diff / scale);
  if (!(abs_diff <= atol)) ++d.differing;
}

absl::StatusOr<TensorDiff> Compare(const TensorSource& a, const TensorSource& b, const std::string& name,
                                   double atol) {
  const SourceTensor& ta = a.tensors().at(name);
  const SourceTensor& tb = b.tensors().at(name);
  TensorDiff d;
  d.name = name;
  d.numel = ta.numel;
  d.dtype_a = ta.dtype_name;
  d.dtype_b = tb.dtype_name;
  if (ta.shape != tb.shape) {
    d.status = "shape";
    d.detail = absl::StrCat("[", absl::StrJoin(ta.shape, ", "), "] vs [",
                            absl::StrJoin(tb.shape, ", "), "]");
    return d;
  }
  if (ta.floating() && tb.floating()) {
    // As FP32 values, whatever the two dtypes (a BF16 export against its FP32 source).
    std::vector<float> xa, xb;
    for (uint64_t at = 0; at < ta.numel; at += kBatchElems) {
      const uint64_t n = std::min(kBatchElems, ta.numel - at);
      xa.resize(n);
      xb.resize(n);
      const TensorSource::F32Request ra{name, at, n, xa}, rb{name, at, n, xb};
      CKPT_RETURN_IF_ERROR(ReadBoth([&] { return a.ReadF32({&ra, 1}); },
                                    [&] { return b.ReadF32({&rb, 1}); }));
      // Identical bits fold to nothing (equal values, or the same NaN): one memcmp for the
      // common case of equal batches.
      if (std::memcmp(xa.data(), xb.data(), n * sizeof(float)) == 0) continue;
      for (uint64_t i = 0; i < n; ++i) CompareValues(xa[i], xb[i], atol, d);
    }
    d.status = d.differing == 0 ? "equal" : "differs";
    return d;
  }
  if (ta.dtype_name != tb.dtype_name) {
    d.status = "dtype";
    d.detail = absl::StrCat(ta.dtype_name, " vs ", tb.dtype_name);
    return d;
  }
  if (ta.element_bytes == 0) {
    // Sub-byte dtypes (F4, F6): the whole tensor's bytes, compared byte for byte.
    d.by_value = false;
    d.whole_bytes = true;
    std::vector<std::byte> ba(ta.byte_size), bb(tb.byte_size);
    CKPT_RETURN_IF_ERROR(a.ReadBytes(name, 0, ta.numel, ba));
    CKPT_RETURN_IF_ERROR(b.ReadBytes(name, 0, tb.numel, bb));
    d.numel = ba.size();
    for (size_t i = 0; i < ba.size(); ++i) d.differing += ba[i] != bb[i];
    d.status = d.differing == 0 ? "equal" : "differs";
    return d;
  }
  // Same dtype: F64 as values (with --atol), every other dtype byte for byte.
  const bool f64 = ta.dtype_name == "F64";
  d.by_value = f64;
  const uint64_t esize = ta.element_bytes;
  const uint64_t batch = std::max<uint64_t>(1, (kBatchElems * 4) / esize);
  std::vector<std::byte> ba, bb;
  for (uint64_t at = 0; at < ta.numel; at += batch) {
    const uint64_t n = std::min(batch, ta.numel - at);
    ba.resize(n * esize);
    bb.resize(n * esize);
    CKPT_RETURN_IF_ERROR(ReadBoth([&] { return a.ReadBytes(name, at, n, ba); },
                                  [&] { return b.ReadBytes(name, at, n, bb); }));
    for (uint64_t i = 0; i < n; ++i) {
      if (f64) {
        double x, y;
        std::memcpy(&x, ba.data() + i * 8, 8);
        std::memcpy(&y, bb.data() + i * 8, 8);
        CompareValues(x, y, atol, d);
      } else if (std::memcmp(ba.data() + i * esize, bb.data() + i * esize, esize) != 0) {
        ++d.differing;
      }
    }
  }
  d.status = d.differing == 0 ? "equal" : "differs";
  return d;
}

// JSON has no infinity: a difference without bound is written as the string "inf".
nlohmann::json JsonNumber(double v) {
  return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json("inf");
}

// One tensor's entry of the JSON report.
nlohmann::json TensorJson(const TensorDiff& d) {
  nlohmann::json t = {{"name", d.name},       {"status", d.status}, {"numel", d.numel},
                      {"dtype_a", d.dtype_a}, {"dtype_b", d.dtype_b}};
  if (d.status == "differs" || d.status == "equal") {
    t["compared"] = d.by_value ? "values" : "bytes";
    t["differing"] = d.differing;
    if (d.by_value) {
      t["max_abs"] = JsonNumber(d.max_abs);
      t["max_rel"] = JsonNumber(d.max_rel);
    }
  } else {
    t["detail"] = d.detail;
  }
  return t;
}

// One tensor's line of the human report; none for exactly equal tensors of one dtype (they are
// only counted).
void PrintTensorLine(const TensorDiff& d) {
  if (d.status == "equal" && d.max_abs == 0 && d.dtype_a == d.dtype_b) return;
  std::cout << "  " << Printable(d.name) << ": ";
  if (d.status == "shape" || d.status == "dtype") {
    std::cout << d.status << " " << d.detail << "\n";
    return;
  }
  const std::string dtypes =
      d.dtype_a == d.dtype_b ? std::string() : absl::StrCat(" (", d.dtype_a, " vs ", d.dtype_b,
                                                           ", compared as FP32 values)");
  if (d.by_value) {
    std::cout << absl::StrFormat(
        "%s%s, %llu of %llu elements beyond atol, max abs %.6g, max rel %.6g\n", d.status,
        dtypes, static_cast<unsigned long long>(d.differing),
        static_cast<unsigned long long>(d.numel), d.max_abs, d.max_rel);
  } else {
    std::cout << absl::StrFormat("%s, %llu of %llu %s differ (%s, compared byte for byte)\n",
                                 d.status, static_cast<unsigned long long>(d.differing),
                                 static_cast<unsigned long long>(d.numel),
                                 d.whole_bytes ? "bytes" : "elements", d.dtype_a);
  }
}

}  // namespace

int RunDiff(const DiffArgs& args) {
  if (!(args.atol >= 0) || !std::isfinite(args.atol)) {
    return ReportError("diff", absl::InvalidArgumentError("--atol must be a finite number >= 0"));
  }
  absl::StatusOr<std::unique_ptr<TensorSource>> a = OpenSource(args.a, args.step, "--step");
  if (!a.ok()) return ReportError(absl::StrCat("diff ", Printable(args.a)), a.status());
  absl::StatusOr<std::unique_ptr<TensorSource>> b = OpenSource(args.b, args.step_b, "--step-b");
  if (!b.ok()) return ReportError(absl::StrCat("diff ", Printable(args.b)), b.status());
  std::vector<std::string> only_a, only_b, both;
  for (const auto& [name, t] : (*a)->tensors()) {
    ((*b)->tensors().count(name) ? both : only_a).push_back(name);
  }
  for (const auto& [name, t] : (*b)->tensors()) {
    if (!(*a)->tensors().count(name)) only_b.push_back(name);
  }
  std::vector<TensorDiff> diffs;
  ProgressBar bar("diff", both.size(), !args.json && StderrIsTerminal());
  for (size_t i = 0; i < both.size(); ++i) {
    absl::StatusOr<TensorDiff> d = Compare(**a, **b, both[i], args.atol);
    if (!d.ok()) return ReportError("diff", d.status());
    diffs.push_back(*std::move(d));
    bar.Update(i + 1);
  }
  bar.Finish();
  size_t unequal = 0;
  for (const TensorDiff& d : diffs) unequal += d.status != "equal";
  const bool same = unequal == 0 && only_a.empty() && only_b.empty();
  if (args.json) {
    nlohmann::json tensors = nlohmann::json::array();
    for (const TensorDiff& d : diffs) tensors.push_back(TensorJson(d));
    PrintJson({{"a", (*a)->Describe()},
               {"b", (*b)->Describe()},
               {"atol", args.atol},
               {"equal", same},
               {"tensors", tensors},
               {"only_in_a", only_a},
               {"only_in_b", only_b}});
    return same ? kExitOk : kExitDamage;
  }
  std::cout << "A: " << Printable((*a)->Describe()) << "\nB: " << Printable((*b)->Describe())
            << "\n";
  for (const TensorDiff& d : diffs) PrintTensorLine(d);
  for (const auto& [label, names] : {std::pair{"only in A", &only_a}, {"only in B", &only_b}}) {
    if (names->empty()) continue;
    std::vector<std::string> shown;
    for (size_t i = 0; i < names->size() && i < 10; ++i) shown.push_back(Printable((*names)[i]));
    std::cout << "  " << label << " (" << names->size() << "): " << absl::StrJoin(shown, ", ")
              << (names->size() > 10 ? ", ..." : "") << "\n";
  }
  std::cout << absl::StrFormat(
      "%s: %zu tensor(s) on both sides, %zu equal%s, %zu differ; %zu only in A, %zu only in B\n",
      same ? "EQUAL" : "DIFFERENT", diffs.size(), diffs.size() - unequal,
      args.atol > 0 ? absl::StrFormat(" within atol %g", args.atol) : std::string(), unequal,
      only_a.size(), only_b.size());
  return same ? kExitOk : kExitDamage;
}

Command AddDiffCommand(CLI::App& app) {
  struct Parsed {
    DiffArgs args;
    uint64_t step = 0, step_b = 0;  // Into args.step and args.step_b when given.
  };
  auto parsed = std::make_shared<Parsed>();
  CLI::App* cmd = app.add_subcommand(
      "diff",
      "Compare the tensors of two checkpoints (ckpt roots or HF paths): exit 0 equal, 1 differ");
  cmd->add_option("a", parsed->args.a, "ckpt root, .safetensors file or HF model directory")
      ->required();
  cmd->add_option("b", parsed->args.b, "ckpt root, .safetensors file or HF model directory")
      ->required();
  CLI::Option* step_opt = cmd->add_option("--step", parsed->step, "Step of A (default LATEST)")
                              ->check(WholeNumber(0, UINT64_MAX));
  CLI::Option* step_b_opt =
      cmd->add_option("--step-b", parsed->step_b, "Step of B (default LATEST)")
          ->check(WholeNumber(0, UINT64_MAX));
  cmd->add_option("--atol", parsed->args.atol,
                  "Floating values within this absolute difference count as equal");
  cmd->add_flag("--json", parsed->args.json, "Print one JSON object");
  return WhenParsed(cmd, [parsed, step_opt, step_b_opt] {
    if (step_opt->count() > 0) parsed->args.step = parsed->step;
    if (step_b_opt->count() > 0) parsed->args.step_b = parsed->step_b;
    return RunDiff(parsed->args);
  });
}

}  // namespace ckpt::cli
