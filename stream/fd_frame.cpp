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

std::optional<FdPrefix> decode_fd_prefix(const Payload& data, std::string& error, bool batches) {
  if (data.size() < kFdPrefixSize) {
    error = fmt::format("SF frame of {} bytes is shorter than its {}-byte prefix", data.size(),
                        kFdPrefixSize);
    return std::nullopt;
  }
  std::uint8_t raw[kFdPrefixSize];
  std::size_t got = 0;
  for (const Slice& s : data.slices()) {
    for (std::size_t i = 0; i < s.size && got < kFdPrefixSize; ++i) raw[got++] = s.data[i];
    if (got == kFdPrefixSize) break;
  }
  FdPrefix p{be::get16(raw), be::get16(raw + 2), be::get16(raw + 4), be::get16(raw + 6)};
  const std::uint16_t known = kFdFlagMemfdBody | (batches ? kFdFlagBatchHead : 0);
  if (!is_known_enc(p.inner_enc) || p.inner_enc == kEncFds)
    error = fmt::format("SF frame with bad inner enc 0x{:04x}", p.inner_enc);
  else if (p.fd_count == 0 || p.fd_count > kMaxFdsPerMessage)
    error = fmt::format("SF frame declares {} fds (1..{} allowed)", p.fd_count, kMaxFdsPerMessage);
  else if ((p.flags & ~known) != 0 || (!p.batch_head() && p.batch_fds != 0))
    error = fmt::format("SF frame with unknown flags 0x{:04x} / batch_fds 0x{:04x}", p.flags, p.batch_fds);
  else if (p.batch_head() && (p.batch_fds < p.fd_count || p.batch_fds > kMaxFdsPerMessage))
    error = fmt::format("SF batch head of {} fds says its batch holds {} ({}..{} allowed)", p.fd_count,
                        p.batch_fds, p.fd_count, kMaxFdsPerMessage);
  else if (p.memfd_body() && data.size() != kFdPrefixSize)
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
