// The dialect is decided by the first byte and never revisited: after it, the
// connection is either a Spindle ServerHandshake (delegated to unchanged, so
// both listeners refuse and welcome Spindle clients identically) or the
// Mitogen exchange below. A Mitogen client cannot parse a refusal, so one it
// may not join is simply closed (its recv() of 12 bytes comes back short and
// mitogen.unix.connect raises ConnectError); the refusal is logged here.
#include "stream/listener_handshake.h"

#include <fmt/format.h>

#include "stream/byte_order.h"

namespace spindle {

std::vector<std::uint8_t> encode_mitogen_reply(std::uint32_t your_id, std::uint32_t listener_id,
                                               std::uint32_t listener_pid) {
  std::vector<std::uint8_t> v;
  be::append32(v, your_id);
  be::append32(v, listener_id);
  be::append32(v, listener_pid);
  return v;
}

ListenerHandshake::ListenerHandshake(std::uint32_t own_id, std::uint32_t own_pid,
                                     std::uint32_t max_message_size,
                                     ServerHandshake::AssignFn assign)
    : own_id_(own_id), own_pid_(own_pid), max_message_size_(max_message_size),
      assign_(std::move(assign)) {}

HandshakeResult ListenerHandshake::consume(RxBuffer& rx, std::vector<std::uint8_t>& reply) {
  if (!spindle_ && !mitogen_) {
    if (rx.readable() == 0) return {};
    std::uint8_t first = 0;
    rx.peek(&first, 1);
    if (first == 'S') {
      spindle_ = std::make_unique<ServerHandshake>(own_id_, own_pid_, max_message_size_, assign_);
      spindle_->offer_flags(offered_flags_);  // e.g. fd passing, offered by the Stream
    } else if (first == 0x00) {
      mitogen_ = true;
    } else {
      HandshakeResult r;
      r.status = HandshakeStatus::kInvalid;
      r.error = fmt::format(
          "first byte 0x{:02x} is neither a Spindle hello ('S') nor a Mitogen pid (0x00)", first);
      auto refusal = encode_refusal(r.error);
      reply.insert(reply.end(), refusal.begin(), refusal.end());
      return r;
    }
  }
  if (mitogen_) return consume_mitogen(rx, reply);
  HandshakeResult r = spindle_->consume(rx, reply);
  peer_ = spindle_->peer();
  return r;
}

HandshakeResult ListenerHandshake::consume_mitogen(RxBuffer& rx, std::vector<std::uint8_t>& reply) {
  HandshakeResult r;
  if (rx.readable() < kMitogenHelloSize) return r;
  std::uint8_t pid[kMitogenHelloSize];
  rx.read_into(pid, kMitogenHelloSize);
  r.consumed = kMitogenHelloSize;
  peer_.dialect = Dialect::kMitogen;
  peer_.pid = be::get32(pid);
  peer_.max_message_size = kMitogenMaxMessageSize;
  ServerHandshake::Assignment a = assign_(peer_);
  if (auto* reason = std::get_if<std::string>(&a)) {
    r.status = HandshakeStatus::kInvalid;
    r.error = *reason;
    return r;
  }
  peer_.remote_id = std::get<std::uint32_t>(a);
  peer_.local_id = own_id_;
  auto welcome = encode_mitogen_reply(peer_.remote_id, own_id_, own_pid_);
  reply.insert(reply.end(), welcome.begin(), welcome.end());
  r.status = HandshakeStatus::kComplete;
  return r;
}

}  // namespace spindle
