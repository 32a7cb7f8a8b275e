// Handshake: the small protocol a connection speaks before it carries frames.
//
// The connecting side (a child, or a client of spindle-router) sends a 16-byte
// hello (12 without kFlagMaxMessageSize, as older clients send it); the
// accepting side answers with a 24-byte welcome that assigns the client its
// context id, or with a refusal that says why. Bytes that follow the
// handshake stay in the stream's RxBuffer and become the message protocol's
// first input: the live connection is handed over without losing a byte.
//
//   hello   (client -> server, 16 bytes): "SPDL" version:u16 flags:u16 pid:u32
//            [max_message_size:u32, present when flags has kFlagMaxMessageSize]
//   welcome (server -> client, 24 bytes): "SPDL" version:u16 flags:u16
//            your_id:u32 server_id:u32 server_pid:u32 max_message_size:u32
//   refusal (server -> client): "SPNO" length:u16 reason:bytes[length]
//
// All integers are big-endian. A Mitogen client's first byte is always 0x00
// (its 4-byte pid is < 2^22), a Spindle hello's is 'S': the two dialects can
// share one listening socket.
//
// Each object is driven by its Stream on the broker thread; consume() never
// blocks, it returns complete, need-more or invalid and how much it consumed.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <variant>
#include <vector>

#include "stream/rx_buffer.h"

namespace spindle {

inline constexpr std::uint16_t kProtocolVersion = 1;
inline constexpr std::size_t kHelloSize = 12;  // without the optional limit
inline constexpr std::size_t kHelloLimitSize = 4;
inline constexpr std::size_t kWelcomeSize = 24;
inline constexpr std::size_t kMaxRefusalReason = 1024;

enum HandshakeFlag : std::uint16_t {
  kFlagNone = 0,
  kFlagFdPassing = 1,  // this side takes fds (SCM_RIGHTS); only on a UNIX socket
  // This side binds fds by count, so one sendmsg may carry the fds of several
  // SF frames (fd_frame.h); offered with kFlagFdPassing. Used only when both
  // sides announce it: an older peer ignores the bit.
  kFlagFdBatches = 2,
  // Hello only: the client's maximum payload length follows the pid, so the
  // server sends it nothing larger (a router answers a larger message for it
  // with a dead reply, instead of forwarding what would cost the client its
  // link). A server that predates the bit would read the 4 bytes as a frame:
  // every Spindle server of protocol version 1 since 2026-11-27 knows it.
  kFlagMaxMessageSize = 4,
  // This side reads a memfd body that is a range of its memfd with inline
  // bytes around it (fd_frame.h); offered with kFlagFdPassing. Used only when
  // both sides announce it: an older peer is sent such a body inline.
  kFlagMemfdRanges = 8,
};

// Which protocol the peer speaks. A Mitogen peer exchanges 26-byte frames
// too, but only understands enc "MI" and cannot take file descriptors.
enum class Dialect : std::uint8_t { kSpindle, kMitogen };

// What each side learns about the other.
struct PeerInfo {
  Dialect dialect = Dialect::kSpindle;
  std::uint16_t version = 0;
  std::uint16_t flags = 0;
  std::uint32_t pid = 0;               // the peer's pid
  std::uint32_t local_id = 0;          // our context id (assigned by the server)
  std::uint32_t remote_id = 0;         // the peer's context id
  // The peer's limit: the server's (welcome), or the client's when its hello
  // announced one; otherwise the server's own.
  std::uint32_t max_message_size = 0;
};

enum class HandshakeStatus { kComplete, kNeedMore, kInvalid };

struct HandshakeResult {
  HandshakeStatus status = HandshakeStatus::kNeedMore;
  std::size_t consumed = 0;
  std::string error;
};

class Handshake {
 public:
  virtual ~Handshake() = default;
  // Bytes to send as soon as the connection starts (empty for the server).
  virtual std::vector<std::uint8_t> greeting() = 0;
  // Consumes handshake bytes from rx. May append bytes to send to `reply`
  // (sent even when the result is kInvalid: a refusal explains itself).
  virtual HandshakeResult consume(RxBuffer& rx, std::vector<std::uint8_t>& reply) = 0;
  const PeerInfo& peer() const { return peer_; }
  // Adds flags this side announces (hello or welcome); the stream offers
  // kFlagFdPassing on a socket transport.
  void offer_flags(std::uint16_t flags) { offered_flags_ |= flags; }

 protected:
  PeerInfo peer_;
  std::uint16_t offered_flags_ = kFlagNone;
};

// The connecting side.
class ClientHandshake final : public Handshake {
 public:
  // A nonzero max_message_size is announced in the hello (kFlagMaxMessageSize).
  explicit ClientHandshake(std::uint32_t pid, std::uint16_t flags = kFlagNone,
                           std::uint32_t max_message_size = 0)
      : pid_(pid), flags_(flags), max_message_size_(max_message_size) {}
  std::vector<std::uint8_t> greeting() override;
  HandshakeResult consume(RxBuffer& rx, std::vector<std::uint8_t>& reply) override;

 private:
  std::uint32_t pid_;
  std::uint16_t flags_;
  std::uint32_t max_message_size_;
};

// The accepting side. `assign` sees the client's hello and returns the id to
// give it, or a refusal reason.
class ServerHandshake final : public Handshake {
 public:
  using Assignment = std::variant<std::uint32_t, std::string>;
  using AssignFn = std::function<Assignment(const PeerInfo& hello)>;

  ServerHandshake(std::uint32_t own_id, std::uint32_t own_pid, std::uint32_t max_message_size,
                  AssignFn assign)
      : own_id_(own_id), own_pid_(own_pid), max_message_size_(max_message_size),
        assign_(std::move(assign)) {}
  std::vector<std::uint8_t> greeting() override { return {}; }
  HandshakeResult consume(RxBuffer& rx, std::vector<std::uint8_t>& reply) override;

 private:
  std::uint32_t own_id_;
  std::uint32_t own_pid_;
  std::uint32_t max_message_size_;
  AssignFn assign_;
};

// Encoders, shared with tests and independent clients.
// The limit is appended when flags has kFlagMaxMessageSize.
std::vector<std::uint8_t> encode_hello(std::uint16_t version, std::uint16_t flags,
                                       std::uint32_t pid, std::uint32_t max_message_size = 0);
std::vector<std::uint8_t> encode_welcome(std::uint16_t flags, std::uint32_t your_id,
                                         std::uint32_t server_id, std::uint32_t server_pid,
                                         std::uint32_t max_message_size);
std::vector<std::uint8_t> encode_refusal(const std::string& reason);

}  // namespace spindle
