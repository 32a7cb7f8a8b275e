// Decoding copies at most the 6-byte header and the two names (bounded by
// 2 x 255 bytes) out of the payload, wherever its slice boundaries fall, and
// validates them before anything else looks at the call.
#include "services/envelope.h"

#include <algorithm>
#include <array>

#include <fmt/format.h>

#include "broker/errors.h"
#include "services/reasons.h"

namespace spindle::services {
namespace {

// Copies up to out.size() bytes of `p` starting at `offset`.
std::size_t copy_range(const Payload& p, std::size_t offset, std::span<std::uint8_t> out) {
  std::size_t copied = 0;
  for (const Slice& s : p.slices()) {
    if (copied == out.size()) break;
    if (offset >= s.size) {
      offset -= s.size;
      continue;
    }
    std::size_t n = std::min(s.size - offset, out.size() - copied);
    std::copy_n(s.data + offset, n, out.data() + copied);
    copied += n;
    offset = 0;
  }
  return copied;
}

std::string name_problem(std::string_view what, std::string_view name) {
  if (name.empty()) return fmt::format("{} name is empty", what);
  if (name.size() > kMaxNameLength)
    return fmt::format("{} name is {} bytes; at most {} allowed", what, name.size(), kMaxNameLength);
  if (name.find('\0') != std::string_view::npos) return fmt::format("{} name holds a NUL byte", what);
  return {};
}

}  // namespace

Payload payload_suffix(const Payload& p, std::size_t offset) {
  Payload out;
  for (const Slice& s : p.slices()) {
    if (offset >= s.size) {
      offset -= s.size;
      continue;
    }
    out.append(Slice{s.owner, s.data + offset, s.size - offset});
    offset = 0;
  }
  return out;
}

Payload encode_call(std::string_view service, std::string_view method, Payload args,
                    std::uint8_t flags) {
  for (auto [what, name] : {std::pair{"service", service}, std::pair{"method", method}}) {
    std::string problem = name_problem(what, name);
    if (!problem.empty()) throw Error(fmt::format("{}: {}", reason::kMalformed, problem));
  }
  std::string head(kEnvelopeHeaderSize, '\0');
  head[0] = static_cast<char>(kEnvelopeVersion);
  head[1] = static_cast<char>(flags);
  head[2] = static_cast<char>(service.size() >> 8);
  head[3] = static_cast<char>(service.size() & 0xff);
  head[4] = static_cast<char>(method.size() >> 8);
  head[5] = static_cast<char>(method.size() & 0xff);
  head.append(service).append(method);
  Payload out = Payload::copy_of(head);
  for (const Slice& s : args.slices()) out.append(s);
  return out;
}

DecodeResult decode_call(const Payload& data) {
  DecodeResult r;
  std::array<std::uint8_t, kEnvelopeHeaderSize> h{};
  if (copy_range(data, 0, h) < h.size()) {
    r.error = fmt::format("{}: {} bytes is shorter than the {}-byte header", reason::kMalformed,
                          data.size(), kEnvelopeHeaderSize);
    return r;
  }
  if (h[0] != kEnvelopeVersion) {
    r.error = fmt::format("{}: {} (this side speaks {})", reason::kUnsupportedVersion, h[0],
                          kEnvelopeVersion);
    return r;
  }
  if ((h[1] & ~kEnvelopeMsgpack) != 0) {
    r.error = fmt::format("{}: unknown flags 0x{:02x}", reason::kMalformed, h[1]);
    return r;
  }
  const std::size_t slen = (std::size_t{h[2]} << 8) | h[3];
  const std::size_t mlen = (std::size_t{h[4]} << 8) | h[5];
  if (slen > kMaxNameLength || mlen > kMaxNameLength) {
    r.error = fmt::format("{}: name lengths {} and {}; at most {} allowed", reason::kMalformed, slen,
                          mlen, kMaxNameLength);
    return r;
  }
  if (data.size() < kEnvelopeHeaderSize + slen + mlen) {
    r.error = fmt::format("{}: names need {} bytes; only {} follow the header", reason::kMalformed,
                          slen + mlen, data.size() - kEnvelopeHeaderSize);
    return r;
  }
  std::string names(slen + mlen, '\0');
  copy_range(data, kEnvelopeHeaderSize,
             {reinterpret_cast<std::uint8_t*>(names.data()), names.size()});
  r.envelope.service = names.substr(0, slen);
  r.envelope.method = names.substr(slen);
  for (auto [what, name] : {std::pair{"service", std::string_view(r.envelope.service)},
                            std::pair{"method", std::string_view(r.envelope.method)}}) {
    std::string problem = name_problem(what, name);
    if (!problem.empty()) {
      r.error = fmt::format("{}: {}", reason::kMalformed, problem);
      return r;
    }
  }
  r.envelope.flags = h[1];
  r.envelope.args = payload_suffix(data, kEnvelopeHeaderSize + slen + mlen);
  return r;
}

}  // namespace spindle::services
