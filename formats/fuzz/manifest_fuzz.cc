// libFuzzer target for the MANIFEST and rank-part parsers: any input must yield a Status or a
// manifest that re-encodes and re-parses to itself, never a crash, hang or sanitizer report.
// Each input is parsed twice: as raw file bytes (header, checksum) and as the JSON body of a
// correctly framed manifest, so mutations reach the validation rules behind the checksum.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <string>

#include "ckpt/base/checksum.h"
#include "ckpt/base/coding.h"
#include "ckpt/formats/manifest.h"

namespace {

using ckpt::formats::ManifestKind;

std::string Frame(std::span<const std::byte> json) {
  std::string out = "CKPTMANI";
  ckpt::PutFixed32(&out, ckpt::formats::kFormatVersion);
  ckpt::PutFixed32(&out, 0);
  ckpt::PutFixed64(&out, json.size());
  ckpt::StreamingChecksum sum;
  sum.Update(ckpt::AsBytes(out));
  sum.Update(json);
  ckpt::PutFixed64(&out, sum.Digest());
  out.append(reinterpret_cast<const char*>(json.data()), json.size());
  return out;
}

void Check(std::span<const std::byte> bytes, ManifestKind kind) {
  absl::StatusOr<ckpt::formats::Manifest> m = ckpt::formats::ParseManifest(bytes, "fuzz", kind);
  if (!m.ok()) return;
  std::string again = ckpt::formats::EncodeManifest(*m, kind);
  absl::StatusOr<ckpt::formats::Manifest> reparsed =
      ckpt::formats::ParseManifest(ckpt::AsBytes(again), "fuzz", kind);
  if (!reparsed.ok() || ckpt::formats::EncodeManifest(*reparsed, kind) != again) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  Check(bytes, ManifestKind::kManifest);
  Check(bytes, ManifestKind::kRankPart);
  std::string framed = Frame(bytes);
  Check(ckpt::AsBytes(framed), ManifestKind::kManifest);
  return 0;
}
