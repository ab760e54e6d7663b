#include "tests/support/testdata.h"

#include <sys/stat.h>

#include <cstdlib>
#include <cstring>

namespace ckpt::testing {

std::optional<std::string> TestdataDir(const std::string& dir) {
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) return std::nullopt;
  return dir;
}

bool TestdataRequired() {
  const char* v = std::getenv("CKPT_REQUIRE_TESTDATA");
  return v != nullptr && std::strcmp(v, "1") == 0;
}

std::string MissingTestdataMessage(const std::string& dir) {
  return "no shared testdata at " + dir +
         (TestdataRequired() ? " (CKPT_REQUIRE_TESTDATA=1: required)"
                             : " (skipped; CKPT_REQUIRE_TESTDATA=1 makes this a failure)");
}

}  // namespace ckpt::testing
