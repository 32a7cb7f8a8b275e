// Helpers for the slot-buffer tests: self-checking slot contents and an fd
// count.
//
// A stamped slot is 64-bit words: [writer << 32 | counter][pattern...][sum].
// Every pattern word is derived from the first, and the last word checks them
// all, so a copy that mixes two writes (a torn read) fails verify_stamp().
//
// Thread safety: pure functions. Ownership: none.
#pragma once


#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <stdexcept>

namespace spindle::testutil {

inline std::uint64_t mix64(std::uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  return x ^ (x >> 33);
}

// Fills `bytes` (a multiple of 8, at least 16) with a stamp for (writer, counter).
inline void stamp_slot(std::span<std::byte> bytes, std::uint32_t writer, std::uint32_t counter) {
  std::size_t n = bytes.size() / 8;
  std::uint64_t head = (std::uint64_t{writer} << 32) | counter;
  std::uint64_t sum = 0;
  for (std::size_t i = 0; i + 1 < n; ++i) {
    std::uint64_t w = i == 0 ? head : mix64(head + i);
    sum = mix64(sum ^ w);
    std::memcpy(bytes.data() + i * 8, &w, 8);
  }
  std::memcpy(bytes.data() + (n - 1) * 8, &sum, 8);
}

inline bool verify_stamp(std::span<const std::byte> bytes) {
  std::size_t n = bytes.size() / 8;
  if (n < 2) return false;
  std::uint64_t head;
  std::memcpy(&head, bytes.data(), 8);
  std::uint64_t sum = 0;
  for (std::size_t i = 0; i + 1 < n; ++i) {
    std::uint64_t w;
    std::memcpy(&w, bytes.data() + i * 8, 8);
    if (i > 0 && w != mix64(head + i)) return false;
    sum = mix64(sum ^ w);
  }
  std::uint64_t stored;
  std::memcpy(&stored, bytes.data() + (n - 1) * 8, 8);
  return stored == sum;
}

}  // namespace spindle::testutil
