#include "stream/parser.h"

#include <algorithm>
#include <cstring>

#include <fmt/format.h>

namespace spindle {

// While a direct body is incomplete, bytes go into it; once it is full (and
// until next() hands it out) further bytes queue up in rx_ behind it.
bool FrameParser::body_wants_bytes() const { return in_body_ && body_filled_ < pending_.length; }

std::span<std::uint8_t> FrameParser::read_target() {
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
    if (is_known_enc(h.enc) && h.length <= max_message_size_ && wants_direct_body(h))
      unreported_consumed_ += begin_direct_body(h);
  }
}

Header FrameParser::peek_header() const {
  std::uint8_t raw[kHeaderSize];
  rx_.peek(raw, kHeaderSize);
  return decode_header(raw);
}

// A large body not yet complete gets a buffer of its own.
bool FrameParser::wants_direct_body(const Header& h) const {
  return h.length >= kDirectBodyThreshold && rx_.readable() - kHeaderSize < h.length;
}

// Consumes the (validated) header and the body bytes buffered so far into one
// buffer of the body's exact size; later reads land there directly. Returns
// the bytes consumed.
std::size_t FrameParser::begin_direct_body(const Header& h) {
  std::size_t body_buffered = rx_.readable() - kHeaderSize;
  rx_.drop(kHeaderSize);
  body_ = std::make_shared<Chunk>(h.length);
  body_filled_ = body_buffered;
  rx_.read_into(body_->data(), body_buffered);
  pending_ = h;
  in_body_ = true;
  return kHeaderSize + body_buffered;
}

ParseResult FrameParser::next(Message& out) {
  ParseResult r = next_frame(out);
  r.consumed += unreported_consumed_;
  unreported_consumed_ = 0;
  return r;
}

ParseResult FrameParser::next_frame(Message& out) {
  ParseResult r;
  if (in_body_) {
    if (body_filled_ < pending_.length) return r;  // kNeedMore
    out.header = pending_;
    out.data = Payload::adopt(std::move(body_), pending_.length);
    in_body_ = false;
    body_filled_ = 0;
    r.status = ParseStatus::kComplete;
    r.consumed = 0;  // the body bytes were consumed as they were read
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
  if (h.length > max_message_size_) {
    r.status = ParseStatus::kInvalid;
    r.error = fmt::format("message too large: {} bytes exceeds the maximum of {}", h.length,
                          max_message_size_);
    return r;
  }

  std::size_t body_buffered = rx_.readable() - kHeaderSize;
  if (body_buffered >= h.length) {
    rx_.drop(kHeaderSize);
    out.header = h;
    out.data = rx_.take(h.length);
    r.status = ParseStatus::kComplete;
    r.consumed = kHeaderSize + h.length;
    return r;
  }
  // Large body: one buffer of its exact size, read into directly. kNeedMore.
  if (wants_direct_body(h)) r.consumed = begin_direct_body(h);
  return r;
}

}  // namespace spindle
