// Watcher: shut a broker down gracefully when a watched thread exits.
//
// Role: install_watcher(broker) watches the calling thread (typically main,
// or the thread that owns the application's work): when that thread exits,
// every broker it watches for is told to shut down (Broker::shutdown(),
// graceful, non-blocking). Mitogen starts one thread per target that joins
// it; C++ cannot wait for a thread it does not own without joining it, so
// here the watcher is a thread_local object of the target thread itself, and
// costs no thread and no fd. Each target has exactly one watcher, however
// often it is registered; registering the same broker twice is a no-op.
//
// A broker that shuts down for any reason forgets its watchers (it is a
// shutdown participant), so a watched thread that outlives its broker never
// touches it. After fork() the map from targets to watchers is reset in the
// child (services/fork.h): the child's watchers are its own, and the thread
// that forked does not shut down the parent's broker copy when it exits.
//
// Thread safety: any thread; install_watcher(broker) watches the caller.
#pragma once

#include <cstddef>

#include "broker/broker.h"

namespace spindle::services {

// Throws ShutdownError if the broker has already stopped.
void install_watcher(Broker& broker);
// How many threads have a watcher now (for tests and stats).
std::size_t watcher_count();
// How many brokers the calling thread's watcher will shut down.
std::size_t watched_brokers_of_this_thread();

}  // namespace spindle::services
