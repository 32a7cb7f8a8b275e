// Payload: a message body held as a chain of reference-counted slices.
//
// Received bytes land in 128 KiB chunks (see rx_buffer.h); a payload points
// into those chunks instead of copying them out, and a large body is read
// straight into one buffer of exactly its size. Either way a message costs
// its own size once: nothing here ever joins slices into a second copy unless
// the caller asks for one (to_string / copy_to).
//
// Thread safety: a Payload is immutable once built and may be read from any
// thread; the chunks it points into are never written in the ranges it holds.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <boost/container/small_vector.hpp>

#include "stream/account.h"

namespace spindle {

class SealedMemfd;  // shm/memfd.h

// A heap buffer of fixed capacity. Not zero-filled: every byte handed out has
// been written by a read() or a copy first. A chunk that payloads keep alive
// on a peer's behalf (a receive chunk a handler holds on to, a large body)
// carries the charge to that peer's account, released with the chunk.
class Chunk {
 public:
  explicit Chunk(std::size_t capacity)
      : data_(std::make_unique_for_overwrite<std::uint8_t[]>(capacity)), capacity_(capacity) {}
  std::uint8_t* data() { return data_.get(); }
  const std::uint8_t* data() const { return data_.get(); }
  std::size_t capacity() const { return capacity_; }
  // Only while the caller holds the only other reference it knows of (the
  // receive buffer's): set before the chunk is shared further.
  void charge_to(Charge c) { charge_ = std::move(c); }

 private:
  std::unique_ptr<std::uint8_t[]> data_;
  std::size_t capacity_;
  Charge charge_;
};

struct Slice {
  // Keeps the bytes alive (a Chunk, or a byte array). Null only in a
  // transient view of the caller's memory, which must be copied (owned_copy)
  // before it outlives the call that made it.
  std::shared_ptr<const void> owner;
  const std::uint8_t* data = nullptr;
  std::size_t size = 0;
};

class Payload {
 public:
  Payload() = default;
  // noexcept moves, so containers of messages move them rather than copy them
  // when they grow (boost's small_vector does not promise it by itself).
  Payload(Payload&&) noexcept = default;
  Payload& operator=(Payload&&) noexcept = default;
  Payload(const Payload&) = default;
  Payload& operator=(const Payload&) = default;
  static Payload copy_of(std::string_view bytes);
  static Payload copy_of(std::span<const std::uint8_t> bytes);
  // One slice over the first `size` bytes of `chunk`.
  static Payload adopt(std::shared_ptr<const Chunk> chunk, std::size_t size);

  void append(Slice s);
  std::size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  std::span<const Slice> slices() const { return {slices_.data(), slices_.size()}; }

  // Explicit copies, for small payloads and for callers that need contiguity.
  std::string to_string() const;
  Payload owned_copy() const;  // one owned buffer holding the same bytes
  void copy_to(std::uint8_t* out) const;
  // The bytes without a copy, when they already sit in one slice.
  std::span<const std::uint8_t> contiguous() const;

  // Set when the bytes are a mapping of exactly this sealed memfd (a fabric
  // PayloadBuffer, or a memfd body received): a stream to a peer that takes
  // fds then passes the fd instead of the bytes.
  const std::shared_ptr<const SealedMemfd>& memfd() const { return memfd_; }
  void set_memfd(std::shared_ptr<const SealedMemfd> m) { memfd_ = std::move(m); }

 private:
  // Most payloads are one or two slices: keep those inline, no allocation.
  boost::container::small_vector<Slice, 2> slices_;
  std::size_t size_ = 0;
  std::shared_ptr<const SealedMemfd> memfd_;
};

}  // namespace spindle
