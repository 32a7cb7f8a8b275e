// Envelope: the payload of a CALL_SERVICE (110) request.
//
// Role: packs and unpacks "which service, which method, which argument bytes"
// (docs/PROTOCOL.md section 12):
//   u8 version (1) | u8 flags | u16 service length | u16 method length |
//   service | method | argument bytes (the rest)
// Flags: kEnvelopeMsgpack (bit 0) marks a typed call, whose argument bytes
// are one msgpack array and whose result is one msgpack value; no other bit
// is defined, and a request with one set is malformed.
// Names are 1..255 bytes without NUL; anything else is malformed. The
// argument bytes are never copied: encoding appends the caller's slices
// after a small header slice, and decoding shares the received slices.
//
// Thread safety: pure functions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "stream/payload.h"

namespace spindle::services {

inline constexpr std::uint8_t kEnvelopeVersion = 1;
inline constexpr std::size_t kEnvelopeHeaderSize = 6;
inline constexpr std::size_t kMaxNameLength = 255;
inline constexpr std::uint8_t kEnvelopeMsgpack = 0x01;

// Throws Error if a name is empty, longer than kMaxNameLength or holds a NUL.
Payload encode_call(std::string_view service, std::string_view method, Payload args,
                    std::uint8_t flags = 0);

struct Envelope {
  std::string service;
  std::string method;
  Payload args;
  std::uint8_t flags = 0;
  bool msgpack() const { return (flags & kEnvelopeMsgpack) != 0; }
};

struct DecodeResult {
  std::string error;  // empty when ok: otherwise a reason from reasons.h plus detail
  Envelope envelope;
  bool ok() const { return error.empty(); }
};
DecodeResult decode_call(const Payload& data);

// The bytes of `p` from `offset` on, sharing its slices.
Payload payload_suffix(const Payload& p, std::size_t offset);

}  // namespace spindle::services
