#include "ckpt/coordinator.h"

#include <condition_variable>
#include <map>
#include <mutex>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "ckpt/base/status_macros.h"

namespace ckpt {

absl::StatusOr<std::string> Coordinator::Broadcast(absl::string_view value, int root) {
  CKPT_ASSIGN_OR_RETURN(std::vector<std::string> all,
                        AllGather(rank() == root ? value : absl::string_view()));
  if (root < 0 || static_cast<size_t>(root) >= all.size()) {
    return absl::InvalidArgumentError("broadcast root outside the group");
  }
  return std::move(all[static_cast<size_t>(root)]);
}

absl::Status Coordinator::Barrier() { return AllGather("").status(); }

std::string EncodeStatus(const absl::Status& status) {
  if (status.ok()) return "0";
  return absl::StrCat(static_cast<int>(status.code()), " ", status.message());
}

namespace {

// "<code> <message>" with a code that is not OK into `out`; false for anything else.
bool ParseError(absl::string_view text, absl::Status* out) {
  std::pair<absl::string_view, absl::string_view> parts =
      absl::StrSplit(text, absl::MaxSplits(' ', 1));
  int code = 0;
  if (!absl::SimpleAtoi(parts.first, &code) || code <= 0 || code > 16) return false;
  *out = absl::Status(static_cast<absl::StatusCode>(code), parts.second);
  return true;
}

}  // namespace

absl::Status DecodeStatus(absl::string_view text) {
  if (text == "0") return absl::OkStatus();
  absl::Status out;
  if (ParseError(text, &out)) return out;
  return absl::InternalError(absl::StrCat("malformed status from another rank: ", text));
}

std::string EncodeResult(const absl::StatusOr<std::string>& result) {
  if (result.ok()) return absl::StrCat("ok ", *result);
  return absl::StrCat("no ", EncodeStatus(result.status()));
}

absl::StatusOr<std::string> DecodeResult(absl::string_view text) {
  absl::string_view rest = text;
  if (absl::ConsumePrefix(&rest, "ok ")) return std::string(rest);
  absl::Status why;
  if (absl::ConsumePrefix(&rest, "no ") && ParseError(rest, &why)) return why;
  return absl::InternalError(absl::StrCat("malformed result from another rank: ", text));
}

absl::StatusOr<std::string> BroadcastResult(Coordinator& coordinator,
                                            const absl::StatusOr<std::string>& mine, int root) {
  CKPT_ASSIGN_OR_RETURN(std::string text,
                        coordinator.Broadcast(coordinator.rank() == root ? EncodeResult(mine) : "",
                                              root));
  return DecodeResult(text);
}

// Round r of AllGather: ranks deposit into `slots`; the last to arrive publishes the round's
// result under its generation, and each rank takes its copy and releases it.
struct ThreadGroup::State {
  explicit State(int n) : size(n), slots(static_cast<size_t>(n)) {}
  const int size;
  std::mutex mu;
  std::condition_variable next_round;
  uint64_t generation = 0;
  int arrived = 0;
  std::vector<std::string> slots;
  struct Result {
    std::vector<std::string> values;
    int readers_left;
  };
  std::map<uint64_t, Result> results;
};

class ThreadGroup::Member : public Coordinator {
 public:
  Member(State* state, int rank) : state_(state), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return state_->size; }

  absl::StatusOr<std::vector<std::string>> AllGather(absl::string_view mine) override {
    State& s = *state_;
    std::unique_lock<std::mutex> lock(s.mu);
    const uint64_t my_generation = s.generation;
    s.slots[static_cast<size_t>(rank_)] = std::string(mine);
    if (++s.arrived == s.size) {
      s.results[my_generation] = {std::move(s.slots), s.size};
      s.slots.assign(static_cast<size_t>(s.size), std::string());
      s.arrived = 0;
      ++s.generation;
      s.next_round.notify_all();
    } else {
      s.next_round.wait(lock, [&] { return s.generation != my_generation; });
    }
    auto it = s.results.find(my_generation);
    std::vector<std::string> out = it->second.values;
    if (--it->second.readers_left == 0) s.results.erase(it);
    return out;
  }

 private:
  State* state_;
  int rank_;
};

ThreadGroup::ThreadGroup(int size) : state_(std::make_unique<State>(size)) {
  for (int r = 0; r < size; ++r) members_.push_back(std::make_unique<Member>(state_.get(), r));
}

ThreadGroup::~ThreadGroup() = default;

int ThreadGroup::size() const { return state_->size; }

Coordinator* ThreadGroup::member(int rank) { return members_[static_cast<size_t>(rank)].get(); }

}  // namespace ckpt
