// libFuzzer target over a whole checkpoint store directory (issue #14). Each input becomes a
// root on a fresh MemEnv (LATEST, step-NNNNNNNN/MANIFEST, step-NNNNNNNN/rank-00000.data) that is
// opened read-only, then as the primary (recovery: fallback, quarantine, LATEST repair), each
// followed by VerifyStore of every step and, when the Open succeeds, reads of the latest step.
// formats/fuzz covers the parsers; this reaches what sits on them: recovery's verdicts, the
// reader's offset arithmetic and chunk decoding, verify. Every status is an acceptable outcome;
// a crash, hang, leak, sanitizer report or allocation past -rss_limit_mb is a finding.
//
// Input (integers little-endian; a short input leaves the later parts empty):
//   flags:u8 latest_len:u8 latest manifest_len:u16 manifest data (the rest, at most 64 KiB)
//   flags bits 0-1  the step directory: step 1, 2, 7 or 12345678
//         bit 2     LATEST is `latest`'s first 24 bytes followed by their correct checksum
//         bit 3     `manifest` is the JSON body of a correctly framed MANIFEST (as manifest_fuzz)
//         bit 4     `data` is the chunks only: a valid data file header goes in front, naming
//                   the MANIFEST's step and world size (the directory's step if it does not parse)
//         bit 5     if the MANIFEST parses: rank-00000.data is cut or zero-padded to the size the
//                   MANIFEST records, and each of its chunks gets the checksum of its extent
//         bit 6     there is no LATEST
//         bit 7     a leftover staging directory holds the MANIFEST as rank 0's part
// Bits 2-5 let mutations reach the rules behind the checksums.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "ckpt/base/checksum.h"
#include "ckpt/base/coding.h"
#include "ckpt/checkpoint_store.h"
#include "ckpt/env.h"
#include "ckpt/formats/chunk.h"
#include "ckpt/formats/manifest.h"
#include "ckpt/verify.h"
#include "libckpt/filename.h"

