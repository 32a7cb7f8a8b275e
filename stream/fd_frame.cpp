// The SF prefix is fixed-size and validated field by field; anything a peer
// could get wrong (a count of 0 or over 253, unknown flags, a memfd body with
// inline bytes, a batch that cannot hold its own head's fds, a batch_fds
// outside a batch head, a batch head to a side that never announced batches)
// is a protocol error, because fds are bound to frames by count and a wrong
// count would shift every later frame's fds.
#include "stream/fd_frame.h"

#include <fmt/format.h>

#include "stream/byte_order.h"
#include "spindle/fds.h"
#include "spindle/frame.h"

namespace spindle {

std::array<std::uint8_t, kFdPrefixSize> encode_fd_prefix(const FdPrefix& p) {
  std::array<std::uint8_t, kFdPrefixSize> b{};
  be::put16(&b[0], p.inner_enc);
  be::put16(&b[2], p.fd_count);
  be::put16(&b[4], p.flags);
  be::put16(&b[6], p.batch_head() ? p.batch_fds : 0);
  return b;
}

namespace {
// The first n bytes of `data` (n at most 20), which holds at least that many.
void first_bytes(const Payload& data, std::uint8_t* out, std::size_t n) {
  std::size_t got = 0;
  for (const Slice& s : data.slices()) {
    for (std::size_t i = 0; i < s.size && got < n; ++i) out[got++] = s.data[i];
    if (got == n) break;
  }
}
}  // namespace

std::array<std::uint8_t, kMemfdRangeSize> encode_memfd_range(const MemfdRange& r) {
  std::array<std::uint8_t, kMemfdRangeSize> b{};
  be::put64(&b[0], r.offset);
  be::put64(&b[8], r.length);
  be::put32(&b[16], r.at);
  return b;
}

std::optional<MemfdRange> decode_memfd_range(const Payload& inline_bytes, std::uint64_t memfd_size,
                                             std::string& error) {
  if (inline_bytes.size() < kMemfdRangeSize) {
    error = fmt::format("memfd range descriptor of {} bytes (need {})", inline_bytes.size(), kMemfdRangeSize);
    return std::nullopt;
  }
  std::uint8_t raw[kMemfdRangeSize];
  first_bytes(inline_bytes, raw, kMemfdRangeSize);
  MemfdRange r;
  r.offset = be::get64(raw);
  r.length = be::get64(raw + 8);
  r.at = be::get32(raw + 16);
  const std::uint64_t around = inline_bytes.size() - kMemfdRangeSize;
  if (r.length == 0 || r.offset > memfd_size || r.length > memfd_size - r.offset)
    error = fmt::format("memfd range of {} bytes at offset {} is outside the memfd's {} bytes", r.length,
                        r.offset, memfd_size);
  else if (r.at > around)
    error = fmt::format("memfd range placed at byte {} of {} inline bytes", r.at, around);
  if (!error.empty()) return std::nullopt;
  return r;
}

std::optional<FdPrefix> decode_fd_prefix(const Payload& data, std::string& error, bool batches, bool ranges) {
  if (data.size() < kFdPrefixSize) {
    error = fmt::format("SF frame of {} bytes is shorter than its {}-byte prefix", data.size(),
                        kFdPrefixSize);
    return std::nullopt;
  }
  std::uint8_t raw[kFdPrefixSize];
  first_bytes(data, raw, kFdPrefixSize);
  FdPrefix p{be::get16(raw), be::get16(raw + 2), be::get16(raw + 4), be::get16(raw + 6)};
  const std::uint16_t known =
      kFdFlagMemfdBody | (batches ? kFdFlagBatchHead : 0) | (ranges ? kFdFlagMemfdRange : 0);
  if (!is_known_enc(p.inner_enc) || p.inner_enc == kEncFds)
    error = fmt::format("SF frame with bad inner enc 0x{:04x}", p.inner_enc);
  else if (p.fd_count == 0 || p.fd_count > kMaxFdsPerMessage)
    error = fmt::format("SF frame declares {} fds (1..{} allowed)", p.fd_count, kMaxFdsPerMessage);
  else if ((p.flags & ~known) != 0 || (!p.batch_head() && p.batch_fds != 0))
    error = fmt::format("SF frame with unknown flags 0x{:04x} / batch_fds 0x{:04x}", p.flags, p.batch_fds);
  else if (p.batch_head() && (p.batch_fds < p.fd_count || p.batch_fds > kMaxFdsPerMessage))
    error = fmt::format("SF batch head of {} fds says its batch holds {} ({}..{} allowed)", p.fd_count,
                        p.batch_fds, p.fd_count, kMaxFdsPerMessage);
  else if (p.memfd_range() && !p.memfd_body())
    error = "SF frame with a memfd range but no memfd body";
  else if (p.memfd_range() && data.size() < kFdPrefixSize + kMemfdRangeSize)
    error = "SF frame with a memfd range is shorter than its range descriptor";
  else if (p.memfd_body() && !p.memfd_range() && data.size() != kFdPrefixSize)
    error = "SF frame with a memfd body also carries inline bytes";
  if (!error.empty()) return std::nullopt;
  return p;
}

Payload drop_front(const Payload& data, std::size_t n) {
  Payload out;
  for (const Slice& s : data.slices()) {
    if (n >= s.size) {
      n -= s.size;
      continue;
    }
    out.append(Slice{s.owner, s.data + n, s.size - n});
    n = 0;
  }
  return out;
}

}  // namespace spindle
