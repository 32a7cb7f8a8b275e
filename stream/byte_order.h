// Big-endian integers on the wire: independent of host byte order and
// alignment. Shared by the frame header and the handshake.
//
// Written as one byte swap and one unaligned store (memcpy): GCC 12 turned
// the byte-by-byte form of put32 into some 20 shifts and byte moves per
// field (encode_header was 135 instructions, about 4% of spindle-router's
// CPU while forwarding 64 B frames); reads it already merges into bswap.
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>
#include <vector>

namespace spindle::be {

inline void put16(std::uint8_t* p, std::uint16_t v) {
  if constexpr (std::endian::native == std::endian::little) v = __builtin_bswap16(v);
  std::memcpy(p, &v, sizeof v);
}

inline void put32(std::uint8_t* p, std::uint32_t v) {
  if constexpr (std::endian::native == std::endian::little) v = __builtin_bswap32(v);
  std::memcpy(p, &v, sizeof v);
}

inline void put64(std::uint8_t* p, std::uint64_t v) {
  put32(p, static_cast<std::uint32_t>(v >> 32));
  put32(p + 4, static_cast<std::uint32_t>(v));
}

inline void append16(std::vector<std::uint8_t>& out, std::uint16_t v) {
  std::uint8_t b[2];
  put16(b, v);
  out.insert(out.end(), b, b + 2);
}

inline void append32(std::vector<std::uint8_t>& out, std::uint32_t v) {
  std::uint8_t b[4];
  put32(b, v);
  out.insert(out.end(), b, b + 4);
}

inline std::uint16_t get16(const std::uint8_t* p) {
  return static_cast<std::uint16_t>((p[0] << 8) | p[1]);
}

inline std::uint32_t get32(const std::uint8_t* p) {
  return (std::uint32_t{p[0]} << 24) | (std::uint32_t{p[1]} << 16) | (std::uint32_t{p[2]} << 8) |
         std::uint32_t{p[3]};
}

inline std::uint64_t get64(const std::uint8_t* p) { return (std::uint64_t{get32(p)} << 32) | get32(p + 4); }

}  // namespace spindle::be
