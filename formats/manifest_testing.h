// What the manifest tests share: a small valid manifest, and JSON framed as a MANIFEST file.
#ifndef CKPT_FORMATS_MANIFEST_TESTING_H_
#define CKPT_FORMATS_MANIFEST_TESTING_H_

#include <string>

#include "absl/strings/string_view.h"
#include "ckpt/formats/manifest.h"
#include "formats/manifest_internal.h"

namespace ckpt::formats::testing {

// Two ranks; tensor "w" (F32 [10]) in two pieces and a BF16 scalar "b"; blob "s"; every chunk
// one block.
inline Manifest ValidManifest() {
  Manifest m;
  m.step = 7;
  m.world_size = 2;
  m.tensors = {{"w", DType::kF32, {10}}, {"b", DType::kBF16, {}}};
  DataFileInfo f{"rank-00000.data", 0, 4 * kBlockBytes, {}};
  f.chunks = {{kBlockBytes, 24, 24, Codec::kRaw, 1},
              {2 * kBlockBytes, 16, 16, Codec::kRaw, 2},
              {3 * kBlockBytes, 5, 5, Codec::kRaw, 3}};
  m.files = {
      f,
      DataFileInfo{
          "rank-00001.data", 1, kBlockBytes + kBlockBytes, {{kBlockBytes, 2, 2, Codec::kRaw, 4}}}};
  m.pieces = {{0, 0, 0, 6, 0, 0, 1, 6}, {0, 0, 6, 4, 0, 1, 1, 4}, {1, 1, 0, 1, 1, 0, 1, 1}};
  m.blobs = {{"s", 0, 0, 5, 2, 1}};
  return m;
}

// `json` with a valid MANIFEST header of format `version`, so that what lies past the checksum
// is what a parser judges.
inline std::string Frame(absl::string_view json, uint32_t version = kFormatVersion) {
  return internal::FrameManifestJson(json, ManifestKind::kManifest, version);
}

}  // namespace ckpt::formats::testing

#endif  // CKPT_FORMATS_MANIFEST_TESTING_H_