namespace {

namespace formats = ckpt::formats;

constexpr char kRoot[] = "/store";
constexpr uint64_t kSteps[] = {1, 2, 7, 12345678};
constexpr size_t kMaxDataBytes = size_t{64} << 10;

// Takes the next `n` bytes of `in` (fewer at its end).
std::string Take(std::span<const uint8_t>* in, size_t n) {
  n = std::min(n, in->size());
  std::string out(reinterpret_cast<const char*>(in->data()), n);
  *in = in->subspan(n);
  return out;
}

// Takes a `width`-byte little-endian length (0 past the end of `in`).
size_t TakeLength(std::span<const uint8_t>* in, size_t width) {
  size_t n = 0;
  for (size_t i = 0; i < width && !in->empty(); ++i) {
    n |= size_t{in->front()} << (8 * i);
    *in = in->subspan(1);
  }
  return n;
}

std::string FrameManifest(const std::string& json) {
  std::string out = "CKPTMANI";
  ckpt::PutFixed32(&out, formats::kFormatVersion);
  ckpt::PutFixed32(&out, 0);
  ckpt::PutFixed64(&out, json.size());
  ckpt::StreamingChecksum sum;
  sum.Update(ckpt::AsBytes(out));
  sum.Update(ckpt::AsBytes(json));
  ckpt::PutFixed64(&out, sum.Digest());
  return out + json;
}

// Flag bits 4 and 5: makes the data file agree with the MANIFEST, and the MANIFEST's chunk
// checksums with the data file.
void FixUp(size_t flags, uint64_t dir_step, std::string* manifest, std::string* data) {
  absl::StatusOr<formats::Manifest> m = formats::ParseManifest(ckpt::AsBytes(*manifest), "fuzz");
  if (flags & 0x10) {
    const formats::DataFileHeader h{m.ok() ? m->step : dir_step, 0, m.ok() ? m->world_size : 1};
    *data = formats::EncodeDataFileHeader(h) + *data;
  }
  if (!(flags & 0x20) || !m.ok()) return;
  for (formats::DataFileInfo& f : m->files) {
    if (f.name != ckpt::internal::DataFileName(0) ||
        f.size_bytes > kMaxDataBytes + formats::kDataFileHeaderBytes) {
      continue;
    }
    data->resize(f.size_bytes, '\0');
    for (formats::ChunkInfo& c : f.chunks) {
      const uint64_t extent = formats::ChunkExtentBytes(c.stored_bytes);
      if (c.offset > data->size() || extent > data->size() - c.offset) continue;
      c.checksum = ckpt::Checksum(ckpt::AsBytes(*data).subspan(c.offset, extent));
    }
  }
  *manifest = formats::EncodeManifest(*m);
}

void Put(ckpt::Env* env, const std::string& path, const std::string& bytes) {
  // A fresh MemEnv refuses none of these: a failure is a bug of this harness.
  if (!ckpt::WriteFileAtomically(env, path, bytes).ok()) std::abort();
}

void OpenReadAndVerify(ckpt::Env* env, bool read_only) {
  const ckpt::StoreOptions options{
      .env = env, .read_only = read_only, .direct_io = false, .read_threads = 1};
  // Every status below is dropped on purpose: damage is the expected outcome, and only a crash,
  // hang or sanitizer report is a finding.
  absl::StatusOr<std::unique_ptr<ckpt::CheckpointStore>> store =
      ckpt::CheckpointStore::Open(kRoot, options);
  if (store.ok() && (*store)->latest_step().has_value()) {
    absl::StatusOr<std::unique_ptr<ckpt::CheckpointReader>> reader = (*store)->OpenLatest();
    if (reader.ok() && !(*reader)->manifest().tensors.empty()) {
      const formats::TensorInfo& t = (*reader)->manifest().tensors.front();
      const uint64_t count = std::min<uint64_t>(t.numel(), 1024);
      std::vector<std::byte> out(count * formats::DTypeSize(t.dtype));
      (*reader)->ReadRange(t.name, 0, count, out).IgnoreError();
    }
    if (reader.ok() && !(*reader)->manifest().blobs.empty()) {
      const formats::BlobInfo& b = (*reader)->manifest().blobs.front();
      (*reader)->ReadBlob(b.name, b.rank).status().IgnoreError();
    }
  }
  ckpt::VerifyStore(env, kRoot, std::nullopt, /*all=*/true).status().IgnoreError();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* bytes, size_t size) {
  std::span<const uint8_t> in(bytes, size);
  const size_t flags = TakeLength(&in, 1);
  std::string latest = Take(&in, TakeLength(&in, 1));
  std::string manifest = Take(&in, TakeLength(&in, 2));
  std::string data = Take(&in, kMaxDataBytes);

  const uint64_t step = kSteps[flags & 3];
  if (flags & 0x04) {
    latest.resize(formats::kLatestBytes - 8, '\0');
    ckpt::PutFixed64(&latest, ckpt::Checksum(ckpt::AsBytes(latest)));
  }
  if (flags & 0x08) manifest = FrameManifest(manifest);
  FixUp(flags, step, &manifest, &data);

  std::unique_ptr<ckpt::Env> env = ckpt::NewMemEnv();
  const std::string dir = ckpt::JoinPath(kRoot, ckpt::internal::StepDirName(step));
  if (!env->CreateDir(kRoot).ok() || !env->CreateDir(dir).ok()) std::abort();
  if (!(flags & 0x40)) Put(env.get(), ckpt::JoinPath(kRoot, ckpt::internal::kLatestName), latest);
  Put(env.get(), ckpt::JoinPath(dir, ckpt::internal::kManifestName), manifest);
  Put(env.get(), ckpt::JoinPath(dir, ckpt::internal::DataFileName(0)), data);
  if (flags & 0x80) {
    const std::string staging =
        ckpt::JoinPath(kRoot, ckpt::internal::StagingDirName(step + 1, "0000000000000000"));
    if (!env->CreateDir(staging).ok()) std::abort();
    Put(env.get(), ckpt::JoinPath(staging, ckpt::internal::PartFileName(0)), manifest);
  }
  OpenReadAndVerify(env.get(), /*read_only=*/true);
  OpenReadAndVerify(env.get(), /*read_only=*/false);
  return 0;
}
