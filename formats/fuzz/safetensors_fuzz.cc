// libFuzzer target for the safetensors header parser. Each input is parsed as a whole file,
// and as a header (JSON) whose file is as long as the input's last 2 bytes say, so mutations
// reach the layout rules without having to forge a matching length prefix. An accepted header
// must describe tensors that tile the data section exactly.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>

#include "ckpt/formats/safetensors.h"

namespace {

void CheckAccepted(const ckpt::formats::SafetensorsHeader& h, uint64_t file_size) {
  uint64_t end = 0;
  for (const auto& t : h.tensors) {
    if (t.begin != end || t.end < t.begin) std::abort();
    end = t.end;
  }
  if (h.data_offset + end != file_size) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  auto whole = ckpt::formats::ParseSafetensors(bytes, "fuzz");
  if (whole.ok()) CheckAccepted(*whole, size);
  if (size >= 2) {
    const uint64_t data_bytes = data[size - 1] | (uint64_t{data[size - 2]} << 8);
    const uint64_t file_size = 8 + (size - 2) + data_bytes;
    auto header = ckpt::formats::ParseSafetensorsHeader(bytes.first(size - 2), file_size, "fuzz");
    if (header.ok()) CheckAccepted(*header, file_size);
  }
  return 0;
}
