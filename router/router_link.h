// RouterLink: how a Context reaches its Router without outliving it.
//
// A Router owns one link and closes it when it is destroyed, after its
// broker has stopped and every pending call has failed. A Context holds the
// link (shared) and is inside its gate for the length of each operation, so
// the router is not freed under an operation that found it alive; an
// operation that finds the gate closed throws ShutdownError. The gate costs
// an operation no atomic read-modify-write (broker/section_gate.h): a send
// enters it once.
//
// Thread safety: any thread. Ownership: shared by the Router and every
// Context made from it.
#pragma once

#include <atomic>

#include "broker/section_gate.h"

namespace spindle {
class Router;
}

namespace spindle::detail {

struct RouterLink {
  SectionGate gate;
  // Set by the router when it is made, cleared once the gate is closed and
  // empty: inside the gate it is never null.
  std::atomic<Router*> router{nullptr};

  // For a handler of the router's own that a hosted loop (the application's)
  // may run after the router is gone: whether it still exists. A router is
  // not destroyed while one of its handlers runs, so true holds for the rest
  // of the handler.
  bool alive() const { return router.load(std::memory_order_acquire) != nullptr; }
};

}  // namespace spindle::detail
