// Fork guard: makes fork() safe while pools and Selects are busy.
//
// Role: pthread_atfork handlers, installed once per process, that
//  - before the fork, freeze every LaneSet: no message is handed out, and the
//    fork waits (up to kForkQuiesceLimit) until no worker is inside one, so no
//    worker is half-way through a handler (holding its locks, or an
//    allocator's) at the instant of the fork. Each set's mutex is held across
//    the fork, so no thread holds it in the child;
//  - after the fork, in the parent, thaw the sets (queued work resumes);
//  - in the child, make the inherited sets inert (their threads do not exist
//    there) and forget them, and reset the watcher map (watcher.h). The child
//    builds its own broker, pool and watchers.
// Workers blocked in a handler that never returns within the limit cannot be
// quiesced; the fork goes ahead after logging it.
//
// Thread safety: register/unregister from any thread; the handlers run in
// whichever thread calls fork().
#pragma once

#include <chrono>
#include <functional>

namespace spindle::services {

class LaneSet;

namespace fork_guard {

inline constexpr std::chrono::milliseconds kForkQuiesceLimit{10};

void register_set(LaneSet* set);
void unregister_set(LaneSet* set);
// Hooks for other process-wide state (the watcher map): `prepare` runs
// after the sets are frozen (typically it takes a mutex), `parent` and
// `child` after the fork (release it; reset the state in the child).
struct Hooks {
  void (*prepare)();
  void (*parent)();
  void (*child)();
};
void add_hooks(Hooks hooks);
// How many forks found a worker that would not quiesce in time.
unsigned long forks_not_quiesced();

}  // namespace fork_guard
}  // namespace spindle::services
