// gMock matchers for absl::Status and absl::StatusOr (STYLE.md §11): assert on codes.
#ifndef CKPT_TESTS_SUPPORT_STATUS_MATCHERS_H_
#define CKPT_TESTS_SUPPORT_STATUS_MATCHERS_H_

#include <gmock/gmock.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ckpt::testing {

inline const absl::Status& GetStatus(const absl::Status& s) { return s; }
template <typename T>
const absl::Status& GetStatus(const absl::StatusOr<T>& s) {
  return s.status();
}

MATCHER(IsOk, "is OK") {
  const absl::Status& s = GetStatus(arg);
  if (!s.ok()) *result_listener << "status is " << s;
  return s.ok();
}

MATCHER_P(StatusIs, code, "has status code " + ::testing::PrintToString(code)) {
  const absl::Status& s = GetStatus(arg);
  *result_listener << "status is " << s;
  return s.code() == code;
}

// The code, and a message that contains `text`.
MATCHER_P2(StatusIsWith, code, text,
           "has status code " + ::testing::PrintToString(code) + " and a message containing " +
               ::testing::PrintToString(text)) {
  const absl::Status& s = GetStatus(arg);
  *result_listener << "status is " << s;
  return s.code() == code && s.message().find(text) != absl::string_view::npos;
}

}  // namespace ckpt::testing

#define CKPT_ASSERT_OK(expr)                      \
  do {                                            \
    ASSERT_THAT((expr), ::ckpt::testing::IsOk()); \
  } while (0)
#define CKPT_EXPECT_OK(expr) EXPECT_THAT((expr), ::ckpt::testing::IsOk())

#endif  // CKPT_TESTS_SUPPORT_STATUS_MATCHERS_H_
