// libFuzzer target for the optimizer record parser: every accepted record re-encodes to one
// that parses to the same record, and its parameters name only groups it has.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "absl/strings/string_view.h"
#include "ckpt/formats/optimizer_record.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view text(reinterpret_cast<const char*>(data), size);
  auto record = ckpt::formats::ParseOptimizerRecord(text, "fuzz");
  if (!record.ok()) return 0;
  for (const auto& p : record->params) {
    if (p.group >= record->groups.size()) std::abort();
  }
  const std::string again = ckpt::formats::EncodeOptimizerRecord(*record);
  auto reparsed = ckpt::formats::ParseOptimizerRecord(again, "fuzz");
  if (!reparsed.ok() || !(*reparsed == *record)) std::abort();
  return 0;
}
