#include "ckpt/formats/optimizer_record.h"

#include <limits>
#include <map>
#include <set>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "ckpt/base/status_macros.h"
#include "formats/strict_json.h"

namespace ckpt::formats {
namespace {

using nlohmann::json;

constexpr int kMaxDepth = 8;

// A group's "algorithm" and, for Muon, its hyper-parameters; nullopt for AdamW's and (version
// 5) another rule's, whose name goes to `other`.
template <typename Bad>
absl::StatusOr<std::optional<OptimizerRecordMuon>> ParseMuon(const json& g, size_t index,
                                                             uint64_t version, std::string* other,
                                                             const Bad& bad) {
  const std::string at = absl::StrCat("group ", index);
  if (!g.contains("algorithm")) return std::nullopt;
  if (!g["algorithm"].is_string()) return bad(at + " has an algorithm that is not a string");
  const std::string algorithm = g["algorithm"].get<std::string>();
  if (algorithm == kAlgorithmAdamW) return std::nullopt;
  if (algorithm != kAlgorithmMuon && version >= 5 && !algorithm.empty()) {
    *other = algorithm;
    return std::nullopt;
  }
  if (algorithm != kAlgorithmMuon) {
    return bad(absl::StrCat(at, " has algorithm \"", algorithm, "\" (adamw or muon)"));
  }
  OptimizerRecordMuon m;
  if (!g.contains("momentum") || !g["momentum"].is_number()) return bad(at + " lacks momentum");
  m.momentum = g["momentum"].get<double>();
  if (!g.contains("nesterov") || !g["nesterov"].is_boolean()) return bad(at + " lacks nesterov");
  m.nesterov = g["nesterov"].get<bool>();
  const json* c = g.contains("ns_coefficients") ? &g["ns_coefficients"] : nullptr;
  if (c == nullptr || !c->is_array() || c->size() != 3 || !(*c)[0].is_number() ||
      !(*c)[1].is_number() || !(*c)[2].is_number()) {
    return bad(at + " lacks three ns_coefficients");
  }
  m.ns_a = (*c)[0].get<double>();
  m.ns_b = (*c)[1].get<double>();
  m.ns_c = (*c)[2].get<double>();
  if (!g.contains("ns_steps") || !g["ns_steps"].is_number_unsigned() ||
      g["ns_steps"].get<uint64_t>() > std::numeric_limits<uint32_t>::max()) {
    return bad(at + " lacks ns_steps");
  }
  m.ns_steps = g["ns_steps"].get<uint32_t>();
  if (!g.contains("adjust_lr") || !g["adjust_lr"].is_string() ||
      (g["adjust_lr"] != kMuonLrOriginal && g["adjust_lr"] != kMuonLrMatchRmsAdamW)) {
    return bad(absl::StrCat(at, " lacks adjust_lr (", kMuonLrOriginal, " or ",
                            kMuonLrMatchRmsAdamW, ")"));
  }
  m.adjust_lr = g["adjust_lr"].get<std::string>();
  return m;
}

// A group's "hyper_parameters" (version 5): name -> number.
template <typename Bad>
absl::StatusOr<std::map<std::string, double>> ParseHyper(const json& g, size_t index,
                                                         const Bad& bad) {
  std::map<std::string, double> out;
  if (!g.contains("hyper_parameters")) return out;
  const json& h = g["hyper_parameters"];
  if (!h.is_object()) {
    return bad(absl::StrCat("group ", index, " has hyper_parameters that are not an object"));
  }
  for (auto it = h.begin(); it != h.end(); ++it) {
    if (!it.value().is_number()) {
      return bad(absl::StrCat("group ", index, " has hyper-parameter \"", it.key(),
                              "\" that is not a number"));
    }
    out[it.key()] = it.value().get<double>();
  }
  return out;
}

}  // namespace

std::string EncodeOptimizerRecord(const OptimizerRecord& record) {
  json params = json::array(), groups = json::array();
  bool own_steps = false;
  for (const OptimizerRecordParam& p : record.params) {
    params.push_back({{"name", p.name},
                      {"shape", p.shape},
                      {"dtype", std::string(DTypeName(p.dtype))},
                      {"group", p.group}});
    if (p.step.has_value()) {
      params.back()["step"] = *p.step;
      own_steps = true;
    }
  }
  bool amsgrad = false, muon = false, rules = false;
  for (const OptimizerRecordGroup& g : record.groups) {
    muon |= g.muon.has_value();
    rules |= !g.algorithm.empty() || !g.hyper.empty();
  }
  for (const OptimizerRecordGroup& g : record.groups) {
    groups.push_back({{"lr", g.lr},
                      {"beta1", g.beta1},
                      {"beta2", g.beta2},
                      {"eps", g.eps},
                      {"weight_decay", g.weight_decay},
                      {"step", g.step}});
    if (g.amsgrad) {
      groups.back()["amsgrad"] = true;
      amsgrad = true;
    }
    if (muon || rules) {
      groups.back()["algorithm"] = !g.algorithm.empty() ? g.algorithm
                                   : g.muon.has_value() ? kAlgorithmMuon
                                                        : kAlgorithmAdamW;
    }
    if (!g.hyper.empty()) groups.back()["hyper_parameters"] = g.hyper;
    if (g.muon.has_value()) {
      const OptimizerRecordMuon& m = *g.muon;
      groups.back()["momentum"] = m.momentum;
      groups.back()["nesterov"] = m.nesterov;
      groups.back()["ns_coefficients"] = {m.ns_a, m.ns_b, m.ns_c};
      groups.back()["ns_steps"] = m.ns_steps;
      groups.back()["adjust_lr"] = m.adjust_lr;
    }
  }
  return json{{"format", kOptimizerRecordFormat},
              {"version", rules ? 5 : muon ? 4 : amsgrad ? 3 : own_steps ? 2 : 1},
              {"kind", record.kind},
              {"moment_dtype", std::string(DTypeName(record.moment_dtype))},
              {"world_size", record.world_size},
              {"params", params},
              {"groups", groups}}
      .dump();
}

absl::StatusOr<OptimizerRecord> ParseOptimizerRecord(absl::string_view text,
                                                     absl::string_view where) {
  auto bad = [&](absl::string_view why) {
    return absl::DataLossError(absl::StrCat(where, ": optimizer record ", why));
  };
  if (text.size() > kMaxOptimizerRecordBytes) {
    return bad(absl::StrCat("is ", text.size(), " bytes, more than ", kMaxOptimizerRecordBytes));
  }
  internal::StrictJson parsed = internal::ParseStrictJson(text, kMaxDepth);
  if (parsed.syntax_error) return bad("is not JSON");
  if (parsed.too_deep) return bad("nests too deep");
  if (!parsed.duplicate.empty()) return bad(absl::StrCat("repeats key \"", parsed.duplicate, "\""));
  const json& root = parsed.value;
  if (!root.is_object()) return bad("is not an object");
  if (!root.contains("format") || root["format"] != kOptimizerRecordFormat) {
    return bad(absl::StrCat("is not a \"", kOptimizerRecordFormat, "\" record"));
  }
  if (!root.contains("version") || !root["version"].is_number_unsigned()) {
    return bad("has no version");
  }
  if (root["version"].get<uint64_t>() > static_cast<uint64_t>(kOptimizerRecordVersion)) {
    return absl::UnimplementedError(
        absl::StrCat(where, ": optimizer record version ", root["version"].get<uint64_t>(),
                     " is newer than this build reads (", kOptimizerRecordVersion, ")"));
  }
  OptimizerRecord out;
  if (root.contains("kind")) {
    if (!root["kind"].is_string()) return bad("has a kind that is not a string");
    out.kind = root["kind"].get<std::string>();
  }
  auto dtype_of = [&](const json& v, absl::string_view field) -> absl::StatusOr<DType> {
    if (!v.is_string()) return bad(absl::StrCat("has a ", field, " that is not a dtype name"));
    absl::StatusOr<DType> d = ParseDType(v.get<std::string>());
    if (!d.ok()) return bad(absl::StrCat("has ", field, " \"", v.get<std::string>(), "\""));
    return *d;
  };
  if (!root.contains("moment_dtype")) return bad("has no moment_dtype");
  CKPT_ASSIGN_OR_RETURN(out.moment_dtype, dtype_of(root["moment_dtype"], "moment_dtype"));
  if (out.moment_dtype != DType::kF32 && out.moment_dtype != DType::kBF16) {
    return bad(absl::StrCat("has moment_dtype ", DTypeName(out.moment_dtype),
                            " (F32 or BF16 only)"));
  }
  if (!root.contains("world_size") || !root["world_size"].is_number_unsigned() ||
      root["world_size"].get<uint64_t>() == 0 ||
      root["world_size"].get<uint64_t>() > std::numeric_limits<uint32_t>::max()) {
    return bad("has no world_size from 1 to 2^32 - 1");
  }
  out.world_size = root["world_size"].get<uint32_t>();
  if (!root.contains("groups") || !root["groups"].is_array()) return bad("has no groups");
  for (const json& g : root["groups"]) {
    if (!g.is_object()) return bad(absl::StrCat("group ", out.groups.size(), " is not an object"));
    OptimizerRecordGroup group;
    for (auto [key, field] : {std::pair{"lr", &group.lr}, {"beta1", &group.beta1},
                              {"beta2", &group.beta2}, {"eps", &group.eps},
                              {"weight_decay", &group.weight_decay}}) {
      if (!g.contains(key) || !g[key].is_number()) {
        return bad(absl::StrCat("group ", out.groups.size(), " lacks ", key));
      }
      *field = g[key].get<double>();
    }
    if (!g.contains("step") || !g["step"].is_number_unsigned()) {
      return bad(absl::StrCat("group ", out.groups.size(), " lacks a step"));
    }
    group.step = g["step"].get<uint64_t>();
    if (g.contains("amsgrad")) {
      if (!g["amsgrad"].is_boolean()) {
        return bad(absl::StrCat("group ", out.groups.size(), " has an amsgrad that is not a bool"));
      }
      group.amsgrad = g["amsgrad"].get<bool>();
    }
    const uint64_t version = root["version"].get<uint64_t>();
    CKPT_ASSIGN_OR_RETURN(group.muon,
                          ParseMuon(g, out.groups.size(), version, &group.algorithm, bad));
    if (version >= 5) {
      CKPT_ASSIGN_OR_RETURN(group.hyper, ParseHyper(g, out.groups.size(), bad));
    }
    out.groups.push_back(group);
  }
  if (!root.contains("params") || !root["params"].is_array()) return bad("has no params");
  std::set<std::string> names;
  for (const json& p : root["params"]) {
    const std::string at = absl::StrCat("param ", out.params.size());
    if (!p.is_object() || !p.contains("name") || !p["name"].is_string()) {
      return bad(absl::StrCat(at, " has no name"));
    }
    OptimizerRecordParam param;
    param.name = p["name"].get<std::string>();
    if (!names.insert(param.name).second) {
      return bad(absl::StrCat("names parameter \"", param.name, "\" twice"));
    }
    const std::string named = absl::StrCat("parameter \"", param.name, "\"");
    if (!p.contains("shape") || !p["shape"].is_array()) return bad(named + " has no shape");
    for (const json& d : p["shape"]) {
      if (!d.is_number_unsigned()) return bad(named + " has a shape of non-integers");
      param.shape.push_back(d.get<uint64_t>());
    }
    if (!p.contains("dtype")) return bad(named + " has no dtype");
    CKPT_ASSIGN_OR_RETURN(param.dtype, dtype_of(p["dtype"], named + " dtype"));
    if (!p.contains("group") || !p["group"].is_number_unsigned() ||
        p["group"].get<uint64_t>() >= out.groups.size()) {
      return bad(absl::StrCat(named, " is in no group of the ", out.groups.size(),
                              " the record has"));
    }
    param.group = p["group"].get<uint32_t>();
    if (p.contains("step")) {
      if (!p["step"].is_number_unsigned()) return bad(named + " has a step that is not a count");
      param.step = p["step"].get<uint64_t>();
    }
    out.params.push_back(std::move(param));
  }
  return out;
}

uint64_t ParamStep(const OptimizerRecord& record, size_t i) {
  const OptimizerRecordParam& p = record.params[i];
  return p.step.has_value() ? *p.step : record.groups[p.group].step;
}

}  // namespace ckpt::formats
