// A frame handed out stays in the receive buffer until the parser's next
// call: the listener may look at it, copy it onward or take it, and only then
// are its bytes dropped (an untaken frame costs no Payload at all).
#include "stream/parser.h"

#include <algorithm>
#include <cstring>

#include <fmt/format.h>

#include "stream/fd_frame.h"

namespace spindle {

namespace {
// An SF frame carries its 8-byte fd prefix in front of a body that may itself
// be the largest allowed: the sender checks the body, not the frame (a body
// within 8 bytes of the maximum, sent inline with fds, closed the link).
bool within_max(const Header& h, std::uint64_t max) {
  return h.length <= max + (h.enc == kEncFds ? kFdPrefixSize : 0);
}
}  // namespace

// While a direct body is incomplete, bytes go into it; once it is full (and
// until next() hands it out) further bytes queue up in rx_ behind it.
bool FrameParser::body_wants_bytes() const { return in_body_ && body_filled_ < pending_.length; }

std::span<std::uint8_t> FrameParser::read_target() {
  finish_pending();
  if (body_wants_bytes()) return {body_->data() + body_filled_, pending_.length - body_filled_};
  return rx_.write_space();
}

void FrameParser::commit(std::size_t n) {
  if (body_wants_bytes()) {
    body_filled_ += n;
  } else {
    rx_.commit(n);
  }
}

void FrameParser::feed(std::span<const std::uint8_t> bytes) {
  finish_pending();
  while (!bytes.empty()) {
    auto dst = read_target();
    std::size_t n = std::min(dst.size(), bytes.size());
    std::memcpy(dst.data(), bytes.data(), n);
    commit(n);
    bytes = bytes.subspan(n);
    // Switch to the direct body as soon as its header is in, as a stream does
    // between reads; next() reports the bytes this consumed.
    if (in_body_ || rx_.readable() < kHeaderSize) continue;
    Header h = peek_header();
    if (is_known_enc(h.enc) && within_max(h, max_message_size_) && wants_direct_body(h) &&
        reserve_body(h))
      unreported_consumed_ += begin_direct_body(h);
  }
}

// In place when the header does not straddle two chunks: copied out piece
// by piece and decoded, every field's load waited for the copy's stores.
Header FrameParser::peek_header() const {
  if (const std::uint8_t* p = rx_.front(kHeaderSize)) return decode_header(p);
  std::uint8_t raw[kHeaderSize];
  rx_.peek(raw, kHeaderSize);
  return decode_header(raw);
}

// A large body not yet complete gets a buffer of its own.
bool FrameParser::wants_direct_body(const Header& h) const {
  return h.length >= kDirectBodyThreshold && rx_.readable() - kHeaderSize < h.length;
}

// Charges the whole body before its buffer exists. An untrusted peer's body
// must fit its allowance (its own limit and the global one) now; charged
// regardless, a header alone would make the router hold (or promise) up to
// the maximum message size, and every client could send one. A body that
// fits at once asks for no relief (reserve() would wake every paused link at
// the next release, for each large body).
bool FrameParser::reserve_body(const Header& h) {
  if (!account_) return true;
  if (charge_ == PeerCharge::kAlways) {
    account_->charge(h.length);
    return true;
  }
  return account_->try_charge_within(h.length) || account_->reserve(h.length);
}

// Consumes the (validated) header and the body bytes buffered so far into one
// buffer of the body's exact size, charged to the peer (reserve_body); later
// reads land there directly. Returns the bytes consumed.
std::size_t FrameParser::begin_direct_body(const Header& h) {
  std::size_t body_buffered = rx_.readable() - kHeaderSize;
  rx_.drop(kHeaderSize);
  body_ = std::make_shared<Chunk>(h.length);
  if (account_) body_->charge_to(Charge(account_, h.length));
  ++bodies_begun_;
  body_filled_ = body_reported_ = body_buffered;
  rx_.read_into(body_->data(), body_buffered);
  pending_ = h;
  in_body_ = true;
  return kHeaderSize + body_buffered;
}

void FrameParser::finish_pending() {
  InFrame* f = std::exchange(out_, nullptr);
  if (!f) return;
  if (f->direct_) {
    body_.reset();
    in_body_ = false;
    body_filled_ = body_reported_ = 0;
  } else if (!f->taken_) {
    rx_.drop(kHeaderSize + f->size_);
  }
}

Message InFrame::take() { return parser_->take(*this); }

Message FrameParser::take(InFrame& f) {
  Message m;
  m.header = f.header;
  if (f.taken_) return m;  // taken twice: the second one is empty
  f.taken_ = true;
  if (f.direct_) {
    m.data = Payload::adopt(std::move(body_), f.size_);
  } else {
    rx_.drop(kHeaderSize);
    m.data = rx_.take(f.size_);
  }
  return m;
}

ParseResult FrameParser::next(InFrame& out) {
  finish_pending();
  ParseResult r = next_frame(out);
  r.consumed += unreported_consumed_;
  unreported_consumed_ = 0;
  if (r.status == ParseStatus::kComplete) out_ = &out;
  return r;
}

ParseResult FrameParser::next(Message& out) {
  InFrame f;
  ParseResult r = next(f);
  if (r.status == ParseStatus::kComplete) {
    out = f.take();
    finish_pending();
  }
  return r;
}

ParseResult FrameParser::next_frame(InFrame& out) {
  ParseResult r;
  out.parser_ = this;
  out.taken_ = false;
  if (in_body_) {
    if (body_filled_ < pending_.length) return r;  // kNeedMore
    out.header = pending_;
    out.size_ = pending_.length;
    out.direct_ = true;
    r.status = ParseStatus::kComplete;
    r.consumed = pending_.length - body_reported_;  // read straight into the body
    r.header = pending_;
    r.header_valid = true;
    return r;
  }
  if (rx_.readable() < kHeaderSize) return r;

  Header h = peek_header();
  r.header = h;
  if (!is_known_enc(h.enc)) {
    r.status = ParseStatus::kInvalid;
    r.error = fmt::format("bad magic 0x{:04x}: not a Spindle or Mitogen frame", h.enc);
    return r;
  }
  r.header_valid = true;
  if (!within_max(h, max_message_size_)) {
    r.status = ParseStatus::kInvalid;
    r.error = fmt::format("message too large: {} bytes exceeds the maximum of {}", h.length,
                          max_message_size_);
    return r;
  }

  std::size_t body_buffered = rx_.readable() - kHeaderSize;
  if (body_buffered >= h.length) {
    out.header = h;
    out.size_ = h.length;
    out.direct_ = false;
    r.status = ParseStatus::kComplete;
    r.consumed = kHeaderSize + h.length;
    return r;
  }
  // Large body: one buffer of its exact size, read into directly. kNeedMore.
  if (wants_direct_body(h)) {
    if (reserve_body(h)) r.consumed = begin_direct_body(h);
    else r.memory_wait = true;
  }
  return r;
}

}  // namespace spindle
