// CallTable: the pending calls of one router, in reusable slots.
//
// Role: a call takes a slot, sends its request with the slot's handle as
// reply_to, and is completed exactly once: by its reply (or a dead reply or
// CallError), its deadline, its callee's disconnect, or shutdown. Whoever
// moves the slot's word from PENDING to CLAIMED completes it; everyone else
// finds it taken. A slot is reused for the next call, so a call allocates
// neither a promise nor a std::function: a blocking caller runs the loop
// while it is free, or sleeps on the slot's word (a futex), and reads its
// reply from the slot; an asynchronous call's completion is a move-only
// callable stored in the slot.
//
// Handles: reply_to = kCallHandleBit | generation (11 bits) << 20 | index, so
// a late reply to a slot that has since been reused is recognised and
// dropped. Replies are accepted only from the callee (src_id): routers that
// answer for a context that cannot be reached put that context in src_id
// (docs/PROTOCOL.md §7.5), and the reverse-path check stops any other peer
// from claiming it. A third party cannot complete someone else's call.
//
// Two kinds of slot:
//  - blocking: the caller's thread waits, with its own deadline, and may give
//    up (CANCELLED) while a completer races it; any thread may complete it (a
//    reply to a local call is completed by the worker that sends it);
//  - async: the broker arms its deadline and every completion runs on the
//    broker thread, except for a slot opened with `anywhere`: its
//    completion is thread-safe (it fulfils a std::future), so the thread
//    that brings the reply (a service worker answering a local call)
//    completes it there, without a hop through the broker. Only the broker
//    may unlink an armed deadline, so such a slot is then retired, not
//    freed: the broker frees retired slots the next time it arms or expires
//    a deadline.
//
// Thread safety: open_*/wait from any thread; complete() from any thread for
// blocking slots, the broker thread for async ones; the scan and deadline
// members on the broker thread.
// Ownership: owned by the Router. Slots live in chunks that never move.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include <boost/lockfree/stack.hpp>

#include "spindle/frame.h"
#include "spindle/function.h"
#include "spindle/message.h"

namespace spindle {

class Broker;

inline constexpr std::uint32_t kCallHandleBit = 0x80000000u;
inline bool is_call_handle(std::uint32_t h) { return (h & kCallHandleBit) != 0; }
static_assert(!is_sender_handle(kCallHandleBit) && !is_sender_handle(~0u));  // api/frame.h

class CallTable {
 public:
  using Clock = std::chrono::steady_clock;
  using Completion = UniqueFunction<void(Message&&, std::exception_ptr)>;
  static constexpr std::uint32_t kMaxSlots = 1u << 20;

  // `loop`: the broker whose loop a blocking caller may run while it waits
  // (broker.h, leader/follower); null for none.
  explicit CallTable(Broker* loop = nullptr);
  ~CallTable();
  CallTable(const CallTable&) = delete;
  CallTable& operator=(const CallTable&) = delete;

  // Takes a slot for a call to `callee`; returns its reply handle. Throws
  // Error when kMaxSlots calls are pending.
  std::uint32_t open_blocking(std::uint32_t callee);
  std::uint32_t open_async(std::uint32_t callee, Completion done, bool anywhere = false);
  // The sender failed before the request left: frees the slot, completing
  // nothing.
  void abandon(std::uint32_t handle);

  // Blocking slots: waits for the outcome until `deadline`. Returns the
  // reply, or throws what completed it (ChannelError, CallError, or
  // TimeoutError built by `on_timeout`). Frees the slot. While no other
  // thread runs the broker's loop, the caller runs it and the reply reaches
  // it without a hand-off; otherwise it sleeps on the slot's word.
  Message wait(std::uint32_t handle, Clock::time_point deadline,
               const std::function<std::exception_ptr()>& on_timeout);

  enum class Verdict { kCompleted, kStale, kWrongSender };
  // A message for a call handle. `m` is consumed only when kCompleted.
  // `on_broker`: whether the caller is the broker thread.
  Verdict complete(std::uint32_t handle, Message&& m, bool on_broker = true);
  // Completes with an error (deadline, disconnect, shutdown); false if the
  // call was already completed or is unknown.
  bool fail(std::uint32_t handle, std::exception_ptr error);
  // Whether any thread may complete `handle`: a blocking slot, or an async
  // one opened with `anywhere`.
  bool completes_anywhere(std::uint32_t handle) const;
  std::optional<std::uint32_t> callee_of(std::uint32_t handle) const;
  // Whether the call is still waiting for its outcome (any thread; a hint:
  // it may be completed the moment after).
  bool is_pending(std::uint32_t handle) const;

