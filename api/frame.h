// Frame: the 26-byte header every Spindle and Mitogen message starts with.
//
// Layout (big-endian, Python struct ">hLLLLLL"): enc, dst_id, src_id, auth_id,
// handle, reply_to, length. The header is the unit the parser validates before
// it buffers a single byte of body: an unknown enc or an oversized length is
// rejected from these 26 bytes alone.
//
// Thread safety: plain values and pure functions; usable from any thread.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace spindle {

inline constexpr std::size_t kHeaderSize = 26;

// Encodings ("enc"/magic). Mitogen 0.3.3 knows only kEncMitogen; it disconnects
// on anything else, so frames in Spindle's own encodings are never sent to a
// Mitogen peer. Payloads whose meaning Mitogen defines as raw bytes (dead
// messages, FORWARD_LOG, ADD_ROUTE, DEL_ROUTE, SHUTDOWN) use kEncMitogen so a
// Mitogen peer can read them.
enum Enc : std::uint16_t {
  kEncMitogen = 0x4d49,         // "MI": Mitogen pickle, or raw bytes on control handles
  kEncMitogenPickle = 0x4d4a,   // "MJ": newer Mitogen, pickle (routed opaquely)
  kEncMitogenRaw = 0x4d4b,      // "MK": newer Mitogen, raw binary (routed opaquely)
  kEncRaw = 0x5352,             // "SR": Spindle, opaque application bytes
  kEncCallError = 0x5345,       // "SE": Spindle, CallError: type NUL message (UTF-8)
  kEncFds = 0x5346,             // "SF": Spindle, carries fds: 8-byte prefix, then the body (§13)
};

bool is_known_enc(std::uint16_t enc);
// Whether a stock Mitogen 0.3 peer can decode frames with this enc.
inline bool mitogen_can_decode(std::uint16_t enc) { return enc == kEncMitogen; }
std::string_view enc_name(std::uint16_t enc);

// Well-known handles, numbered as in Mitogen where the meaning is the same.
enum Handle : std::uint32_t {
  kHandleForwardLog = 102,   // payload: name NUL levelno NUL message (UTF-8)
  kHandleAddRoute = 103,     // payload: ASCII "id" or "id:name"
  kHandleDelRoute = 104,     // payload: ASCII "id"
  kHandleAllocateId = 105,   // request: empty; reply payload: ASCII "id"
  kHandleShutdown = 106,     // payload: empty
  kHandleCallService = 110,  // service calls (services/host.h, PROTOCOL.md §12)
  // Spindle only, parent to child: ASCII ids "a,b,c", the sender's ancestors,
  // nearest first (router/ancestors.cpp, PROTOCOL.md 6.7).
  kHandleAncestors = 120,
  kHandleIsDead = 999,       // only ever in reply_to: "this is a dead message"
  kFirstDynamicHandle = 1000,
};

// What a received Sender may name: a handle a Receiver (or a handler
// registered by number) holds. Never a control handle (below
// kFirstDynamicHandle: SHUTDOWN, CALL_SERVICE, ...) nor a call's reply handle
// (the top bit, router/call_table.h): a callee that sends to a Sender it was
// given would otherwise send those frames in its own name, for the caller.
inline constexpr bool is_sender_handle(std::uint32_t h) { return h >= kFirstDynamicHandle && (h >> 31) == 0; }

inline constexpr std::uint32_t kDefaultMaxMessageSize = 128u << 20;  // 128 MiB
inline constexpr std::uint64_t kMaxMaxMessageSize = 0xffffffffull;   // length is a u32

struct Header {
  std::uint16_t enc = kEncRaw;
  std::uint32_t dst_id = 0;
  std::uint32_t src_id = 0;
  std::uint32_t auth_id = 0;
  std::uint32_t handle = 0;
  std::uint32_t reply_to = 0;
  std::uint32_t length = 0;

  bool is_dead() const { return reply_to == kHandleIsDead; }
  bool operator==(const Header&) const = default;
};

using HeaderBytes = std::array<std::uint8_t, kHeaderSize>;

HeaderBytes encode_header(const Header& h);
Header decode_header(const std::uint8_t* p);  // reads exactly kHeaderSize bytes

}  // namespace spindle
