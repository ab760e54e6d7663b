#include "formats/strict_json.h"

#include <utility>
#include <vector>

#include "absl/strings/match.h"

namespace ckpt::formats::internal {
namespace {

using nlohmann::json;

// Builds the DOM from SAX events. A key is checked against the object being built, whose
// lookup is logarithmic, so duplicates cost no second pass and no set per object.
class StrictBuilder : public StrictSax {
 public:
  StrictBuilder(json* out, int max_depth) : StrictSax(max_depth), out_(out) {}

  bool null() override { return Put(json(nullptr)) != nullptr; }
  bool boolean(bool v) override { return Put(json(v)) != nullptr; }
  bool number_integer(number_integer_t v) override { return Put(json(v)) != nullptr; }
  bool number_unsigned(number_unsigned_t v) override { return Put(json(v)) != nullptr; }
  bool number_float(number_float_t v, const string_t&) override { return Put(json(v)) != nullptr; }
  bool string(string_t& v) override { return Put(json(std::move(v))) != nullptr; }
  bool binary(binary_t& v) override { return Put(json::binary(std::move(v))) != nullptr; }
  bool start_object(std::size_t) override { return Open(json::object()); }
  bool end_object() override { return Close(); }
  bool start_array(std::size_t) override { return Open(json::array()); }
  bool end_array() override { return Close(); }
  bool key(string_t& k) override {
    if (stack_.back()->contains(k)) return Repeated(std::move(k));
    key_ = std::move(k);
    return true;
  }

 private:
  // Places `v` where the next value goes: the root, the end of an array or under the key.
  json* Put(json&& v) {
    if (stack_.empty()) {
      *out_ = std::move(v);
      return out_;
    }
    json* parent = stack_.back();
    if (parent->is_array()) {
      parent->push_back(std::move(v));
      return &parent->back();
    }
    json& slot = (*parent)[key_];
    slot = std::move(v);
    return &slot;
  }
  bool Open(json&& container) {
    if (!Enter()) return false;
    stack_.push_back(Put(std::move(container)));
    return true;
  }
  bool Close() {
    stack_.pop_back();
    Leave();
    return true;
  }

  json* out_;
  std::vector<json*> stack_;
  std::string key_;
};

}  // namespace

bool RunStrict(absl::string_view text, StrictSax* sax) {
  // nlohmann skips a byte-order mark; RFC 8259 forbids writing one, and no writer of these
  // files does (Python's json refuses one too).
  if (absl::StartsWith(text, "\xEF\xBB\xBF")) {
    sax->syntax_error_ = true;
    return false;
  }
  const bool parsed = json::sax_parse(text.begin(), text.end(), sax);
  if (!parsed && sax->ok()) sax->syntax_error_ = true;
  return parsed && sax->ok();
}

StrictJson ParseStrictJson(absl::string_view text, int max_depth) {
  StrictJson out;
  StrictBuilder builder(&out.value, max_depth);
  if (!RunStrict(text, &builder)) out.value = json();
  out.syntax_error = builder.syntax_error();
  out.too_deep = builder.too_deep();
  out.duplicate = builder.duplicate();
  return out;
}

}  // namespace ckpt::formats::internal
