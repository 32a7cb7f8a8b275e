// Seqlock: the per-slot lock word of a SlotBuffer, living in shared memory.
//
// Role: one 64-bit word per slot is both the seqlock sequence and the writer
// exclusion: the high 32 bits count writes (odd while a writer is inside),
// the low 32 bits hold the writing process's pid (0 when free). A writer
// takes the slot with one CAS (even/0 -> odd/pid) and publishes with one
// release store (odd/pid -> next even/0). Readers never write the word: they
// copy the slot between two loads of it and retry when it changed. No fd, no
// kernel object: a million slots cost a million words.
//
// The data bytes are copied as 64-bit atomic words (release stores, acquire
// loads), which on x86-64 compile to plain moves. That makes the seqlock
// race-free under the C++ memory model (no fences that ThreadSanitizer cannot
// model): a reader whose load sees any byte of a newer write also sees the
// newer lock word on its second load, and retries.
//
// Because the owner's pid sits in the word, a waiter that has waited out its
// bound can tell a slow writer from a dead one (owner_alive()).
//
// Thread safety: free functions over words in shared memory; any thread of
// any process that maps the buffer. Ownership: none; the words belong to the
// mapping.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>

namespace spindle::shm::seqlock {

constexpr std::uint32_t seq_of(std::uint64_t word) { return static_cast<std::uint32_t>(word >> 32); }
constexpr pid_t owner_of(std::uint64_t word) { return static_cast<pid_t>(word & 0xffffffffu); }
constexpr std::uint64_t make_word(std::uint32_t seq, pid_t owner) {
  return (std::uint64_t{seq} << 32) | static_cast<std::uint32_t>(owner);
}
constexpr bool is_locked(std::uint64_t word) { return (seq_of(word) & 1u) != 0; }
// Sequence 0 means "never written"; wrapping skips it so it stays unique.
constexpr std::uint32_t next_even(std::uint32_t odd_seq) {
  std::uint32_t next = odd_seq + 1;
  return next == 0 ? 2 : next;
}

inline std::atomic_ref<std::uint64_t> word_ref(std::uint64_t& w) { return std::atomic_ref<std::uint64_t>(w); }

// How long a reader or writer waits for a slot held by another writer before
// it reports the slot busy (or abandoned): a few spins, then yields until a
// deadline. Never unbounded.
struct WaitBound {
  std::uint32_t spins = 128;
  std::chrono::microseconds yield_for{2000};
};

// One waiter's progress through its WaitBound. next() returns false once the
// bound is used up.
class Backoff {
 public:
  explicit Backoff(const WaitBound& bound) : bound_(bound) {}
  bool next();
  void restart() { *this = Backoff(bound_); }

 private:
  WaitBound bound_;
  std::uint32_t spins_ = 0;
  std::chrono::steady_clock::time_point deadline_{};
};

// This process's pid, cached (reset in a forked child by a pthread_atfork
// handler, so a child never locks a slot under its parent's pid).
pid_t self_pid();

// False only when `pid` is certainly gone: no such process, or a zombie (it
// died and nobody has reaped it yet). A process we may not signal, or whose
// state cannot be read, counts as alive: a slot is never stolen on a guess.
bool owner_alive(pid_t pid);

// Copies between private bytes and shared 64-bit words. `n` bytes; the
// shared side is 8-byte aligned and has room for n rounded up to 8.
void store_words(std::uint64_t* shared, const std::byte* src, std::size_t n);
void load_words(const std::uint64_t* shared, std::byte* dst, std::size_t n);

}  // namespace spindle::shm::seqlock
