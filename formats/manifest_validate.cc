// Manifest validation (every rule names the offending object): names are valid and unique;
// dtypes are known; element and byte counts do not overflow; each rank has at most one file;
// chunks tile their file from byte 4096 to its end without gaps, and each belongs to one piece or
// blob; pieces lie inside their tensor, do not overlap, and their chunks hold exactly their
// bytes. ParseManifest (formats/manifest.cc) runs it on everything it parses.
#include <algorithm>
#include <map>
#include <set>
#include <tuple>

#include "absl/container/flat_hash_set.h"
#include "absl/functional/function_ref.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "ckpt/base/coding.h"
#include "ckpt/base/status_macros.h"
#include "ckpt/formats/manifest.h"
#include "formats/manifest_internal.h"

namespace ckpt::formats {
namespace {

using internal::kMaxTensorBytes;
using internal::Invalid;
using internal::kMaxRank;
using internal::kMaxWorldSize;

// Well-formed UTF-8 (RFC 3629): no stray continuation bytes, no overlong forms, no surrogates,
// nothing above U+10FFFF, no sequence cut short; what a JSON parser accepts in a string.
bool IsValidUtf8(absl::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const auto* end = p + s.size();
  while (p < end) {
    const unsigned char c = *p;
    if (c < 0x80) {
      ++p;
      continue;
    }
    int n;
    unsigned char lo = 0x80, hi = 0xbf;  // The second byte's range.
    if (c >= 0xc2 && c <= 0xdf) {
      n = 1;
    } else if (c >= 0xe0 && c <= 0xef) {
      n = 2;
      if (c == 0xe0) lo = 0xa0;
      if (c == 0xed) hi = 0x9f;
    } else if (c >= 0xf0 && c <= 0xf4) {
      n = 3;
      if (c == 0xf0) lo = 0x90;
      if (c == 0xf4) hi = 0x8f;
    } else {
      return false;
    }
    if (end - p <= n) return false;
    if (p[1] < lo || p[1] > hi) return false;
    for (int i = 2; i <= n; ++i) {
      if (p[i] < 0x80 || p[i] > 0xbf) return false;
    }
    p += n + 1;
  }
  return true;
}

absl::Status ValidateTensors(const Manifest& m, absl::string_view file) {
  absl::flat_hash_set<absl::string_view> names;
  names.reserve(m.tensors.size());
  for (size_t i = 0; i < m.tensors.size(); ++i) {
    const TensorInfo& t = m.tensors[i];
    if (!IsValidName(t.name)) {
      return Invalid(file, absl::StrCat("tensors[", i, "] has an invalid name"));
    }
    if (!names.insert(t.name).second) {
      return Invalid(file, absl::StrCat("tensor \"", t.name, "\" appears twice"));
    }
    if (t.shape.size() > kMaxRank) {
      return Invalid(file, absl::StrCat("tensor \"", t.name, "\" has ", t.shape.size(),
                                        " dimensions, more than ", kMaxRank));
    }
    uint64_t numel = 1;
    for (uint64_t d : t.shape) {
      if (d != 0 && numel > kMaxTensorBytes / d) {
        return Invalid(file, absl::StrCat("tensor \"", t.name, "\" has an absurd shape"));
      }
      numel *= d;
    }
    if (numel > kMaxTensorBytes / DTypeSize(t.dtype)) {
      return Invalid(file, absl::StrCat("tensor \"", t.name, "\" has an absurd byte size"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateFiles(const Manifest& m, absl::string_view file) {
  std::set<absl::string_view> names;
  std::set<uint32_t> ranks;
  for (const DataFileInfo& f : m.files) {
    if (!IsValidName(f.name)) return Invalid(file, "a data file has an invalid name");
    if (!names.insert(f.name).second || !ranks.insert(f.rank).second) {
      return Invalid(file,
                     absl::StrCat("data file ", f.name, " or its rank ", f.rank, " appears twice"));
    }
    if (f.rank >= m.world_size) {
      return Invalid(file, absl::StrCat("data file ", f.name, " has rank ", f.rank,
                                        " outside world size ", m.world_size));
    }
    uint64_t next = kDataFileHeaderBytes;
    for (size_t c = 0; c < f.chunks.size(); ++c) {
      const ChunkInfo& ch = f.chunks[c];
      // Named only on failure: a file of 60,000 chunks is checked with no string built.
      auto where = [&] { return absl::StrCat("chunk ", c, " of ", f.name, " at offset ", ch.offset); };
      if (ch.offset != next) {
        return Invalid(
            file, absl::StrCat(where(), " does not start where its predecessor ends (", next, ")"));
      }
      if (ch.stored_bytes > kMaxChunkBytes || ch.raw_bytes > kMaxChunkBytes ||
          (ch.codec == Codec::kRaw && ch.stored_bytes != ch.raw_bytes)) {
        return Invalid(file, absl::StrCat(where(), " has absurd sizes"));
      }
      uint64_t extent = ChunkExtentBytes(ch.stored_bytes);
      if (ch.offset > f.size_bytes || extent > f.size_bytes - ch.offset) {
        return Invalid(file,
                       absl::StrCat(where(), " extends past the file's ", f.size_bytes, " bytes"));
      }
      next = ch.offset + extent;
    }
    if (next != f.size_bytes) {
      return Invalid(file, absl::StrCat("data file ", f.name, " is ", f.size_bytes,
                                        " bytes but its chunks end at ", next));
    }
  }
  return absl::OkStatus();
}

// Marks chunks [first, first + count) of `f` as used by `owner` (named only on failure); each
// chunk has one owner.
absl::Status ClaimChunks(const DataFileInfo& f, uint64_t first, uint64_t count,
                         std::vector<bool>* used, absl::FunctionRef<std::string()> owner,
                         absl::string_view file) {
  if (first > f.chunks.size() || count > f.chunks.size() - first) {
    return Invalid(file, absl::StrCat(owner(), " names chunks outside ", f.name));
  }
  for (uint64_t c = first; c < first + count; ++c) {
    if ((*used)[c]) return Invalid(file, absl::StrCat(owner(), " shares chunk ", c, " of ", f.name));
    (*used)[c] = true;
  }
  return absl::OkStatus();
}

absl::Status ValidatePieces(const Manifest& m, absl::string_view file,
                            std::vector<std::vector<bool>>* used) {
  struct Range {
    uint32_t tensor;
    uint64_t begin, end;
    bool operator<(const Range& o) const {
      return std::tie(tensor, begin, end) < std::tie(o.tensor, o.begin, o.end);
    }
  };
  std::vector<Range> ranges;
  ranges.reserve(m.pieces.size());
  for (size_t i = 0; i < m.pieces.size(); ++i) {
    const PieceInfo& p = m.pieces[i];
    if (p.tensor >= m.tensors.size()) {
      return Invalid(file, absl::StrCat("pieces[", i, "] names no tensor"));
    }
    const TensorInfo& t = m.tensors[p.tensor];
    auto owner = [&] { return absl::StrCat("pieces[", i, "] of tensor \"", t.name, "\""); };
    uint64_t numel = t.numel();
    if (p.count == 0 || p.begin > numel || p.count > numel - p.begin) {
      return Invalid(file, absl::StrCat(owner(), " [", p.begin, ", +", p.count,
                                        ") lies outside its ", numel, " elements"));
    }
    if (p.file >= m.files.size() || m.files[p.file].rank != p.rank || p.rank >= m.world_size) {
      return Invalid(file, owner() + " names a file of another rank or none");
    }
    if (p.chunk_elems == 0 ||
        p.chunk_count != p.count / p.chunk_elems + (p.count % p.chunk_elems != 0 ? 1 : 0)) {
      return Invalid(file, owner() + " has an inconsistent chunk count");
    }
    const DataFileInfo& f = m.files[p.file];
    CKPT_RETURN_IF_ERROR(
        ClaimChunks(f, p.first_chunk, p.chunk_count, &(*used)[p.file], owner, file));
    const uint64_t esize = DTypeSize(t.dtype);
    for (uint64_t j = 0; j < p.chunk_count; ++j) {
      uint64_t elems = std::min(p.chunk_elems, p.count - j * p.chunk_elems);
      if (f.chunks[p.first_chunk + j].raw_bytes != elems * esize) {
        return Invalid(file, absl::StrCat(owner(), " chunk ", j, " holds the wrong byte count"));
      }
    }
    ranges.push_back({p.tensor, p.begin, p.begin + p.count});
  }
  // By tensor, then begin: the first overlap found is in the lowest tensor, at its lowest begin.
  std::sort(ranges.begin(), ranges.end());
  for (size_t k = 1; k < ranges.size(); ++k) {
    if (ranges[k].tensor == ranges[k - 1].tensor && ranges[k].begin < ranges[k - 1].end) {
      return Invalid(file, absl::StrCat("pieces of tensor \"", m.tensors[ranges[k].tensor].name,
                                        "\" overlap at element ", ranges[k].begin));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateBlobs(const Manifest& m, absl::string_view file,
                           std::vector<std::vector<bool>>* used) {
  absl::flat_hash_set<std::pair<uint32_t, absl::string_view>> names;
  for (const BlobInfo& b : m.blobs) {
    auto owner = [&] { return absl::StrCat("blob \"", b.name, "\" of rank ", b.rank); };
    if (!IsValidName(b.name)) return Invalid(file, "a blob has an invalid name");
    if (b.size_bytes > kMaxBlobBytes) {
      return Invalid(file, absl::StrCat(owner(), " declares ", b.size_bytes,
                                        " bytes, more than a blob may hold (", kMaxBlobBytes, ")"));
    }
    if (!names.insert({b.rank, b.name}).second) return Invalid(file, owner() + " appears twice");
    if (b.file >= m.files.size() || m.files[b.file].rank != b.rank) {
      return Invalid(file, owner() + " names a file of another rank or none");
    }
    const DataFileInfo& f = m.files[b.file];
    CKPT_RETURN_IF_ERROR(
        ClaimChunks(f, b.first_chunk, b.chunk_count, &(*used)[b.file], owner, file));
    uint64_t total = 0;
    for (uint64_t j = 0; j < b.chunk_count; ++j) total += f.chunks[b.first_chunk + j].raw_bytes;
    if (total != b.size_bytes) return Invalid(file, owner() + " chunks do not add up to its size");
  }
  return absl::OkStatus();
}

}  // namespace

bool IsValidName(absl::string_view name) {
  if (name.empty() || name.size() > 4096 || name == ".") return false;
  if (name.find('/') != absl::string_view::npos || name.find("..") != absl::string_view::npos) {
    return false;
  }
  for (char c : name) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f || c == '\\') return false;
  }
  return IsValidUtf8(name);
}

absl::Status ValidateManifest(const Manifest& m, absl::string_view file) {
  if (m.world_size == 0 || m.world_size > kMaxWorldSize) {
    return Invalid(file, absl::StrCat("world size ", m.world_size, " is out of range"));
  }
  CKPT_RETURN_IF_ERROR(ValidateTensors(m, file));
  CKPT_RETURN_IF_ERROR(ValidateFiles(m, file));
  std::vector<std::vector<bool>> used;
  for (const DataFileInfo& f : m.files) used.emplace_back(f.chunks.size(), false);
  CKPT_RETURN_IF_ERROR(ValidatePieces(m, file, &used));
  CKPT_RETURN_IF_ERROR(ValidateBlobs(m, file, &used));
  for (size_t f = 0; f < used.size(); ++f) {
    for (size_t c = 0; c < used[f].size(); ++c) {
      if (!used[f][c]) {
        return Invalid(file, absl::StrCat("chunk ", c, " of ", m.files[f].name,
                                          " belongs to no piece or blob"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace ckpt::formats
