// ListenerHandshake: the accepting side of a socket that two dialects share.
//
// spindle-router's UNIX socket serves Spindle clients (an "SPDL" hello, see
// handshake.h) and stock Mitogen 0.3 clients (mitogen.unix.connect: the
// client writes its pid as 4 big-endian bytes and reads back 12 bytes: its new
// context id, the listener's id and the listener's pid). The first byte tells
// them apart without ambiguity: a Spindle hello starts with 'S' (0x53), and a
// Mitogen pid is below 2^22, so its first byte is 0x00. Anything else is
// refused at once, before a second byte arrives.
//
// Like every Handshake it only consumes what the buffer already holds: a
// client that sends nothing costs a pending read and a timer, never a blocked
// broker (Mitogen's listener reads the pid in blocking mode on its only
// thread, so one silent client stalls every other).
//
// Thread safety: driven by its Stream on the broker thread.
// Ownership: owned by the Stream; owns the Spindle handshake it delegates to.
#pragma once

#include <memory>

#include "stream/handshake.h"

namespace spindle {

inline constexpr std::size_t kMitogenHelloSize = 4;   // >L pid
inline constexpr std::size_t kMitogenReplySize = 12;  // >LLL your_id, listener_id, listener_pid
// A Mitogen peer does not announce its maximum; this is Mitogen's default
// (Router.max_message_size), over which its stream disconnects. A router
// configured larger sends a Mitogen client nothing above it.
inline constexpr std::uint32_t kMitogenMaxMessageSize = 128u << 20;

class ListenerHandshake final : public Handshake {
 public:
  // `assign` sees the client's pid and dialect and returns its id or a refusal.
  ListenerHandshake(std::uint32_t own_id, std::uint32_t own_pid, std::uint32_t max_message_size,
                    ServerHandshake::AssignFn assign);
  std::vector<std::uint8_t> greeting() override { return {}; }
  HandshakeResult consume(RxBuffer& rx, std::vector<std::uint8_t>& reply) override;

 private:
  HandshakeResult consume_mitogen(RxBuffer& rx, std::vector<std::uint8_t>& reply);

  std::uint32_t own_id_;
  std::uint32_t own_pid_;
  std::uint32_t max_message_size_;
  ServerHandshake::AssignFn assign_;
  std::unique_ptr<ServerHandshake> spindle_;  // set once the first byte said 'S'
  bool mitogen_ = false;                      // set once the first byte said 0x00
};

std::vector<std::uint8_t> encode_mitogen_reply(std::uint32_t your_id, std::uint32_t listener_id,
                                               std::uint32_t listener_pid);

}  // namespace spindle
