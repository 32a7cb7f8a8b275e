// HandlerTable: the handle registry of one router.
//
// Maps a handle to the function that receives messages sent to it, with an
// optional policy predicate (refuse when it returns false). The table belongs
// to the broker thread, where messages are dispatched, so a dispatch takes no
// lock; the Router registers and removes handlers there (a call from another
// thread waits for the broker to do it, so a message sent right after
// add_handler() returns finds the handler).
//
// Pending calls are not handlers: they live in the CallTable (call_table.h).
//
// Any-thread handlers: a handler that only queues work (a pool's, a service
// host's) may run on whichever thread sends a local message to it, sparing
// the message a trip through the broker. Those are also published in an
// immutable snapshot that any thread may read without a lock; a snapshot
// replaced by a later registration is kept until the table dies (they are
// few: registrations of this kind happen when services start).
//
// Thread safety: broker thread only, except find_any_thread(), any thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <unordered_map>
#include <vector>

#include "spindle/message.h"

namespace spindle {

using HandlerFn = std::function<void(Message&&)>;
using Policy = std::function<bool(const Message&)>;

struct HandlerOptions {
  Policy policy;  // refuse when it returns false; runs where the handler runs
  // The handler is safe to run on any thread (it only queues work): a local
  // message from another thread runs it there, without a broker hop.
  bool any_thread = false;
};

struct Handler {
  HandlerFn fn;
  HandlerOptions opts;
  std::uint32_t handle = 0;
};

using HandlerPtr = std::shared_ptr<const Handler>;

class HandlerTable {
 public:
  HandlerTable();
  ~HandlerTable();
  HandlerTable(const HandlerTable&) = delete;
  HandlerTable& operator=(const HandlerTable&) = delete;

  // handle == 0 allocates the next free dynamic handle (1000 and up, below
  // the call handles). Returns 0 if an explicit handle is already taken.
  std::uint32_t add(HandlerFn fn, HandlerOptions opts, std::uint32_t handle = 0);
  // The handler of `handle`, or null. Valid until the handle is removed, or,
  // while a Dispatch is open, until the last one closes: a handler that
  // removes itself (or another) while it runs is freed only then, so a
  // dispatch holds no reference count of its own.
  const Handler* find(std::uint32_t handle);
  bool remove(std::uint32_t handle);
  class Dispatch {
   public:
    explicit Dispatch(HandlerTable& t) : t_(t) { ++t_.dispatching_; }
    ~Dispatch() {
      if (--t_.dispatching_ == 0 && !t_.retired_.empty()) t_.retired_.clear();
    }
    Dispatch(const Dispatch&) = delete;
    Dispatch& operator=(const Dispatch&) = delete;

   private:
    HandlerTable& t_;
  };
  std::size_t size() const { return map_.size(); }
  HandlerPtr find_any_thread(std::uint32_t handle) const;

 private:
  using Snapshot = std::vector<HandlerPtr>;  // sorted by handle
  void publish();

  std::unordered_map<std::uint32_t, HandlerPtr> map_;
  // find()'s last answer: consecutive messages mostly go to one handle.
  // Map nodes stay put when the map grows; remove() forgets it.
  std::uint32_t last_handle_ = 0;
  const Handler* last_found_ = nullptr;
  int dispatching_ = 0;                // Dispatch scopes open
  std::vector<HandlerPtr> retired_;    // removed while they were open
  std::uint32_t next_dynamic_ = kFirstDynamicHandle;
  std::atomic<const Snapshot*> any_thread_{nullptr};
  std::vector<std::unique_ptr<const Snapshot>> snapshots_;  // every one published
};

}  // namespace spindle
