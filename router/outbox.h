// Outbox: what application threads send, on its way to the broker thread.
//
// Role: a bounded multi-producer, single-consumer ring of variable-size
// records in one preallocated buffer (the shape of Aeron's many-to-one ring).
// A producer reserves space with one compare-and-swap on the tail, writes its
// record (the frame's header fields and, for a small body, the bytes
// themselves) and publishes it by storing the record's length last. The
// broker reads published records in order, routes each, zeroes what it
// consumed and moves the head. No producer takes a lock or allocates; one
// wake-up of the broker covers every record published before it runs.
//
// Records that cannot be bytes (a large payload to send from where it lies,
// fds, a memfd body) carry a Message constructed in place in the ring; the
// consumer moves it out and destroys it.
//
// empty() is exact for ordering: the head moves only after the records before
// it have been routed (their streams marked busy), so a producer that sees an
// empty outbox knows none of its earlier messages is still in transit.
//
// Why not Boost.Lockfree here: its queue holds fixed-size trivially-copyable
// values, so each frame would cost a node from a freelist plus a separate
// buffer for the bytes: two more atomic operations and one more cache line
// per message. bench_queues measures both in one run (docs/DESIGN.md).
//
// Thread safety: push() from any thread; drain() and the consumer side from
// the broker thread only. Ownership: owns its buffer and the Messages in it.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include "spindle/message.h"
#include "spindle/options.h"

namespace spindle {

// The routing facts of one outgoing frame.
struct OutboxRecord {
  Header header;                // src/auth/length are set by the consumer
  std::uint64_t port_serial = 0;  // the stream port the sender charged (0: none)
  std::size_t charged = 0;        // bytes on that port's gauge
  std::uint32_t call_slot = 0;    // an async call to arm a deadline for (0: none)
  std::int64_t deadline_ns = 0;   // its deadline (steady clock, since epoch)
  std::uint32_t inline_len = 0;   // body bytes stored after the record
  bool has_message = false;       // a Message follows instead of bytes
};

class Outbox {
 public:
  explicit Outbox(std::size_t capacity = kDefaultOutboxSize);
  ~Outbox();
  Outbox(const Outbox&) = delete;
  Outbox& operator=(const Outbox&) = delete;

  enum class Push { kOk, kTimeout, kTooLarge };
  // Copies the record and `bytes` in (or moves `msg` in when non-null).
  // Waits for space for at most `timeout` when the ring is full (the clock
  // is read only then).
  Push push(const OutboxRecord& rec, std::span<const std::uint8_t> bytes, Message* msg,
            std::chrono::milliseconds timeout);

  bool empty() const {
    return head_.load(std::memory_order_acquire) == tail_.load(std::memory_order_acquire);
  }
  std::size_t capacity() const { return capacity_; }
  // The largest inline body a record may carry.
  std::size_t max_inline() const { return capacity_ / 4; }

  // Broker thread: calls fn(OutboxRecord&, std::span<const std::uint8_t>,
  // Message*) for each published record in order, then releases them.
  // Returns how many records it handled.
  template <class F>
  std::size_t drain(F&& fn);

 private:
  struct alignas(8) RecHead {
    std::uint32_t length;  // 0 until published (written last)
    std::uint32_t type;
  };
  enum : std::uint32_t { kPad = 1, kFrame = 2 };
  std::uint32_t load_length(std::uint64_t pos) const;
  void publish(std::uint64_t pos, std::uint32_t length);
  void release(std::uint64_t from, std::uint64_t to);  // zero, then move the head

  const std::uint64_t serial_;  // unique in the process: producers' cached heads name it
  std::size_t capacity_;  // a power of two
  std::uint8_t* buf_;
  alignas(64) std::atomic<std::uint64_t> tail_{0};
  alignas(64) std::atomic<std::uint64_t> head_{0};
  std::uint64_t read_ = 0;  // consumer: next record to read (>= head_)
  // Producers waiting for space sleep on this word; the consumer bumps it.
  alignas(64) std::atomic<std::uint32_t> space_seq_{0};
  std::atomic<std::uint32_t> space_waiters_{0};
};

template <class F>
std::size_t Outbox::drain(F&& fn) {
  std::size_t handled = 0;
  std::uint64_t released = read_;
  while (true) {
    std::uint32_t len = load_length(read_);
    if (len == 0) break;
    auto* rh = reinterpret_cast<RecHead*>(buf_ + (read_ & (capacity_ - 1)));
    if (rh->type == kFrame) {
      auto* rec = reinterpret_cast<OutboxRecord*>(rh + 1);
      auto* after = reinterpret_cast<std::uint8_t*>(rec + 1);
      Message* msg = nullptr;
      std::span<const std::uint8_t> bytes;
      if (rec->has_message) msg = reinterpret_cast<Message*>(after);
      else bytes = {after, rec->inline_len};
      fn(*rec, bytes, msg);
      if (msg) msg->~Message();
      ++handled;
    }
    read_ += len;
    // Give space back as we go, so a long batch does not starve producers.
    if (read_ - released >= capacity_ / 4) {
      release(released, read_);
      released = read_;
    }
  }
  if (read_ != released) release(released, read_);
  return handled;
}

}  // namespace spindle
