// FdFrame: how a frame says it carries file descriptors (docs/PROTOCOL.md §13).
//
// The 26-byte Mitogen header has no spare field, so a frame that carries fds
// uses its own enc, "SF" (kEncFds), and starts its payload with an 8-byte
// prefix:  inner_enc:u16  fd_count:u16  flags:u16  batch_fds:u16,
// followed by the application bytes. inner_enc is the message's real enc (SR,
// SE, MI...), fd_count the number of fds sent with the frame (1..253), and
// flag kFdFlagMemfdBody says the first fd is a sealed memfd holding the body
// (the inline bytes are then empty). A sender passes a frame's fds with the
// sendmsg() that carries the frame's first byte. By default that is one
// SF frame per sendmsg, and the receiver binds the n-th SF frame to the n-th
// batch of fds received. Between peers that both announce kFlagFdBatches, one
// sendmsg may carry the fds of several SF frames (253 at most): its first SF
// frame has flag kFdFlagBatchHead and says in batch_fds how many fds the
// whole batch holds, and it and the SF frames after it take their fd_count
// from that batch in order until it is used up (stream_fds.cpp). batch_fds
// is 0 in any other frame.
//
// Between peers that both announce kFlagMemfdRanges, a memfd body may be a
// range of its memfd with inline bytes around it (kFdFlagMemfdRange; the
// memfd-body flag is set too): the inline bytes then start with a range
// descriptor, offset:u64 length:u64 at:u32, and the body is the first `at`
// of the inline bytes after it, then the memfd's `length` bytes from
// `offset`, then the rest of the inline bytes. So bytes received in a memfd
// travel on inside a larger message without a copy.
//
// The reasons a stream gives when a message cannot travel with its fds are
// named here, so the router can put them in dead replies (router/reasons.h).
//
// Thread safety: pure functions.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "stream/payload.h"

namespace spindle {

inline constexpr std::size_t kFdPrefixSize = 8;
inline constexpr std::uint16_t kFdFlagMemfdBody = 1;
inline constexpr std::uint16_t kFdFlagBatchHead = 2;
inline constexpr std::uint16_t kFdFlagMemfdRange = 4;
inline constexpr std::size_t kMemfdRangeSize = 20;  // offset:u64 length:u64 at:u32

// A memfd range's descriptor (kFdFlagMemfdRange).
struct MemfdRange {
  std::uint64_t offset = 0, length = 0;
  std::uint32_t at = 0;
};
std::array<std::uint8_t, kMemfdRangeSize> encode_memfd_range(const MemfdRange& r);
// Reads the descriptor at the start of `inline_bytes` and checks it against
// the memfd's size; nullopt (and `error`) if it does not fit.
std::optional<MemfdRange> decode_memfd_range(const Payload& inline_bytes, std::uint64_t memfd_size,
                                             std::string& error);

struct FdPrefix {
  std::uint16_t inner_enc = 0;
  std::uint16_t fd_count = 0;
  std::uint16_t flags = 0;
  std::uint16_t batch_fds = 0;  // with kFdFlagBatchHead: the fds of the whole batch
  bool memfd_body() const { return (flags & kFdFlagMemfdBody) != 0; }
  bool batch_head() const { return (flags & kFdFlagBatchHead) != 0; }
  bool memfd_range() const { return (flags & kFdFlagMemfdRange) != 0; }
};

std::array<std::uint8_t, kFdPrefixSize> encode_fd_prefix(const FdPrefix& p);
// Reads the prefix of an SF payload; nullopt (and `error`) if it is malformed.
// `batches`, `ranges`: whether this side announced kFlagFdBatches and
// kFlagMemfdRanges (a batch head, a memfd range, is a protocol error otherwise).
std::optional<FdPrefix> decode_fd_prefix(const Payload& data, std::string& error, bool batches = false,
                                         bool ranges = false);
// The payload without its first `n` bytes, sharing the same owners.
Payload drop_front(const Payload& data, std::size_t n);

namespace fdreason {
inline constexpr std::string_view kFdsLost = "receiver out of file descriptors";
inline constexpr std::string_view kFdBudgetSpent = "fd budget spent";
inline constexpr std::string_view kFdsUnsupported = "peer cannot take file descriptors";
inline constexpr std::string_view kTooManyFds = "too many file descriptors";
inline constexpr std::string_view kSendFailed = "cannot send file descriptors";
inline constexpr std::string_view kBadMemfd = "refused memfd payload";
// The same text as reason::kTooLarge (router/reasons.h), for a body too large
// for the 32-bit length field or the stream's maximum.
inline constexpr std::string_view kTooLarge = "message too large";
}  // namespace fdreason

}  // namespace spindle
