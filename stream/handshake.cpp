#include "stream/handshake.h"

#include <algorithm>
#include <cstring>

#include <fmt/format.h>

#include "stream/byte_order.h"

namespace spindle {
namespace {

constexpr std::uint8_t kMagicHello[4] = {'S', 'P', 'D', 'L'};
constexpr std::uint8_t kMagicRefusal[4] = {'S', 'P', 'N', 'O'};

void append(std::vector<std::uint8_t>& out, const std::vector<std::uint8_t>& bytes) {
  out.insert(out.end(), bytes.begin(), bytes.end());
}

}  // namespace

std::vector<std::uint8_t> encode_hello(std::uint16_t version, std::uint16_t flags,
                                       std::uint32_t pid, std::uint32_t max_message_size) {
  std::vector<std::uint8_t> v(kMagicHello, kMagicHello + 4);
  be::append16(v, version);
  be::append16(v, flags);
  be::append32(v, pid);
  if (flags & kFlagMaxMessageSize) be::append32(v, max_message_size);
  return v;
}

std::vector<std::uint8_t> encode_welcome(std::uint16_t flags, std::uint32_t your_id,
                                         std::uint32_t server_id, std::uint32_t server_pid,
                                         std::uint32_t max_message_size) {
  std::vector<std::uint8_t> v(kMagicHello, kMagicHello + 4);
  be::append16(v, kProtocolVersion);
  be::append16(v, flags);
  be::append32(v, your_id);
  be::append32(v, server_id);
  be::append32(v, server_pid);
  be::append32(v, max_message_size);
  return v;
}

std::vector<std::uint8_t> encode_refusal(const std::string& reason) {
  std::vector<std::uint8_t> v(kMagicRefusal, kMagicRefusal + 4);
  std::size_t n = std::min(reason.size(), kMaxRefusalReason);
  be::append16(v, static_cast<std::uint16_t>(n));
  v.insert(v.end(), reason.begin(), reason.begin() + static_cast<std::ptrdiff_t>(n));
  return v;
}

std::vector<std::uint8_t> ClientHandshake::greeting() {
  std::uint16_t flags = flags_ | offered_flags_;
  if (max_message_size_ != 0) flags |= kFlagMaxMessageSize;
  return encode_hello(kProtocolVersion, flags, pid_, max_message_size_);
}

HandshakeResult ClientHandshake::consume(RxBuffer& rx, std::vector<std::uint8_t>&) {
  HandshakeResult r;
  if (rx.readable() < 6) return r;
  std::uint8_t head[6];
  rx.peek(head, 6);
  if (std::memcmp(head, kMagicRefusal, 4) == 0) {
    std::size_t len = be::get16(head + 4);
    if (rx.readable() < 6 + len) return r;
    std::string reason(6 + len, '\0');
    rx.read_into(reinterpret_cast<std::uint8_t*>(reason.data()), reason.size());
    r.status = HandshakeStatus::kInvalid;
    r.consumed = 6 + len;
    r.error = "refused by peer: " + reason.substr(6);
    return r;
  }
  if (std::memcmp(head, kMagicHello, 4) != 0) {
    r.status = HandshakeStatus::kInvalid;
    r.error = fmt::format("bad handshake magic {:02x}{:02x}{:02x}{:02x}: peer is not a Spindle server",
                          head[0], head[1], head[2], head[3]);
    return r;
  }
  if (rx.readable() < kWelcomeSize) return r;
  std::uint8_t w[kWelcomeSize];
  rx.read_into(w, kWelcomeSize);
  r.consumed = kWelcomeSize;
  peer_.version = be::get16(w + 4);
  peer_.flags = be::get16(w + 6);
  peer_.local_id = be::get32(w + 8);
  peer_.remote_id = be::get32(w + 12);
  peer_.pid = be::get32(w + 16);
  peer_.max_message_size = be::get32(w + 20);
  if (peer_.version != kProtocolVersion) {
    r.status = HandshakeStatus::kInvalid;
    r.error = fmt::format("unsupported protocol version {} (this side speaks {})", peer_.version,
                          kProtocolVersion);
    return r;
  }
  r.status = HandshakeStatus::kComplete;
  return r;
}

HandshakeResult ServerHandshake::consume(RxBuffer& rx, std::vector<std::uint8_t>& reply) {
  HandshakeResult r;
  if (rx.readable() < kHelloSize) {
    // Reject garbage as soon as the magic is visibly wrong.
    std::size_t n = std::min<std::size_t>(rx.readable(), 4);
    std::uint8_t head[4];
    rx.peek(head, n);
    if (std::memcmp(head, kMagicHello, n) == 0) return r;
  }
  std::uint8_t h[kHelloSize];
  std::size_t have = std::min(rx.readable(), kHelloSize);
  rx.peek(h, have);
  if (std::memcmp(h, kMagicHello, std::min<std::size_t>(have, 4)) != 0) {
    r.status = HandshakeStatus::kInvalid;
    r.error = "bad handshake magic: client is not a Spindle client";
    append(reply, encode_refusal(r.error));
    return r;
  }
  peer_.version = be::get16(h + 4);
  peer_.flags = be::get16(h + 6);
  peer_.pid = be::get32(h + 8);
  if (peer_.version != kProtocolVersion) {
    rx.drop(kHelloSize);
    r.consumed = kHelloSize;
    r.status = HandshakeStatus::kInvalid;
    r.error = fmt::format("unsupported protocol version {} (server speaks {})", peer_.version,
                          kProtocolVersion);
    append(reply, encode_refusal(r.error));
    return r;
  }
  peer_.max_message_size = max_message_size_;
  std::size_t size = kHelloSize;
  if (peer_.flags & kFlagMaxMessageSize) {
    size += kHelloLimitSize;
    if (rx.readable() < size) return r;
    std::uint8_t limit[kHelloSize + kHelloLimitSize];
    rx.peek(limit, size);
    const std::uint32_t announced = be::get32(limit + kHelloSize);
    if (announced == 0) {
      rx.drop(size);
      r.consumed = size;
      r.status = HandshakeStatus::kInvalid;
      r.error = "the hello announces a maximum message size of 0 bytes";
      append(reply, encode_refusal(r.error));
      return r;
    }
    peer_.max_message_size = announced;  // the stream sends at most the lower of the two
  }
  rx.drop(size);
  r.consumed = size;
  Assignment a = assign_(peer_);
  if (auto* reason = std::get_if<std::string>(&a)) {
    r.status = HandshakeStatus::kInvalid;
    r.error = *reason;
    append(reply, encode_refusal(*reason));
    return r;
  }
  peer_.remote_id = std::get<std::uint32_t>(a);
  peer_.local_id = own_id_;
  append(reply, encode_welcome(offered_flags_, peer_.remote_id, own_id_, own_pid_, max_message_size_));
  r.status = HandshakeStatus::kComplete;
  return r;
}

}  // namespace spindle
