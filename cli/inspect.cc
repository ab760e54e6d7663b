// ckpt-tool inspect: read-only view of a checkpoint root. Runs no recovery.
#include <algorithm>
#include <iostream>
#include <map>
#include <memory>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "ckpt/base/coding.h"
#include "ckpt/checkpoint_reader.h"
#include "ckpt/checkpoint_store.h"
#include "ckpt/env.h"
#include "ckpt/formats/optimizer_record.h"
#include "cli/command.h"
#include "cli/commands.h"
#include "cli/common.h"
#include "cli/hf.h"

namespace ckpt::cli {
namespace {

using nlohmann::json;

json StepDetails(const formats::Manifest& m) {
  json tensors = json::array();
  for (const formats::TensorInfo& t : m.tensors) {
    tensors.push_back({{"name", t.name},
                       {"dtype", std::string(formats::DTypeName(t.dtype))},
                       {"shape", t.shape},
                       {"bytes", t.numel() * formats::DTypeSize(t.dtype)}});
  }
  json pieces = json::array();
  for (const formats::PieceInfo& p : m.pieces) {
    pieces.push_back({{"tensor", m.tensors[p.tensor].name},
                      {"rank", p.rank},
                      {"begin", p.begin},
                      {"count", p.count},
                      {"file", m.files[p.file].name},
                      {"chunks", p.chunk_count}});
  }
  json files = json::array();
  uint64_t raw = 0, stored = 0, zstd_chunks = 0;
  for (const formats::DataFileInfo& f : m.files) {
    uint64_t file_raw = 0, file_stored = 0;
    for (const formats::ChunkInfo& c : f.chunks) {
      file_raw += c.raw_bytes;
      file_stored += c.stored_bytes;
      if (c.codec == formats::Codec::kZstd) ++zstd_chunks;
    }
    raw += file_raw;
    stored += file_stored;
    files.push_back({{"name", f.name},
                     {"rank", f.rank},
                     {"bytes", f.size_bytes},
                     {"chunks", f.chunks.size()},
                     {"raw_bytes", file_raw},
                     {"stored_bytes", file_stored}});
  }
  json blobs = json::array();
  for (const formats::BlobInfo& b : m.blobs) {
    blobs.push_back({{"name", b.name}, {"rank", b.rank}, {"bytes", b.size_bytes}});
  }
  return {{"step", m.step},
          {"world_size", m.world_size},
          {"tensors", tensors},
          {"pieces", pieces},
          {"files", files},
          {"blobs", blobs},
          {"compression",
           {{"raw_bytes", raw}, {"stored_bytes", stored}, {"zstd_chunks", zstd_chunks}}}};
}

// The optimizer record of a step saved by ckpt::optimizer::Checkpointer (the layout blob of
// rank 0), summarised: groups with hyper-parameters and steps, moment dtype, parameter and
// element counts, the DP size that wrote it. nullopt when the step has none; {"error": ...}
// when it cannot be read.
std::optional<json> OptimizerRecord(const CheckpointReader& reader) {
  bool present = false;
  for (const formats::BlobInfo& b : reader.manifest().blobs) {
    present |= b.name == formats::kOptimizerRecordBlob;
  }
  if (!present) return std::nullopt;
  absl::StatusOr<std::string> text = reader.ReadBlob(formats::kOptimizerRecordBlob, 0);
  if (!text.ok()) return json{{"error", std::string(text.status().message())}};
  absl::StatusOr<formats::OptimizerRecord> record = formats::ParseOptimizerRecord(
      *text, absl::StrCat("step ", reader.manifest().step));
  if (!record.ok()) return json{{"error", std::string(record.status().message())}};
  uint64_t elements = 0;
  for (const formats::OptimizerRecordParam& p : record->params) {
    uint64_t n = 1;
    for (uint64_t d : p.shape) n *= d;
    elements += n;
  }
  json groups = json::array();
  for (const formats::OptimizerRecordGroup& g : record->groups) {
    groups.push_back({{"lr", g.lr}, {"beta1", g.beta1}, {"beta2", g.beta2}, {"eps", g.eps},
                      {"weight_decay", g.weight_decay}, {"step", g.step}});
    if (g.amsgrad) groups.back()["amsgrad"] = true;
  }
  // Parameters whose own step count is not their group's (skipped in some steps).
  json behind = json::object();
  for (size_t i = 0; i < record->params.size(); ++i) {
    const uint64_t step = formats::ParamStep(*record, i);
    if (step != record->groups[record->params[i].group].step) {
      behind[record->params[i].name] = step;
    }
  }
  return json{{"kind", record->kind},
              {"moment_dtype", std::string(formats::DTypeName(record->moment_dtype))},
              {"world_size", record->world_size},
              {"params", record->params.size()},
              {"elements", elements},
              {"groups", groups},
              {"param_steps", behind}};
}

void PrintOptimizerRecord(const json& o) {
  if (o.contains("error")) {
    std::cout << "optimizer: " << Printable(o["error"].get<std::string>()) << "\n";
    return;
  }
  std::cout << "optimizer: " << Printable(o["kind"].get<std::string>()) << ", " << o["params"]
            << " parameters (" << o["elements"]
            << " elements), moments " << Printable(o["moment_dtype"].get<std::string>())
            << ", saved by " << o["world_size"] << " rank(s)\n";
  int i = 0;
  for (const json& g : o["groups"]) {
    std::cout << "  group " << i++ << "  step " << g.value("step", json()) << "  lr "
              << g.value("lr", json()) << "  betas (" << g.value("beta1", json()) << ", "
              << g.value("beta2", json()) << ")  eps " << g.value("eps", json())
              << "  weight_decay " << g.value("weight_decay", json()) << "\n";
  }
  const json behind = o.value("param_steps", json::object());
  if (!behind.empty()) {
    std::cout << "  " << behind.size() << " parameter(s) at a step count below their group's:";
    size_t shown = 0;
    for (const auto& [name, step] : behind.items()) {
      if (shown++ == 10) {
        std::cout << " ...";
        break;
      }
      std::cout << " " << Printable(name) << " (" << step << ")";
    }
    std::cout << "\n";
  }
}

void PrintHuman(const json& out) {
  std::cout << "root: " << Printable(out["root"].get<std::string>()) << "\n";
  std::cout << "LATEST: "
            << (out["latest"].is_null() ? std::string("(none)") : out["latest"].dump()) << "\n";
  if (out.contains("latest_problem")) {
    std::cout << "  WARNING: " << Printable(out["latest_problem"].get<std::string>()) << "\n";
  }
  std::cout << "steps:\n";
  for (const json& s : out["steps"]) {
    std::cout << "  " << s["dir"].get<std::string>() << "  "
              << Printable(s["state"].get<std::string>())
              << (s.value("latest", false) ? "  <- LATEST" : "") << "\n";
  }
  for (const json& g : out["garbage"])
    std::cout << "  " << Printable(g.get<std::string>())
              << "  uncommitted (removed at next Open)\n";
  if (!out["quarantine"].empty()) {
    std::cout << "quarantine/ (set aside by recovery; ckpt-tool gc --purge-quarantine deletes):\n";
    for (const json& q : out["quarantine"])
      std::cout << "  " << Printable(q.get<std::string>()) << "\n";
  }
  if (!out.contains("details")) return;
  const json& d = out["details"];
  std::cout << "\nstep " << d["step"] << " (world size " << d["world_size"] << ")\n";
  std::cout << "checked: MANIFEST checksum, data file headers and sizes; chunk checksums NOT "
               "checked (ckpt-tool verify reads and checks every chunk)\n";
  std::cout << "tensors:\n";
  for (const json& t : d["tensors"]) {
    std::vector<std::string> dims;
    for (const json& x : t["shape"]) dims.push_back(x.dump());
    std::cout << "  " << Printable(t["name"].get<std::string>()) << "  "
              << t["dtype"].get<std::string>() << "  [" << absl::StrJoin(dims, ", ") << "]  "
              << FormatBytes(t["bytes"].get<uint64_t>()) << "\n";
  }
  std::cout << "pieces:\n";
  for (const json& p : d["pieces"]) {
    std::cout << "  rank " << p["rank"] << "  " << Printable(p["tensor"].get<std::string>())
              << "  [" << p["begin"] << ", "
              << p["begin"].get<uint64_t>() + p["count"].get<uint64_t>() << ")  " << p["chunks"]
              << " chunks\n";
  }
  std::cout << "files:\n";
  for (const json& f : d["files"]) {
    std::cout << "  " << Printable(f["name"].get<std::string>()) << "  "
              << FormatBytes(f["bytes"].get<uint64_t>()) << "  " << f["chunks"] << " chunks\n";
  }
  const json& c = d["compression"];
  std::cout << "compression: " << c["zstd_chunks"] << " zstd chunks, "
            << FormatBytes(c["raw_bytes"].get<uint64_t>()) << " raw -> "
            << FormatBytes(c["stored_bytes"].get<uint64_t>()) << " stored\n";
  std::cout << "blobs:\n";
  for (const json& b : d["blobs"]) {
    std::cout << "  rank " << b["rank"] << "  " << Printable(b["name"].get<std::string>()) << "  "
              << FormatBytes(b["bytes"].get<uint64_t>()) << "\n";
  }
  if (d.contains("optimizer")) PrintOptimizerRecord(d["optimizer"]);
}

// Opens step directory `name` as the store's OpenStep would: only a real directory.
absl::StatusOr<std::unique_ptr<CheckpointReader>> OpenStepDir(Env* env, const std::string& root,
                                                              const std::string& name) {
  const std::string dir = JoinPath(root, name);
  absl::StatusOr<bool> is_dir = env->IsDirectory(dir);
  if (!is_dir.ok()) return is_dir.status();
  if (!*is_dir) {
    return absl::FailedPreconditionError(
        "not a directory (a symbolic link or a file), which ckpt never puts under a step's name");
  }
  StoreOptions options;
  options.env = env;
  return CheckpointReader::Open(dir, options);
}

}  // namespace

int RunInspect(const InspectArgs& args) {
  absl::StatusOr<bool> hf = TreatAsHf(args.root, "inspect");
  if (!hf.ok()) return ReportError("inspect", hf.status());
  if (*hf) return InspectHf(args.root, args.json);
  Env* env = Env::Default();
  absl::StatusOr<std::vector<uint64_t>> steps = ListStepDirs(env, args.root);
  if (!steps.ok()) return ReportError("inspect", steps.status());
  absl::StatusOr<std::vector<std::string>> uncommitted = ListUncommitted(env, args.root);
  if (!uncommitted.ok()) return ReportError("inspect", uncommitted.status());
  json out = {{"root", args.root},
              {"latest", nullptr},
              {"steps", json::array()},
              {"garbage", json::array()},
              {"quarantine", json::array()}};
  bool damage = false;
  std::optional<uint64_t> latest;
  absl::StatusOr<std::optional<uint64_t>> named = ReadLatest(env, args.root);
  if (!named.ok()) {
    out["latest_problem"] = std::string(named.status().message());
  } else if (named->has_value()) {
    latest = **named;
    out["latest"] = *latest;
  }
  std::map<uint64_t, std::unique_ptr<CheckpointReader>> readers;
  bool latest_found = false;
  for (const std::string& name : *uncommitted) out["garbage"].push_back(name);
  for (const uint64_t step : *steps) {
    const std::string name = StepDirectoryName(step);
    latest_found = latest_found || latest == step;
    absl::StatusOr<std::unique_ptr<CheckpointReader>> reader = OpenStepDir(env, args.root, name);
    json entry = {{"step", step}, {"dir", name}, {"latest", latest == step}};
    if (reader.ok()) {
      entry["state"] =
          latest.has_value() && step > *latest ? "unpublished (newer than LATEST)" : "committed";
      readers[step] = std::move(reader).value();
    } else {
      entry["state"] = absl::StrCat("damaged: ", reader.status().message());
      damage = true;
    }
    out["steps"].push_back(entry);
  }
  if (!out.contains("latest_problem")) {
    if (latest.has_value() && !latest_found) {
      out["latest_problem"] = absl::StrCat("LATEST names step ", *latest, ", which does not exist");
    } else if (!latest.has_value() && !out["steps"].empty()) {
      out["latest_problem"] = "LATEST is missing, while the root holds step directories";
    }
  }
  absl::StatusOr<std::vector<std::string>> quarantined =
      env->GetChildren(JoinPath(args.root, kQuarantineDirName));
  if (quarantined.ok()) {
    std::sort(quarantined->begin(), quarantined->end());
    for (const std::string& q : *quarantined) out["quarantine"].push_back(q);
  }
  std::optional<uint64_t> shown = args.step.has_value() ? args.step : latest;
  if (shown.has_value()) {
    auto it = readers.find(*shown);
    if (it == readers.end()) {
      if (args.step.has_value()) {
        return ReportError(
            "inspect", absl::NotFoundError(absl::StrCat(args.root, ": no readable step ", *shown)));
      }
    } else {
      out["details"] = StepDetails(it->second->manifest());
      // What inspect checked, so that an exit 0 is not read as "the data verifies".
      out["details"]["chunks_checked"] = false;
      if (std::optional<json> record = OptimizerRecord(*it->second)) {
        out["details"]["optimizer"] = *std::move(record);
      }
    }
  }
  if (args.json) {
    PrintJson(out);
  } else {
    PrintHuman(out);
  }
  return damage || out.contains("latest_problem") ? kExitDamage : kExitOk;
}

Command AddInspectCommand(CLI::App& app) {
  auto args = std::make_shared<InspectArgs>();
  CLI::App* cmd =
      app.add_subcommand("inspect",
                         "Show a ckpt root (steps, LATEST, tensors, pieces, files, chunks, blobs) "
                         "or an HF checkpoint (tensors, shards)");
  cmd->add_option("path", args->root, "ckpt root, .safetensors file or HF model directory")
      ->required();
  cmd->add_option("--step", args->step, "Show this step (default: the one LATEST names)")
      ->check(WholeNumber(0, UINT64_MAX));
  cmd->add_flag("--json", args->json, "Print one JSON object");
  return WhenParsed(cmd, [args] { return RunInspect(*args); });
}

}  // namespace ckpt::cli