  // Any thread: asks for an async slot's deadline to be armed by the broker
  // at its next arm_requested(). Lock-free; allocates nothing once warm.
  // Returns how many requests wait for the broker, this one included.
  std::uint32_t request_arm(std::uint32_t handle, Clock::time_point when);

  // --- broker thread ---
  // Async slots: the deadline, armed when the request reaches the broker
  // (through the outbox), or as requested by the thread that wrote it.
  void arm_deadline(std::uint32_t handle, Clock::time_point when);
  // Arms every deadline request_arm() asked for since the last time (those of
  // calls already over are skipped). Returns the earliest of them, armed or
  // not: see Router::arm_call_timer. The RMW that takes the requests and
  // request_arm()'s are sequentially consistent: see Router::arm_deadline.
  std::optional<Clock::time_point> arm_requested();
  // The earliest armed deadline, if any.
  std::optional<Clock::time_point> next_deadline() const;
  // Fails every async call whose deadline has passed with on_timeout(callee).
  void expire(Clock::time_point now,
              const std::function<std::exception_ptr(std::uint32_t callee)>& on_timeout);
  // Fails every pending call whose callee `gone(callee)` says is gone: one
  // pass over the open slots, whatever the number of gone contexts (none
  // while no call is pending). Returns the slots it looked at.
  std::size_t fail_where(const std::function<bool(std::uint32_t callee)>& gone,
                         const std::function<std::exception_ptr(std::uint32_t callee)>& why);
  std::size_t pending() const { return pending_.load(std::memory_order_relaxed); }
  // Slots built so far: the most calls ever open at once, plus the slots
  // waiting to be freed (retired, or reused later).
  std::size_t slots() const { return size_.load(std::memory_order_relaxed); }

 private:
  struct Slot;
  static bool settled(const void* slot);
  Slot* slot(std::uint32_t handle) const;  // null if the index is out of range
  std::uint32_t open(std::uint32_t callee, bool blocking, Completion done, bool anywhere);
  bool claim(Slot& s, std::uint32_t handle);
  void finish(Slot& s, std::uint32_t index, Message&& m, std::exception_ptr e, bool on_broker = true);
  void free_slot(Slot& s, std::uint32_t index);  // counts it out of pending(), then recycles
  void recycle(Slot& s, std::uint32_t index);    // unlinks, clears and frees it
  void reap_retired();  // broker thread: frees the slots completed elsewhere
  void grow();

  // Slots live in chunks that double: chunk k holds kFirstChunk << k slots
  // (the last one is cut to reach kMaxSlots exactly). A router that makes a
  // few calls, like a freshly forked worker's, builds 64 slots (~20 KiB),
  // not a thousand: each page it touches is a fault, and a short-lived
  // process pays for every one.
  static constexpr std::uint32_t kFirstChunk = 64;
  static constexpr std::uint32_t kChunks = 15;  // 64 * (2^14 - 1) + 64 = kMaxSlots
  static std::uint32_t chunk_of(std::uint32_t index);
  static constexpr std::uint32_t chunk_start(std::uint32_t chunk) { return kFirstChunk * ((1u << chunk) - 1); }
  Slot& at(std::uint32_t index) const;  // index < size_
  mutable std::mutex grow_mu_;  // guards growth only (the slow path)
  std::atomic<Slot*> chunks_[kChunks] = {};
  std::atomic<std::uint32_t> size_{0};
  boost::lockfree::stack<std::uint32_t> free_{256};
  boost::lockfree::stack<std::uint32_t> retired_{64};  // completed off the broker thread
  std::atomic<std::uint32_t> retirements_{0};  // every kRetiredPerReap, the broker reaps
  struct ArmRequest {
    std::uint32_t handle;
    Clock::rep when;
  };
  boost::lockfree::stack<ArmRequest> arm_requests_{256};
  std::atomic<std::uint32_t> arm_requests_pushed_{0};  // since the broker last took them
  std::atomic<std::size_t> pending_{0};
  // broker thread: armed async deadlines, earliest first (intrusive in the
  // slots: arming one allocates nothing)
  struct Deadlines;
  std::unique_ptr<Deadlines> deadlines_;
  Broker* loop_;
};

}  // namespace spindle
