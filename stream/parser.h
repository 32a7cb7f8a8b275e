// FrameParser: finds frames in received bytes.
//
// It owns no socket. The stream asks it where the next read should land
// (read_target), reports how many bytes arrived (commit), then calls next()
// until it stops returning kComplete. next() validates enc and length from the
// 26 header bytes alone, before buffering any of the body, and says how many
// bytes it consumed.
//
// A complete frame is handed out as an InFrame: a view of the frame where it
// lies, valid until the next call. The listener decides what it costs: take()
// turns it into a Message whose payload shares the receive chunk (no copy, no
// allocation), a router copies a small frame straight into another stream's
// output queue (for_each_body_span), and a frame nobody took is dropped.
//
// Bodies up to kDirectBodyThreshold are taken as slices of the 128 KiB receive
// chunks. A larger body gets one buffer of exactly its size, charged to the
// peer's account, and reads go straight into it: a 1 GiB message costs 1 GiB,
// not 2, and a partial one no more than what has arrived.
//
// The whole body is charged before its buffer is made. A trusted peer is
// charged however much it holds (back-pressure follows). An untrusted one
// (PeerCharge::kWithinLimits) must fit its allowance: when the body does not
// fit yet, next() consumes nothing and says so (ParseResult::memory_wait);
// the stream stops reading until a release, and asks again.
//
// Thread safety: owned by one Stream; broker thread only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "spindle/message.h"
#include "stream/account.h"
#include "stream/rx_buffer.h"

namespace spindle {

// Bodies from this size on get a buffer of their own (read into directly);
// smaller ones are slices of the receive chunks.
inline constexpr std::size_t kDirectBodyThreshold = 64 * 1024;

enum class ParseStatus { kComplete, kNeedMore, kInvalid };

struct ParseResult {
  ParseStatus status = ParseStatus::kNeedMore;
  std::size_t consumed = 0;  // bytes taken off the input by this call
  std::string error;         // set when kInvalid
  Header header;             // the offending header when kInvalid (if decoded)
  bool header_valid = false;
  // kNeedMore only: a large body's header is in, and its size does not fit
  // the peer's allowance now (PeerCharge::kWithinLimits). Nothing was
  // consumed; the account calls its relief at its next release.
  bool memory_wait = false;
};

class FrameParser;

// One complete frame, where it lies. Valid until the parser's next call.
class InFrame {
 public:
  Header header;  // decoded; a router may rewrite ids before passing it on
  std::size_t body_size() const { return size_; }
  // The frame as a Message; its payload shares the receive buffer.
  Message take();
  bool taken() const { return taken_; }
  // fn(const std::uint8_t*, std::size_t) for each contiguous span of the body.
  template <class F>
  void for_each_body_span(F&& fn) const;

 private:
  friend class FrameParser;
  FrameParser* parser_ = nullptr;
  std::size_t size_ = 0;
  bool direct_ = false;  // the body is the parser's direct body buffer
  bool taken_ = false;
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

  // kComplete: `out` is the next frame, valid until the next call; it is
  // consumed (dropped unless taken) by that call.
  ParseResult next(InFrame& out);
  // The same, taking the frame as a Message.
  ParseResult next(Message& out);
  // Consumes the frame handed out last (dropped unless taken); the caller
  // calls it before its InFrame goes away.
  void finish() { finish_pending(); }

  std::uint32_t max_message_size() const { return max_message_size_; }
  // Bytes received and not yet reported as consumed.
  std::size_t buffered() const { return rx_.readable() + body_filled_ - body_reported_; }
  // Bytes of a frame not yet complete are held (what EOF would cut short).
  bool partial() const { return rx_.readable() > 0 || in_body_; }
  std::size_t partial_bytes() const { return rx_.readable() + body_filled_; }
  // A frame's body is being received and is not complete yet.
  bool body_wants_bytes() const;
  // Large bodies are charged here as they are allocated (may be null).
  void set_account(std::shared_ptr<Account> a, PeerCharge how = PeerCharge::kAlways) {
    account_ = std::move(a);
    charge_ = how;
  }
  // Large bodies begun so far: tells one body under way from the next.
  std::uint64_t bodies_begun() const { return bodies_begun_; }
  // The body under way (body_wants_bytes()): its size and what has arrived.
  std::size_t body_size() const { return pending_.length; }
  std::size_t body_filled() const { return body_filled_; }

 private:
  friend class InFrame;
  Header peek_header() const;  // needs rx_.readable() >= kHeaderSize
  bool wants_direct_body(const Header& h) const;
  bool reserve_body(const Header& h);
  std::size_t begin_direct_body(const Header& h);
  ParseResult next_frame(InFrame& out);
  void finish_pending();  // drops the frame handed out last, unless taken
  Message take(InFrame& f);

  RxBuffer& rx_;
  std::uint32_t max_message_size_;
  std::shared_ptr<Account> account_;
  PeerCharge charge_ = PeerCharge::kAlways;
  std::uint64_t bodies_begun_ = 0;
  // Direct-body state: a header has been consumed and its body is being read
  // into body_ (body_filled_ of pending_.length bytes so far).
  bool in_body_ = false;
  Header pending_;
  std::shared_ptr<Chunk> body_;
  std::size_t body_filled_ = 0;
  std::size_t body_reported_ = 0;        // of body_filled_, reported as consumed
  std::size_t unreported_consumed_ = 0;  // consumed by feed(), reported by next()
  InFrame* out_ = nullptr;               // the frame handed out, not yet consumed
};

template <class F>
void InFrame::for_each_body_span(F&& fn) const {
  if (size_ == 0) return;
  if (direct_) return fn(static_cast<const std::uint8_t*>(parser_->body_->data()), size_);
  parser_->rx_.visit(kHeaderSize, size_, fn);
}

}  // namespace spindle
