// Chunk: a receive buffer that payloads point into (see <spindle/payload.h>).
//
// Thread safety: written only before it is shared; read from any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "spindle/payload.h"
#include "stream/account.h"

namespace spindle {

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

}  // namespace spindle
