// Payload: a message body held as a chain of reference-counted slices.
//
// Received bytes land in 128 KiB chunks; a payload points into those chunks
// instead of copying them out, and a large body is read straight into one
// buffer of exactly its size. Either way a message costs its own size once:
// nothing here ever joins slices into a second copy unless the caller asks
// for one (to_string / copy_to).
//
// Most payloads are one or two slices: those are held inline, so building
// one allocates nothing but its bytes.
//
// Thread safety: a Payload is immutable once built and may be read from any
// thread; the bytes it points into are never written in the ranges it holds.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace spindle {

class Chunk;        // a receive buffer (internal)
class SealedMemfd;  // a sealed memory file (internal)

struct Slice {
  // Keeps the bytes alive (a Chunk, or a byte array). Null only in a
  // transient view of the caller's memory, which must be copied (owned_copy)
  // before it outlives the call that made it.
  std::shared_ptr<const void> owner;
  const std::uint8_t* data = nullptr;
  std::size_t size = 0;
};

// Where some of a payload's bytes sit in a sealed memfd: bytes [at, at +
// length) of the payload are bytes [offset, offset + length) of `memfd`. A
// stream to a peer that takes fds passes the fd for that range and sends the
// rest of the payload inline, so bytes received in a memfd and sent on inside
// a larger message (a reply that wraps them, say) are never copied.
struct MemfdSpan {
  std::shared_ptr<const SealedMemfd> memfd;
  std::size_t at = 0, offset = 0, length = 0;
  bool whole = false;  // the payload is exactly the whole memfd (set_memfd_span() works it out)
};

class Payload {
 public:
  Payload() = default;
  Payload(Payload&& o) noexcept { take(std::move(o)); }
  Payload& operator=(Payload&& o) noexcept {
    if (this != &o) {
      clear();
      take(std::move(o));
    }
    return *this;
  }
  Payload(const Payload& o) { copy(o); }
  Payload& operator=(const Payload& o) {
    if (this != &o) {
      clear();
      copy(o);
    }
    return *this;
  }
  ~Payload() = default;

  static Payload copy_of(std::string_view bytes);
  static Payload copy_of(std::span<const std::uint8_t> bytes);
  // One slice over the first `size` bytes of `chunk` (internal).
  static Payload adopt(std::shared_ptr<const Chunk> chunk, std::size_t size);

  void append(Slice s);
  std::size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  std::span<const Slice> slices() const {
    return count_ <= kInline ? std::span<const Slice>(inline_, count_)
                             : std::span<const Slice>(spill_.data(), spill_.size());
  }

  // Explicit copies, for small payloads and for callers that need contiguity.
  std::string to_string() const;
  Payload owned_copy() const;  // one owned buffer holding the same bytes
  void copy_to(std::uint8_t* out) const;
  // The bytes without a copy, when they already sit in one slice.
  std::span<const std::uint8_t> contiguous() const;

  // Set when the bytes are a mapping of exactly this sealed memfd (a fabric
  // PayloadBuffer, or a memfd body received): a stream to a peer that takes
  // fds then passes the fd instead of the bytes. Null when only a range of
  // the payload sits in a memfd (memfd_span()).
  std::shared_ptr<const SealedMemfd> memfd() const {
    return span_ && span_->whole && span_->length == size_ ? span_->memfd : nullptr;
  }
  void set_memfd(std::shared_ptr<const SealedMemfd> m) { set_memfd_span(MemfdSpan{std::move(m), 0, 0, size_}); }
  // The range of the payload that sits in a memfd, whole or in part (its
  // memfd is null when none does). set_memfd_span() is the library's: the
  // caller vouches that the span's bytes are those of the memfd's range.
  const MemfdSpan& memfd_span() const { return span_ ? *span_ : kNoSpan; }
  void set_memfd_span(MemfdSpan s);

 private:
  static constexpr std::size_t kInline = 2;
  void take(Payload&& o) noexcept {
    for (std::size_t i = 0; i < kInline; ++i) inline_[i] = std::move(o.inline_[i]);
    spill_ = std::move(o.spill_);
    count_ = o.count_;
    size_ = o.size_;
    span_ = std::move(o.span_);
    o.spill_.clear();
    o.count_ = 0;
    o.size_ = 0;
  }
  void copy(const Payload& o) {
    for (std::size_t i = 0; i < kInline; ++i) inline_[i] = o.inline_[i];
    spill_ = o.spill_;
    count_ = o.count_;
    size_ = o.size_;
    span_ = o.span_;
  }
  void clear() noexcept {
    for (auto& s : inline_) s = Slice{};
    spill_.clear();
    count_ = 0;
    size_ = 0;
    span_.reset();
  }

  // Up to kInline slices live in inline_; past that, all of them in spill_.
  Slice inline_[kInline];
  std::vector<Slice> spill_;
  std::size_t count_ = 0;
  std::size_t size_ = 0;
  // Out of line: only a large payload has one, and every small message
  // moves its Payload several times on the way.
  std::shared_ptr<const MemfdSpan> span_;
  static inline const MemfdSpan kNoSpan{};
};

}  // namespace spindle
