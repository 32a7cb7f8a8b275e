// Big-endian integers on the wire, read and written byte by byte: independent
// of host byte order and alignment. Shared by the frame header and the
// handshake.
#pragma once

#include <cstdint>
#include <vector>

namespace spindle::be {

inline void put16(std::uint8_t* p, std::uint16_t v) {
  p[0] = static_cast<std::uint8_t>(v >> 8);
  p[1] = static_cast<std::uint8_t>(v);
}

inline void put32(std::uint8_t* p, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<std::uint8_t>(v >> (24 - 8 * i));
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

}  // namespace spindle::be
