// RouterLink: how a Context reaches its Router without outliving it.
//
// A Router owns one link and clears it when it is destroyed, after its
// broker has stopped and every pending call has failed. A Context holds the
// link (shared), and holds it shared-locked for the length of each
// operation, so the router cannot be freed under an operation that found it
// alive; an operation that finds it cleared throws ShutdownError.
//
// Thread safety: any thread. Ownership: shared by the Router and every
// Context made from it.
#pragma once

#include <shared_mutex>

namespace spindle {
class Router;
}

namespace spindle::detail {

struct RouterLink {
  std::shared_mutex mu;
  Router* router = nullptr;  // guarded by mu; null once the router is gone

  // For a handler of the router's own that a hosted loop (the application's)
  // may run after the router is gone: whether it still exists. A router is
  // not destroyed while one of its handlers runs, so true holds for the rest
  // of the handler.
  bool alive() {
    std::shared_lock lk(mu);
    return router != nullptr;
  }
};

}  // namespace spindle::detail
