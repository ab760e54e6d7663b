// libFuzzer target for the model.safetensors.index.json parser: every accepted index names only
// safe relative shard paths and re-encodes to an index that parses to the same map; checked
// against shards that hold exactly its map it passes, and against shards that miss a tensor or
// hold one twice it is refused as damage.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "ckpt/base/coding.h"
#include "ckpt/formats/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  auto index = ckpt::formats::ParseHfIndex(bytes, "fuzz");
  if (!index.ok()) return 0;
  for (const auto& [tensor, shard] : index->weight_map) {
    if (!ckpt::formats::IsSafeRelativePath(shard)) std::abort();
  }
  std::string again = ckpt::formats::EncodeHfIndex(*index);
  auto reparsed = ckpt::formats::ParseHfIndex(ckpt::AsBytes(again), "fuzz");
  if (!reparsed.ok() || reparsed->weight_map != index->weight_map) std::abort();
  std::vector<std::pair<std::string, std::string>> stored = index->weight_map;
  if (!ckpt::formats::CheckHfIndexAgainstShards(*index, stored, "fuzz").ok()) std::abort();
  if (!stored.empty()) {
    stored.push_back(stored.front());  // Stored twice.
    if (!absl::IsDataLoss(ckpt::formats::CheckHfIndexAgainstShards(*index, stored, "fuzz"))) {
      std::abort();
    }
    stored.pop_back();
    stored.pop_back();  // One stored nowhere.
    if (!absl::IsDataLoss(ckpt::formats::CheckHfIndexAgainstShards(*index, stored, "fuzz"))) {
      std::abort();
    }
  }
  return 0;
}
