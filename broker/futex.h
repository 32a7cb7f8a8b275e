// Futex: sleeping on a 32-bit atomic word, with a deadline.
//
// Role: the one sleeping primitive of the send path (a sender waiting for
// queue space) and of blocking calls (a caller waiting for its reply): no fd,
// no mutex, and a waker that wakes exactly the threads sleeping on that word.
// std::atomic::wait would do the same but has no deadline, and libstdc++'s
// spins and yields before it sleeps, which costs a crowd of processes on a
// small machine dearly.
//
// Thread safety: any thread. Ownership: the word belongs to its owner.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

namespace spindle::futex {

// Sleeps while `word` holds `expected`, until `deadline` (steady clock; max()
// for none). Returns on a wake, a change, a signal or the deadline; false
// only when the deadline has passed. The caller re-checks the word.
bool wait(std::atomic<std::uint32_t>& word, std::uint32_t expected,
          std::chrono::steady_clock::time_point deadline);
// Wakes up to `n` threads sleeping on `word`.
void wake(std::atomic<std::uint32_t>& word, int n);

// The deadline `timeout` from now; max() for a year or more (no deadline).
// Read the clock only where a wait really begins: it costs a send path a
// few percent of its CPU.
inline std::chrono::steady_clock::time_point deadline_after(std::chrono::milliseconds timeout) {
  if (timeout >= std::chrono::hours(24 * 365)) return std::chrono::steady_clock::time_point::max();
  return std::chrono::steady_clock::now() + timeout;
}

}  // namespace spindle::futex
