// A byte-for-byte picture of a directory tree, to assert that a failed or refused operation
// changed nothing, or that every file of a committed step survived somewhere.
#ifndef CKPT_TESTS_SUPPORT_TREE_SNAPSHOT_H_
#define CKPT_TESTS_SUPPORT_TREE_SNAPSHOT_H_

#include <map>
#include <string>

namespace ckpt::testing {

// Path relative to the root -> "file:" + contents, "dir", "link:" + target, or "other" (FIFO,
// socket, device). Links are recorded, never followed; LOCK is left out (the primary handle
// creates it). Files larger than 64 MiB are recorded by size only.
using TreeSnapshot = std::map<std::string, std::string>;
TreeSnapshot SnapshotTree(const std::string& root);

// The first difference between two snapshots ("" when equal), for test failure messages.
std::string DescribeDifference(const TreeSnapshot& before, const TreeSnapshot& after);

}  // namespace ckpt::testing

#endif  // CKPT_TESTS_SUPPORT_TREE_SNAPSHOT_H_
