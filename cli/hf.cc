#include "cli/hf.h"

#include <iostream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "ckpt/checkpoint_store.h"
#include "ckpt/hf_checkpoint.h"
#include "cli/commands.h"
#include "cli/common.h"

namespace ckpt::cli {

absl::StatusOr<PathKind> DetectPathKind(const std::string& path) {
  Env* env = Env::Default();
  absl::StatusOr<std::string> real = env->RealPath(path);
  if (!real.ok()) return real.status();
  absl::StatusOr<bool> is_dir = env->IsDirectory(*real);
  if (!is_dir.ok()) return is_dir.status();
  PathKind kind;
  if (!*is_dir) {
    if (absl::EndsWith(path, ".safetensors")) {
      kind.hf = true;
      return kind;
    }
    // A safetensors file by its first bytes: an 8-byte little-endian length, then '{'.
    absl::StatusOr<std::unique_ptr<RandomAccessFile>> f =
        env->NewRandomAccessFile(path, FileOptions{});
    std::byte head[9] = {};
    if (f.ok() && (*f)->size() >= 9 && (*f)->Read(0, head).ok() && head[8] == std::byte{'{'}) {
      kind.hf = true;
      return kind;
    }
    return absl::InvalidArgumentError(
        absl::StrCat(path,
                     ": is a file, but neither a .safetensors file nor a directory; give "
                     "a ckpt root, a .safetensors file or an HF model directory"));
  }
  absl::StatusOr<std::vector<std::string>> names = env->GetChildren(*real);
  if (!names.ok()) return names.status();
  for (const std::string& name : *names) {
    if (name == kHfSingleFileName || name == kHfIndexFileName) kind.hf = true;
  }
  absl::StatusOr<bool> store = LooksLikeStore(env, *real);
  if (!store.ok()) return store.status();
  kind.ckpt = *store;
  if (!kind.hf) kind.ckpt = true;
  return kind;
}

absl::StatusOr<bool> TreatAsHf(const std::string& path, const char* command) {
  absl::StatusOr<PathKind> detected = DetectPathKind(path);
  if (!detected.ok()) return detected.status();
  const PathKind kind = *detected;
  if (kind.hf && kind.ckpt) {
    std::cerr << "ckpt-tool: " << command << ": note: " << Printable(path)
              << " holds both a ckpt store and an HF model; checking it as a ckpt root (give "
                 "the .safetensors file itself to check the model)\n";
  }
  return kind.hf && !kind.ckpt;
}

int InspectHf(const std::string& path, bool json) {
  absl::StatusOr<std::unique_ptr<HfCheckpointReader>> r = HfCheckpointReader::Open(path);
  if (!r.ok()) {
    std::cerr << "ckpt-tool: inspect: " << Printable(r.status().message()) << "\n";
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
  std::cout << Printable(path) << ": safetensors, " << (*r)->shard_metadata().size() << " file(s), "
            << (*r)->tensors().size() << " tensors, " << FormatBytes(total) << "\n";
  for (const auto& [shard, meta] : (*r)->shard_metadata()) {
    std::vector<std::string> kv;
    for (const auto& [k, v] : meta) kv.push_back(Printable(k) + "=" + Printable(v));
    std::cout << "  " << Printable(shard) << "  metadata {" << absl::StrJoin(kv, ", ") << "}\n";
  }
  for (const nlohmann::json& t : tensors) {
    std::vector<std::string> dims;
    for (const nlohmann::json& d : t["shape"]) dims.push_back(d.dump());
    std::cout << "  " << Printable(t["name"].get<std::string>()) << "  "
              << t["dtype"].get<std::string>() << "  [" << absl::StrJoin(dims, ", ") << "]  "
              << FormatBytes(t["bytes"].get<uint64_t>());
    if ((*r)->sharded()) std::cout << "  " << Printable(t["shard"].get<std::string>());
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
    std::cout << Printable(path) << ": valid (" << (*r)->tensors().size() << " tensors in "
              << (*r)->shard_metadata().size() << " file(s))\n";
  } else {
    std::cout << (code == kExitDamage ? "INVALID " : "") << Printable(r.status().message()) << "\n";
  }
  return code;
}

}  // namespace ckpt::cli
