#include "tests/support/tree_snapshot.h"

#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <sstream>

namespace ckpt::testing {

TreeSnapshot SnapshotTree(const std::string& root) {
  namespace fs = std::filesystem;
  TreeSnapshot out;
  std::error_code ec;
  for (fs::recursive_directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string rel = fs::relative(it->path(), root, ec).string();
    if (rel == "LOCK") continue;
    struct stat st;
    if (::lstat(it->path().c_str(), &st) != 0) continue;
    if (S_ISLNK(st.st_mode)) {
      out[rel] = "link:" + fs::read_symlink(it->path(), ec).string();
    } else if (S_ISDIR(st.st_mode)) {
      out[rel] = "dir";
    } else if (!S_ISREG(st.st_mode)) {
      out[rel] = "other";
    } else if (st.st_size > (64 << 20)) {
      out[rel] = "file-of-size:" + std::to_string(st.st_size);
    } else {
      std::ifstream in(it->path(), std::ios::binary);
      std::ostringstream bytes;
      bytes << in.rdbuf();
      out[rel] = "file:" + bytes.str();
    }
  }
  return out;
}

std::string DescribeDifference(const TreeSnapshot& before, const TreeSnapshot& after) {
  for (const auto& [path, what] : before) {
    auto it = after.find(path);
    if (it == after.end()) return path + " is gone";
    if (it->second != what) return path + " changed";
  }
  for (const auto& [path, what] : after) {
    if (!before.count(path)) return path + " appeared";
  }
  return "";
}

}  // namespace ckpt::testing
