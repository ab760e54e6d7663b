// What a manifest's parser (formats/manifest.cc) and validator (formats/manifest_validate.cc)
// share: the bounds a manifest is held to and the form of its errors. Private to formats.
#ifndef CKPT_FORMATS_MANIFEST_INTERNAL_H_
#define CKPT_FORMATS_MANIFEST_INTERNAL_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "ckpt/formats/manifest.h"

namespace ckpt::formats::internal {

inline constexpr uint64_t kMaxWorldSize = uint64_t{1} << 20;
// Dimensions of a tensor: the parser refuses more, so the writer must too.
inline constexpr uint64_t kMaxRank = 64;
inline constexpr uint64_t kMaxTensorBytes = uint64_t{1} << 50;

// Damage of manifest `file`: kDataLoss "<file>: <what>".
inline absl::Status Invalid(absl::string_view file, absl::string_view what) {
  return absl::DataLossError(absl::StrCat(file, ": ", what));
}

// The JSON of a manifest (past its header) as a Manifest, not yet validated: kDataLoss naming
// `file` and the field when it does not parse or a field has the wrong type
// (formats/manifest_json.cc).
absl::StatusOr<Manifest> ParseManifestJson(absl::string_view text, absl::string_view file);

// `json` behind a manifest header of `kind` and format `version`: magic, version, length and
// the checksum over both (EncodeManifest; tests frame hand-made JSON with it).
std::string FrameManifestJson(absl::string_view json, ManifestKind kind, uint32_t version);

}  // namespace ckpt::formats::internal

#endif  // CKPT_FORMATS_MANIFEST_INTERNAL_H_
