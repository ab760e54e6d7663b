// The one set of strict JSON rules of the formats module: safetensors headers, HF indexes,
// optimizer records and manifests all go through StrictSax, so their rules cannot drift apart.
#ifndef CKPT_FORMATS_STRICT_JSON_H_
#define CKPT_FORMATS_STRICT_JSON_H_

#include <cstddef>
#include <string>

#include <nlohmann/json.hpp>

#include "absl/strings/string_view.h"

namespace ckpt::formats::internal {

// The rules, on nlohmann's SAX events: one JSON value (UTF-8 without a byte-order mark,
// nothing but whitespace after it), no object that repeats a key, arrays and objects nested no deeper than `max_depth`.
// Parsing stops at the first violation, in time linear in the input. A handler derives from
// it, calls Enter() as a container opens (false: too deep, stop) and Leave() as it closes, and
// Repeated(key) for a key its object already holds (how it knows is its own: a DOM looks it
// up, a handler of a known schema keeps a bit per field). RunStrict parses through it.
class StrictSax : public nlohmann::json_sax<nlohmann::json> {
 public:
  explicit StrictSax(int max_depth) : max_depth_(max_depth) {}
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) final {
    syntax_error_ = true;
    return false;
  }
  bool syntax_error() const { return syntax_error_; }
  bool too_deep() const { return too_deep_; }
  // The first key repeated within one object, or empty.
  const std::string& duplicate() const { return duplicate_; }
  bool ok() const { return !syntax_error_ && !too_deep_ && duplicate_.empty(); }

 protected:
  bool Enter() {
    if (depth_ >= max_depth_) {
      too_deep_ = true;
      return false;
    }
    ++depth_;
    return true;
  }
  void Leave() { --depth_; }
  bool Repeated(std::string key) {
    duplicate_ = std::move(key);
    return false;
  }

 private:
  friend bool RunStrict(absl::string_view text, StrictSax* sax);
  const int max_depth_;
  int depth_ = 0;
  bool syntax_error_ = false;
  bool too_deep_ = false;
  std::string duplicate_;
};

// Parses `text` through `sax`; true when the whole text was one value that kept every rule.
bool RunStrict(absl::string_view text, StrictSax* sax);

// The outcome of ParseStrictJson. Exactly one of: ok() with `value` set; `syntax_error`;
// `too_deep`; or a non-empty `duplicate` naming the first key repeated within one object.
struct StrictJson {
  nlohmann::json value;
  bool syntax_error = false;
  bool too_deep = false;
  std::string duplicate;
  bool ok() const { return !syntax_error && !too_deep && duplicate.empty(); }
};

// Parses `text` into a DOM under StrictSax's rules. It builds the value through SAX events,
// where nlohmann's callback parser rescans each parent object whenever a child object ends
// (quadratic: 100,000 one-entry tensors took 33 s).
StrictJson ParseStrictJson(absl::string_view text, int max_depth);

}  // namespace ckpt::formats::internal

#endif  // CKPT_FORMATS_STRICT_JSON_H_
