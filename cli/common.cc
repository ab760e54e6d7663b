#include "cli/common.h"

#include <unistd.h>

#include <algorithm>
#include <iostream>
#include <vector>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace ckpt::cli {

int ReportError(absl::string_view context, const absl::Status& status) {
  std::cerr << "ckpt-tool: " << context << ": " << Printable(status.message()) << "\n";
  return kExitUsage;
}

int OpenStepOrReport(absl::string_view command, const std::string& root,
                     std::optional<uint64_t> step, OpenedStep* out) {
  const std::string context = absl::StrCat(command, " ", Printable(root));
  StoreOptions options;
  options.read_only = true;
  absl::StatusOr<std::unique_ptr<CheckpointStore>> store = CheckpointStore::Open(root, options);
  if (!store.ok()) return ReportError(context, store.status());
  absl::StatusOr<std::unique_ptr<CheckpointReader>> reader =
      step.has_value() ? (*store)->OpenStep(*step) : (*store)->OpenLatest();
  if (!reader.ok()) {
    ReportError(context, reader.status());
    bool exists = (*store)->latest_step().has_value();
    if (step.has_value()) {
      absl::StatusOr<std::vector<uint64_t>> steps = (*store)->ListSteps();
      exists = steps.ok() && std::count(steps->begin(), steps->end(), *step) > 0;
    }
    const bool damage = absl::IsDataLoss(reader.status()) ||
                        (absl::IsNotFound(reader.status()) && exists);
    return damage ? kExitDamage : kExitUsage;
  }
  out->store = *std::move(store);
  out->reader = *std::move(reader);
  return kExitOk;
}

namespace {

// The code point of the well-formed UTF-8 sequence at the start of `s` and its length, or
// length 0 when it is not one (a stray continuation byte, a truncated or overlong sequence, a
// surrogate, past U+10FFFF).
std::pair<uint32_t, size_t> DecodeUtf8(absl::string_view s) {
  const auto b = [&](size_t i) { return static_cast<unsigned char>(s[i]); };
  const unsigned char lead = b(0);
  size_t n = lead >= 0xf0 ? 4 : lead >= 0xe0 ? 3 : lead >= 0xc0 ? 2 : 0;
  if (n == 0 || lead > 0xf4 || s.size() < n) return {0, 0};
  uint32_t cp = lead & (0xff >> (n + 1));
  for (size_t i = 1; i < n; ++i) {
    if ((b(i) & 0xc0) != 0x80) return {0, 0};
    cp = (cp << 6) | (b(i) & 0x3f);
  }
  const uint32_t min = n == 2 ? 0x80 : n == 3 ? 0x800 : 0x10000;
  if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return {0, 0};
  return {cp, n};
}

// Code points a terminal acts on rather than shows: C1 controls (U+0080-U+009F, e.g. CSI
// U+009B) and the bidirectional controls that reorder what follows (LRM, RLM, ALM, the
// embeddings, overrides and isolates).
bool IsTerminalControl(uint32_t cp) {
  return (cp >= 0x80 && cp <= 0x9f) || cp == 0x61c || cp == 0x200e || cp == 0x200f ||
         (cp >= 0x202a && cp <= 0x202e) || (cp >= 0x2066 && cp <= 0x2069);
}

}  // namespace

std::string Printable(absl::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    const auto u = static_cast<unsigned char>(text[i]);
    if (u < 0x80) {
      if (u < 0x20 || u == 0x7f) {
        absl::StrAppendFormat(&out, "\\x%02x", u);
      } else if (u == '\\') {
        out += "\\\\";
      } else {
        out += static_cast<char>(u);
      }
      ++i;
      continue;
    }
    const auto [cp, n] = DecodeUtf8(text.substr(i));
    if (n == 0) {  // Not UTF-8: a lone byte, which an 8-bit terminal may read as a control.
      absl::StrAppendFormat(&out, "\\x%02x", u);
      ++i;
    } else if (IsTerminalControl(cp)) {
      absl::StrAppendFormat(&out, "\\u%04x", cp);
      i += n;
    } else {
      out.append(text.data() + i, n);
      i += n;
    }
  }
  return out;
}

absl::Status CheckFitsInMemory(uint64_t bytes, absl::string_view what) {
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long page_bytes = ::sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page_bytes <= 0) return absl::OkStatus();  // Unknown: let allocation tell.
  const uint64_t physical = static_cast<uint64_t>(pages) * static_cast<uint64_t>(page_bytes);
  if (bytes <= physical) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      what, " needs ", FormatBytes(bytes), " of memory; this machine has ", FormatBytes(physical)));
}

absl::StatusOr<uint64_t> ParseByteSize(absl::string_view text) {
  uint64_t multiplier = 1;
  absl::string_view digits = text;
  if (!digits.empty()) {
    switch (absl::ascii_toupper(static_cast<unsigned char>(digits.back()))) {
      case 'K':
        multiplier = uint64_t{1} << 10;
        break;
      case 'M':
        multiplier = uint64_t{1} << 20;
        break;
      case 'G':
        multiplier = uint64_t{1} << 30;
        break;
      case 'T':
        multiplier = uint64_t{1} << 40;
        break;
      default:
        break;
    }
    if (multiplier != 1) digits.remove_suffix(1);
  }
  uint64_t value = 0;
  if (!absl::SimpleAtoi(digits, &value) || value > UINT64_MAX / multiplier) {
    return absl::InvalidArgumentError(absl::StrCat("not a byte size: \"", text, "\""));
  }
  return value * multiplier;
}

std::string FormatBytes(uint64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  return u == 0 ? absl::StrCat(bytes, " B") : absl::StrFormat("%.1f %s", v, units[u]);
}

void PrintJson(const nlohmann::json& value) {
  std::cout << value.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
}

bool StderrIsTerminal() { return ::isatty(STDERR_FILENO) == 1; }

ProgressBar::ProgressBar(std::string label, uint64_t total, bool enabled)
    : label_(std::move(label)), total_(total), enabled_(enabled && StderrIsTerminal()) {}

ProgressBar::~ProgressBar() { Finish(); }

void ProgressBar::Update(uint64_t done) {
  if (!enabled_ || finished_) return;
  int percent = total_ == 0 ? 100 : static_cast<int>(done * 100 / total_);
  if (percent == last_percent_) return;
  last_percent_ = percent;
  constexpr int kWidth = 30;
  int filled = percent * kWidth / 100;
  std::cerr << "\r" << label_ << " [" << std::string(static_cast<size_t>(filled), '#')
            << std::string(static_cast<size_t>(kWidth - filled), ' ') << "] " << percent << "%"
            << std::flush;
}

void ProgressBar::Finish() {
  if (!enabled_ || finished_) return;
  Update(total_);
  finished_ = true;
  std::cerr << "\n";
}

}  // namespace ckpt::cli
