// ScopedTempDir: a fresh directory per test, removed with everything in it at destruction.
#ifndef CKPT_TESTS_SUPPORT_TEMP_DIR_H_
#define CKPT_TESTS_SUPPORT_TEMP_DIR_H_

#include <string>

namespace ckpt::testing {

class ScopedTempDir {
 public:
  ScopedTempDir();  // Under $TMPDIR (or /tmp); aborts the test binary if it cannot be made.
  ~ScopedTempDir();
  ScopedTempDir(const ScopedTempDir&) = delete;  // Owns the directory.
  ScopedTempDir& operator=(const ScopedTempDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

}  // namespace ckpt::testing

#endif  // CKPT_TESTS_SUPPORT_TEMP_DIR_H_
