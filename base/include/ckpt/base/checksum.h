// The one checksum of ckpt: XXH3-64 from libxxhash (STYLE.md §4). Never hand-rolled.
#ifndef CKPT_BASE_CHECKSUM_H_
#define CKPT_BASE_CHECKSUM_H_

#include <cstddef>
#include <cstdint>
#include <span>

#include <xxhash.h>

namespace ckpt {

inline uint64_t Checksum(std::span<const std::byte> data) {
  return XXH3_64bits(data.data(), data.size());
}

// Streaming XXH3-64, so checksums are computed while bytes are written (no second read pass).
// Not thread-safe; one per stream of bytes.
class StreamingChecksum {
 public:
  StreamingChecksum() : state_(XXH3_createState()) { Reset(); }
  ~StreamingChecksum() { XXH3_freeState(state_); }
  // Owns an XXH3 state; copying would share it.
  StreamingChecksum(const StreamingChecksum&) = delete;
  StreamingChecksum& operator=(const StreamingChecksum&) = delete;

  void Reset() { XXH3_64bits_reset(state_); }
  void Update(std::span<const std::byte> data) {
    XXH3_64bits_update(state_, data.data(), data.size());
  }
  uint64_t Digest() const { return XXH3_64bits_digest(state_); }

 private:
  XXH3_state_t* state_;
};

}  // namespace ckpt

#endif  // CKPT_BASE_CHECKSUM_H_
