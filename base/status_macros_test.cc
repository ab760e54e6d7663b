// CKPT_RETURN_IF_ERROR and CKPT_ASSIGN_OR_RETURN, in their plain and annotated forms.
#include "ckpt/base/status_macros.h"

#include <string>

#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace ckpt {
namespace {

absl::StatusOr<int> Parse(bool ok) {
  if (!ok) return absl::DataLossError("bad byte");
  return 7;
}

absl::Status Plain(bool ok) {
  CKPT_RETURN_IF_ERROR(Parse(ok).status());
  return absl::OkStatus();
}

absl::Status WithContext(bool ok, int* contexts_built) {
  auto context = [&] {
    ++*contexts_built;
    return absl::StrCat("tensor \"w\"");
  };
  CKPT_RETURN_IF_ERROR(Parse(ok).status(), context());
  return absl::OkStatus();
}

absl::StatusOr<int> Assigned(bool ok, bool annotate) {
  if (annotate) {
    CKPT_ASSIGN_OR_RETURN(int v, Parse(ok), "reading step 3");
    return v + 1;
  }
  CKPT_ASSIGN_OR_RETURN(int v, Parse(ok));
  return v;
}

TEST(StatusMacrosTest, ThePlainFormsPassTheErrorOnUnchanged) {
  EXPECT_TRUE(Plain(true).ok());
  EXPECT_EQ(Plain(false), absl::DataLossError("bad byte"));
  EXPECT_EQ(*Assigned(true, false), 7);
  EXPECT_EQ(Assigned(false, false).status(), absl::DataLossError("bad byte"));
}

TEST(StatusMacrosTest, AContextIsPrependedKeepingTheCodeAndBuiltOnlyOnAnError) {
  int built = 0;
  EXPECT_TRUE(WithContext(true, &built).ok());
  EXPECT_EQ(built, 0);
  EXPECT_EQ(WithContext(false, &built), absl::DataLossError("tensor \"w\": bad byte"));
  EXPECT_EQ(built, 1);
  EXPECT_EQ(*Assigned(true, true), 8);
  EXPECT_EQ(Assigned(false, true).status(), absl::DataLossError("reading step 3: bad byte"));
}

}  // namespace
}  // namespace ckpt
