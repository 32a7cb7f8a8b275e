// SectionGate: short sections that any thread enters, and a closer that shuts
// the gate and waits until no thread is inside.
//
// Role: what keeps an object alive and accepting while another thread is
// half-way through using it: a Context's operation on its Router (the
// RouterLink), a producer's push onto a broker's queues (the ProducerGuard).
// Such a section runs on every send and every call, so entering and leaving
// cost no atomic read-modify-write and write no cache line that another
// thread reads in steady state. Each thread marks its own slot with plain
// stores; the closer, which runs once in the object's life, pays for the
// ordering with one membarrier(2) (MEMBARRIER_CMD_PRIVATE_EXPEDITED), which
// makes every running thread of the process pass a full barrier: either a
// thread's mark reaches the closer's scan, or that thread sees the gate
// closed (an asymmetric Dekker, as liburcu's membarrier flavour does). Where
// membarrier is refused (a seccomp filter, an old kernel), each enter pays a
// fence instead, and the closer one too. A lock-prefixed read-modify-write
// per enter and leave cost a sender about 20 ns each on the 2-vCPU guest
// (bench_core oneway: 210 ns per message with the shared_mutex and the
// producer count, 116 without; DESIGN.md, "Transmit path").
//
// Slots: one per thread that has entered a gate (claimed on first use, given
// back when the thread exits), in a fixed table of 1,024, each a stack of
// seven sections at once (a producer's push inside a Context's operation, a
// handler that sends from inside a send). A thread past those, or past the
// table, counts on the gate's own shared counter, with read-modify-writes:
// correct, only slower. The gate itself is a cache line of its own: every
// enter() reads closed_, and nothing near it should be written.
//
// A bitmap of the owned slots (two cache lines, written only when a thread
// claims or gives back its slot) is what a closer and the fork handler
// visit, not the whole 64 KiB table.
//
// Fork: the child's only thread is the one that forked. The marks of the
// others are cleared in the child, so a closer there never waits for a
// thread that does not exist (the gate's shared counter keeps what those
// threads had on it: past the table only).
//
// Thread safety: every member is safe from any thread. Ownership: a plain
// member of what it guards; it must not be destroyed while a thread is
// inside (close() and wait until empty() first).
#pragma once

#include <atomic>
#include <cstdint>

namespace spindle {

class alignas(64) SectionGate {
 public:
  SectionGate() = default;
  SectionGate(const SectionGate&) = delete;
  SectionGate& operator=(const SectionGate&) = delete;

  // Where enter() put the calling thread's mark: an entry of its slot, the
  // shared counter, or nowhere (refused: the gate is closed).
  using Ticket = int;
  static constexpr Ticket kRefused = -1;
  static constexpr Ticket kShared = -2;

  // Enters, unless the gate is closed. Every ticket but kRefused is given
  // back to leave(), on the same thread.
  Ticket enter() noexcept;
  void leave(Ticket t) noexcept;

  // Refuses every enter() from now on; threads already inside stay.
  void close() noexcept;
  bool closed() const noexcept { return closed_.load(std::memory_order_acquire); }
  // After close(): whether no thread is inside now.
  bool empty() const noexcept;
  // close(), then waits until empty(), napping between looks.
  void close_and_wait() noexcept;

  // enter() for a scope.
  class Scope {
   public:
    explicit Scope(SectionGate& g) noexcept : gate_(g), ticket_(g.enter()) {}
    ~Scope() {
      if (ticket_ != kRefused) gate_.leave(ticket_);
    }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;
    explicit operator bool() const noexcept { return ticket_ != kRefused; }

   private:
    SectionGate& gate_;
    Ticket ticket_;
  };

  // Whether enter() relies on membarrier (false: on a fence of its own).
  static bool asymmetric() noexcept;

 private:
  std::atomic<bool> closed_{false};
  std::atomic<std::uint32_t> shared_{0};
};

}  // namespace spindle
