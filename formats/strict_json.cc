#include "formats/strict_json.h"

#include <utility>
#include <vector>

namespace ckpt::formats::internal {
namespace {

using nlohmann::json;

// Builds the DOM from SAX events. A key is checked against the object being built, whose
// lookup is logarithmic, so duplicates cost no second pass and no set per object.
class StrictBuilder : public nlohmann::json_sax<json> {
 public:
  StrictBuilder(StrictJson* out, int max_depth) : out_(out), max_depth_(max_depth) {}

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
    if (stack_.back()->contains(k)) {
      out_->duplicate = k;
      return false;
    }
    key_ = std::move(k);
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override {
    out_->syntax_error = true;
    return false;
  }

 private:
  // Places `v` where the next value goes: the root, the end of an array or under the key.
  json* Put(json&& v) {
    if (stack_.empty()) {
      out_->value = std::move(v);
      return &out_->value;
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
    if (static_cast<int>(stack_.size()) >= max_depth_) {
      out_->too_deep = true;
      return false;
    }
    stack_.push_back(Put(std::move(container)));
    return true;
  }
  bool Close() {
    stack_.pop_back();
    return true;
  }

  StrictJson* out_;
  const int max_depth_;
  std::vector<json*> stack_;
  std::string key_;
};

}  // namespace

StrictJson ParseStrictJson(absl::string_view text, int max_depth) {
  StrictJson out;
  StrictBuilder builder(&out, max_depth);
  const bool parsed = json::sax_parse(text.begin(), text.end(), &builder);
  if (!parsed && out.ok()) out.syntax_error = true;
  if (!out.ok()) out.value = json();
  return out;
}

}  // namespace ckpt::formats::internal
