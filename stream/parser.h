// FrameParser: turns received bytes into Messages.
//
// It owns no socket. The stream asks it where the next read should land
// (read_target), reports how many bytes arrived (commit), then calls next()
// until it stops returning kComplete. next() validates enc and length from the
// 26 header bytes alone, before buffering any of the body, and says how many
// bytes it consumed.
//
// Bodies up to kDirectBodyThreshold are taken as slices of the 128 KiB receive
// chunks. A larger body gets one buffer of exactly its size, and reads go
// straight into it: a 1 GiB message costs 1 GiB, not 2.
//
// Thread safety: owned by one Stream; broker thread only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "stream/message.h"
#include "stream/rx_buffer.h"

namespace spindle {

inline constexpr std::size_t kDirectBodyThreshold = 256 * 1024;

enum class ParseStatus { kComplete, kNeedMore, kInvalid };

struct ParseResult {
  ParseStatus status = ParseStatus::kNeedMore;
  std::size_t consumed = 0;  // bytes taken off the input by this call
  std::string error;         // set when kInvalid
  Header header;             // the offending header when kInvalid (if decoded)
  bool header_valid = false;
};

class FrameParser {
 public:
  explicit FrameParser(RxBuffer& rx, std::uint32_t max_message_size = kDefaultMaxMessageSize)
      : rx_(rx), max_message_size_(max_message_size) {}

  // Where the next read should put its bytes.
  std::span<std::uint8_t> read_target();
  void commit(std::size_t n);
  // Copies bytes in through read_target/commit (tests, handshake leftovers).
  void feed(std::span<const std::uint8_t> bytes);

  ParseResult next(Message& out);

  std::uint32_t max_message_size() const { return max_message_size_; }
  // Bytes held for a partial message (for stats and memory accounting).
  std::size_t buffered() const { return rx_.readable() + body_filled_; }

 private:
  bool body_wants_bytes() const;
  Header peek_header() const;  // needs rx_.readable() >= kHeaderSize
  bool wants_direct_body(const Header& h) const;
  std::size_t begin_direct_body(const Header& h);
  ParseResult next_frame(Message& out);

  RxBuffer& rx_;
  std::uint32_t max_message_size_;
  // Direct-body state: a header has been consumed and its body is being read
  // into body_ (body_filled_ of pending_.length bytes so far).
  bool in_body_ = false;
  Header pending_;
  std::shared_ptr<Chunk> body_;
  std::size_t body_filled_ = 0;
  std::size_t unreported_consumed_ = 0;  // consumed by feed(), reported by next()
};

}  // namespace spindle
