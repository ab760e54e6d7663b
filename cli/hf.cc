#include "cli/hf.h"

#include <iostream>

#include "absl/strings/match.h"
#include "absl/strings/str_join.h"
#include "ckpt/hf_checkpoint.h"
#include "cli/commands.h"
#include "cli/common.h"

namespace ckpt::cli {

bool IsHfPath(const std::string& path) {
  Env* env = Env::Default();
  absl::StatusOr<bool> is_dir = env->IsDirectory(path);
  if (!is_dir.ok()) return absl::EndsWith(path, ".safetensors");
  if (!*is_dir) return true;  // A plain file can only be a safetensors file.
  return env->GetFileSize(JoinPath(path, kHfIndexFileName)).ok() ||
         env->GetFileSize(JoinPath(path, kHfSingleFileName)).ok();
}

int InspectHf(const std::string& path, bool json) {
  absl::StatusOr<std::unique_ptr<HfCheckpointReader>> r = HfCheckpointReader::Open(path);
  if (!r.ok()) {
    std::cerr << "ckpt-tool: inspect: " << r.status().message() << "\n";
    return absl::IsDataLoss(r.status()) ? kExitDamage : kExitUsage;
  }
  uint64_t total = 0;
  nlohmann::json tensors = nlohmann::json::array();
  for (const HfTensor& t : (*r)->tensors()) {
    total += t.byte_size;
    tensors.push_back({{"name", t.name},
                       {"dtype", std::string(formats::StDTypeName(t.dtype))},
                       {"shape", t.shape},
                       {"bytes", t.byte_size},
                       {"shard", t.shard}});
  }
  if (json) {
    nlohmann::json out = {{"path", path},
                          {"format", "safetensors"},
                          {"sharded", (*r)->sharded()},
                          {"shards", nlohmann::json::object()},
                          {"tensors", tensors},
                          {"total_bytes", total}};
    for (const auto& [shard, meta] : (*r)->shard_metadata())
      out["shards"][shard] = {{"metadata", meta}};
    if ((*r)->index().has_value() && (*r)->index()->total_size.has_value()) {
      out["index_total_size"] = *(*r)->index()->total_size;
    }
    PrintJson(out);
    return kExitOk;
  }
  std::cout << path << ": safetensors, " << (*r)->shard_metadata().size() << " file(s), "
            << (*r)->tensors().size() << " tensors, " << FormatBytes(total) << "\n";
  for (const auto& [shard, meta] : (*r)->shard_metadata()) {
    std::vector<std::string> kv;
    for (const auto& [k, v] : meta) kv.push_back(k + "=" + v);
    std::cout << "  " << shard << "  metadata {" << absl::StrJoin(kv, ", ") << "}\n";
  }
  for (const nlohmann::json& t : tensors) {
    std::vector<std::string> dims;
    for (const nlohmann::json& d : t["shape"]) dims.push_back(d.dump());
    std::cout << "  " << t["name"].get<std::string>() << "  " << t["dtype"].get<std::string>()
              << "  [" << absl::StrJoin(dims, ", ") << "]  "
              << FormatBytes(t["bytes"].get<uint64_t>());
    if ((*r)->sharded()) std::cout << "  " << t["shard"].get<std::string>();
    std::cout << "\n";
  }
  return kExitOk;
}

int VerifyHf(const std::string& path, bool json) {
  absl::StatusOr<std::unique_ptr<HfCheckpointReader>> r = HfCheckpointReader::Open(path);
  const bool valid = r.ok();
  const int code = valid ? kExitOk : absl::IsDataLoss(r.status()) ? kExitDamage : kExitUsage;
  if (json) {
    nlohmann::json out = {{"path", path}, {"format", "safetensors"}, {"ok", valid}};
    if (valid) {
      out["tensors"] = (*r)->tensors().size();
      out["files"] = (*r)->shard_metadata().size();
    } else {
      out["error"] = std::string(r.status().message());
    }
    PrintJson(out);
  } else if (valid) {
    std::cout << path << ": valid (" << (*r)->tensors().size() << " tensors in "
              << (*r)->shard_metadata().size() << " file(s))\n";
  } else {
    std::cout << (code == kExitDamage ? "INVALID " : "") << r.status().message() << "\n";
  }
  return code;
}

}  // namespace ckpt::cli
