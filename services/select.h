// Select and Receiver: wait on several router handles at once.
//
// Role: a Receiver registers a handle on a Router and queues what arrives
// there into its Select; Select::get() returns the next message from any of
// its receivers, or nothing when the timeout passes, like Mitogen's Select.
// It costs no fd (a waiter sleeps on a futex word of its own), and a message
// wakes at most one waiting thread (lanes.h: the wake rule). While its
// receivers' messages all come through one broker, a waiter runs that
// broker's loop itself when no one else does (broker.h, leader/follower),
// so the message it brings needs no wake-up at all. Several threads
// may wait on one Select; receivers take turns (lanes.h: the fairness rule),
// so a flooded receiver cannot hide another's messages.
//
//   Select sel;
//   Receiver a(router, sel), b(router, sel);
//   // ... tell peers to send to a.handle() and b.handle() ...
//   while (auto ev = sel.get(1s)) handle(ev->from == &a, ev->msg);
//
// After close() (or destruction of the Select) waiters return nothing, and
// messages still arriving get a dead reply (reason::kSelectClosed).
//
// Thread safety: any thread, except get() on the broker thread (it blocks).
// Ownership: the application owns both; a Receiver borrows its Select and
// Router, which must outlive it.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>

#include "router/router.h"
#include "services/lanes.h"

namespace spindle::services {

class Receiver;

class Select {
 public:
  struct Event {
    Receiver* from = nullptr;
    Message msg;
  };
  Select() = default;
  ~Select() { close(); }
  Select(const Select&) = delete;
  Select& operator=(const Select&) = delete;

  // The next message from any receiver, or nothing on timeout or close.
  std::optional<Event> get(std::chrono::nanoseconds timeout);
  // Wakes every waiter; later messages are refused. Queued ones get a dead
  // reply. Idempotent.
  void close();
  LaneStats stats() const { return lanes_.stats(); }

 private:
  friend class Receiver;
  LaneSet lanes_;
};

class Receiver {
 public:
  // handle 0 allocates a dynamic handle.
  Receiver(Router& router, Select& select, std::uint32_t handle = 0, HandlerOptions opts = {});
  ~Receiver();
  Receiver(const Receiver&) = delete;
  Receiver& operator=(const Receiver&) = delete;
  std::uint32_t handle() const { return handle_; }
  Router& router() const { return router_; }

 private:
  Router& router_;
  Select& select_;
  Lane& lane_;
  std::uint32_t handle_ = 0;
};

}  // namespace spindle::services
