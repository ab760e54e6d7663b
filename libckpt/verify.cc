#include "ckpt/verify.h"

#include <algorithm>
#include <set>

#include "absl/strings/str_cat.h"
#include "ckpt/base/checksum.h"
#include "ckpt/base/coding.h"
#include "ckpt/base/status_macros.h"
#include "ckpt/checkpoint_store.h"
#include "ckpt/formats/manifest.h"
#include "libckpt/aligned_buffer.h"
#include "libckpt/filename.h"

namespace ckpt {
namespace {

using internal::AlignedBuffer;

VerifyProblem Problem(std::string file, std::optional<uint64_t> chunk, uint64_t offset,
                      absl::string_view message) {
  return VerifyProblem{std::move(file), chunk, offset, std::string(message)};
}

// Checks one data file against its manifest entry, appending problems.
void VerifyDataFile(Env* env, const std::string& dir, const formats::Manifest& m,
                    const formats::DataFileInfo& f, StepVerifyReport* report, uint64_t total,
                    const VerifyProgress& progress) {
  const std::string path = JoinPath(dir, f.name);
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> file =
      env->NewRandomAccessFile(path, FileOptions{.direct_io = true, .follow_symlinks = false});
  if (!file.ok()) {
    report->problems.push_back(Problem(path, std::nullopt, 0, file.status().message()));
    return;
  }
  if ((*file)->size() != f.size_bytes) {
    report->problems.push_back(
        Problem(path, std::nullopt, std::min((*file)->size(), f.size_bytes),
                absl::StrCat("file is ", (*file)->size(), " bytes, MANIFEST says ", f.size_bytes)));
    return;
  }
  uint64_t largest = formats::kDataFileHeaderBytes;
  for (const formats::ChunkInfo& c : f.chunks) {
    largest = std::max(largest, formats::ChunkExtentBytes(c.stored_bytes));
  }
  absl::StatusOr<AlignedBuffer> buf = AlignedBuffer::Create(largest);
  if (!buf.ok()) {
    report->problems.push_back(Problem(path, std::nullopt, 0, buf.status().message()));
    return;
  }
  std::span<std::byte> header = buf->span().first(formats::kDataFileHeaderBytes);
  absl::Status s = (*file)->Read(0, header);
  if (s.ok()) {
    absl::StatusOr<formats::DataFileHeader> h = formats::DecodeDataFileHeader(header, path);
    if (!h.ok()) {
      s = h.status();
    } else if (h->rank != f.rank || h->step != m.step || h->world_size != m.world_size) {
      s = absl::DataLossError("data file header disagrees with MANIFEST");
    }
  }
  if (!s.ok()) report->problems.push_back(Problem(path, std::nullopt, 0, s.message()));
  report->bytes_checked += formats::kDataFileHeaderBytes;
  for (size_t i = 0; i < f.chunks.size(); ++i) {
    const formats::ChunkInfo& c = f.chunks[i];
    std::span<std::byte> extent = buf->span().first(formats::ChunkExtentBytes(c.stored_bytes));
    absl::Status cs = (*file)->Read(c.offset, extent);
    if (cs.ok() && Checksum(extent) != c.checksum) {
      cs =
          absl::DataLossError(absl::StrCat("chunk fails its checksum (", extent.size(), " bytes)"));
    }
    if (cs.ok()) {
      absl::StatusOr<formats::ChunkHeader> h = formats::DecodeChunkHeader(extent, path, c.offset);
      if (!h.ok()) {
        cs = h.status();
      } else if (h->codec != c.codec || h->raw_bytes != c.raw_bytes ||
                 h->stored_bytes != c.stored_bytes) {
        cs = absl::DataLossError("chunk header disagrees with MANIFEST");
      } else {
        // Decoded in bounded pieces and dropped: a chunk's bytes are checked by its checksum,
        // its payload by decoding to exactly its raw size.
        cs = formats::CheckPayloadDecodes(
            c.codec, extent.subspan(formats::kChunkHeaderBytes, c.stored_bytes), c.raw_bytes,
            path, c.offset);
      }
    }
    if (!cs.ok()) report->problems.push_back(Problem(path, i, c.offset, cs.message()));
    report->bytes_checked += extent.size();
    ++report->chunks_checked;
    if (progress) progress(report->bytes_checked, total);
  }
}

}  // namespace

bool StoreVerifyReport::ok() const {
  if (!problems.empty()) return false;
  return std::all_of(steps.begin(), steps.end(),
                     [](const StepVerifyReport& s) { return s.problems.empty(); });
}

absl::StatusOr<StepVerifyReport> VerifyStepDir(Env* env, const std::string& dir,
                                               const VerifyProgress& progress) {
  StepVerifyReport report;
  report.dir = dir;
  CKPT_ASSIGN_OR_RETURN(bool is_dir, env->IsDirectory(dir));
  if (!is_dir) {
    report.problems.push_back(Problem(dir, std::nullopt, 0,
                                      "not a directory (a symbolic link or a file), which ckpt "
                                      "never puts under a step's name"));
    return report;
  }
  CKPT_ASSIGN_OR_RETURN(std::vector<std::string> names, env->GetChildren(dir));
  const std::string manifest_path = JoinPath(dir, internal::kManifestName);
  absl::StatusOr<std::string> bytes = ReadFileToString(
      env, manifest_path, formats::kMaxManifestBytes, FileOptions{.follow_symlinks = false});
  if (!bytes.ok()) {
    report.problems.push_back(Problem(manifest_path, std::nullopt, 0, bytes.status().message()));
    return report;
  }
  absl::StatusOr<formats::Manifest> m = formats::ParseManifest(AsBytes(*bytes), manifest_path);
  if (!m.ok()) {
    report.problems.push_back(Problem(manifest_path, std::nullopt, 0, m.status().message()));
    return report;
  }
  report.step = m->step;
  report.bytes_checked += bytes->size();
  std::set<std::string> expected = {std::string(internal::kManifestName)};
  uint64_t total = bytes->size();
  for (const formats::DataFileInfo& f : m->files) {
    expected.insert(f.name);
    total += f.size_bytes;
    if (f.name != internal::DataFileName(f.rank)) {
      report.problems.push_back(Problem(JoinPath(dir, f.name), std::nullopt, 0,
                                        "data file name does not match its rank"));
    }
  }
  for (const std::string& name : names) {
    if (!expected.count(name)) {
      report.problems.push_back(
          Problem(JoinPath(dir, name), std::nullopt, 0, "unexpected file in step directory"));
    }
  }
  for (const formats::DataFileInfo& f : m->files) {
    VerifyDataFile(env, dir, *m, f, &report, total, progress);
  }
  return report;
}

absl::StatusOr<StoreVerifyReport> VerifyStore(Env* env, const std::string& root,
                                              std::optional<uint64_t> step, bool all,
                                              const VerifyProgress& progress) {
  StoreVerifyReport report;
  CKPT_ASSIGN_OR_RETURN(std::vector<uint64_t> steps, ListStepDirs(env, root));
  const std::string latest_path = JoinPath(root, internal::kLatestName);
  absl::StatusOr<std::optional<uint64_t>> latest = ReadLatest(env, root);
  if (!latest.ok()) {
    report.problems.push_back(Problem(latest_path, std::nullopt, 0, latest.status().message()));
  } else if (latest->has_value()) {
    report.latest = **latest;
    if (!std::binary_search(steps.begin(), steps.end(), **latest)) {
      report.problems.push_back(
          Problem(latest_path, std::nullopt, 0,
                  absl::StrCat("names step ", **latest, ", which does not exist")));
    }
  } else if (!steps.empty()) {
    report.problems.push_back(
        Problem(latest_path, std::nullopt, 0, "missing, while the root holds step directories"));
  }
  std::vector<uint64_t> chosen;
  if (step.has_value()) {
    if (!std::binary_search(steps.begin(), steps.end(), *step)) {
      return absl::NotFoundError(absl::StrCat(root, ": no step ", *step));
    }
    chosen = {*step};
  } else if (all) {
    chosen = steps;
  } else if (report.latest.has_value() &&
             std::binary_search(steps.begin(), steps.end(), *report.latest)) {
    chosen = {*report.latest};
  }
  for (uint64_t s : chosen) {
    const std::string dir = JoinPath(root, internal::StepDirName(s));
    absl::StatusOr<StepVerifyReport> r = VerifyStepDir(env, dir, progress);
    if (!r.ok()) {
      // A step that vanished (a concurrent gc) or cannot be listed is reported, and the others
      // are still checked.
      StepVerifyReport failed;
      failed.dir = dir;
      failed.problems.push_back(Problem(
          dir, std::nullopt, 0, absl::StrCat("could not be checked: ", r.status().message())));
      r = std::move(failed);
    } else if (r->problems.empty() && r->step != s) {
      r->problems.push_back(
          Problem(dir, std::nullopt, 0, absl::StrCat("MANIFEST names step ", r->step)));
    }
    if (!r->problems.empty() && absl::IsNotFound(env->Stat(dir).status())) {
      // Gone by now: retention renamed it away mid-check. Not damage.
      r->problems.clear();
      r->removed = true;
    }
    r->step = s;
    report.steps.push_back(*std::move(r));
  }
  return report;
}

}  // namespace ckpt
