// WakeWord: one 32-bit word a single thread sleeps on, woken by another.
//
// Role: the sleeping primitive of the worker pool and of Select. Each waiter
// sleeps on a word of its own (a Linux futex), so a waker picks exactly which
// thread to wake and no other thread stirs: no thundering herd, and no fd.
// std::atomic::wait would do the same but has no timeout; Select needs one.
//
// Thread safety: wait() by the owning thread only; wake() from any thread.
// Ownership: a plain value, usually on the waiter's stack.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

namespace spindle::services {

class WakeWord {
 public:
  // Sleeps while the word equals `expected`, until `deadline` (steady clock).
  // Returns on a wake, a change of value, a signal or the deadline; the caller
  // re-checks the word. Returns false only when the deadline has passed.
  // With `poll` (a Broker's wait_spin), it first looks at the word, yielding
  // between looks, for up to that long (stretched and backed off by the
  // thread's poll history, broker/poll_history.h): a hand-off that comes
  // within the window costs the waker no FUTEX_WAKE and this thread no
  // wake-up, the dearest part of a hand-off on a VM.
  bool wait(std::uint32_t expected, std::chrono::steady_clock::time_point deadline,
            std::chrono::nanoseconds poll = {});
  // Stores `value` and wakes the thread sleeping on the word, if one is: a
  // waiter that is not asleep (it runs the broker's loop) costs no syscall.
  void set_and_wake(std::uint32_t value);
  std::uint32_t load() const { return word_.load(std::memory_order_seq_cst) & ~kAsleep; }
  // The waiter: sets the word back to 0 if it still holds `value` (a waker
  // may have stored another meanwhile, which stays).
  void clear_if(std::uint32_t value) {
    word_.compare_exchange_strong(value, 0, std::memory_order_seq_cst);
  }
  static bool is_set(const void* word) { return static_cast<const WakeWord*>(word)->load() != 0; }

 private:
  // Set in the word by a waiter about to sleep: the waker learns from the
  // very exchange that stores its value whether anyone needs a FUTEX_WAKE,
  // and never reads the word's memory after the waiter may have left it.
  static constexpr std::uint32_t kAsleep = 1u << 31;
  // wait() looks at the word this many times before it sleeps: after a
  // pause each at first, then after a sched_yield each (libstdc++'s atomic
  // wait spins 12 and 4; bench_services' wake table, docs/DESIGN.md).
  static constexpr int kSpinPauses = 12, kSpinYields = 4;
  std::atomic<std::uint32_t> word_{0};
};

}  // namespace spindle::services
