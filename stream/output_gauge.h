// OutputGauge: the high-water mark on one stream's output queue.
//
// Every byte queued for a stream is charged here first and released once it
// is written (or dropped with the stream); so is every fd (kFdCharge).
// Policy, as documented in docs/PROTOCOL.md ("Back-pressure"):
//   - a user thread sending through the router waits while the queue is at or
//     over the mark, up to its deadline, then gets QueueFullError;
//   - the broker thread never waits: a message it would queue over the mark
//     (a forwarded frame) is refused, and its sender gets a dead reply.
// An empty queue always admits one message, so a single message larger than
// the mark still goes through; the queue never grows past mark + one message.
//
// Thread safety: all members are safe from any thread. Shared (shared_ptr)
// between the stream on the broker thread and senders on other threads.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <mutex>

#include "spindle/options.h"

namespace spindle {

// Each fd a queued frame carries is charged as this many bytes. A queued fd
// stays open in this process until its frame is written, and a frame with
// one fd is some 40 bytes: by bytes alone, a sender that outruns its peer
// would run into RLIMIT_NOFILE long before its mark. With the default 8 MiB
// mark, about 1,000 fds wait per stream; then the sender waits, as for bytes.
inline constexpr std::size_t kFdCharge = 8 * 1024;
inline constexpr std::size_t fd_charge(std::size_t fds) { return fds * kFdCharge; }

class OutputGauge {
 public:
  enum class Admit { kOk, kTimeout, kClosed };

  explicit OutputGauge(std::size_t high_water_mark = kDefaultHighWaterMark) : hwm_(high_water_mark) {}

  bool try_acquire(std::size_t n);
  // Always succeeds, even over the mark: for what the broker queues on the
  // peer's own account (dead replies to it, control messages, the rest of a
  // frame a user thread began writing).
  void charge(std::size_t n) { queued_.fetch_add(n, std::memory_order_acq_rel); }
  Admit acquire(std::size_t n, std::chrono::steady_clock::time_point deadline);
  void release(std::size_t n);
  void close();

  std::size_t queued() const { return queued_.load(std::memory_order_relaxed); }
  std::size_t high_water_mark() const { return hwm_; }
  bool closed() const { return closed_.load(std::memory_order_acquire); }

 private:
  const std::size_t hwm_;
  std::atomic<std::size_t> queued_{0};
  std::atomic<int> waiters_{0};
  std::atomic<bool> closed_{false};
  std::mutex mu_;
  std::condition_variable cv_;
};

}  // namespace spindle
