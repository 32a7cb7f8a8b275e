// The registry is a plain vector under one mutex. prepare() takes that mutex
// and keeps it (with each set's own) until the fork is done, so no set can be
// created or destroyed half-way; the child handler unlocks them in the child,
// where the forking thread, their owner, is the only thread left.
//
// The handlers are installed on first use (the first LaneSet), not from a
// static initialiser, so merely linking the library changes nothing.
#include "services/fork.h"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <vector>

#include "broker/errors.h"
#include "broker/log.h"
#include "broker/log_sink.h"
#include "services/lanes.h"

namespace spindle::services::fork_guard {
namespace {

struct Registry {
  std::mutex mu;
  std::vector<LaneSet*> sets;
  std::vector<Hooks> hooks;
};

// Leaked on purpose: a set may be destroyed during static destruction.
Registry& registry() {
  static Registry* r = new Registry;
  return *r;
}

std::atomic<unsigned long> not_quiesced{0};

void prepare() {
  Registry& r = registry();
  r.mu.lock();
  // Freeze and wait for each set without holding any, so a worker of one set
  // that is pushing into another can finish; only then hold them all.
  const auto deadline = std::chrono::steady_clock::now() + kForkQuiesceLimit;
  bool all_quiet = true;
  for (LaneSet* s : r.sets) all_quiet = s->freeze_for_fork(deadline) && all_quiet;
  for (LaneSet* s : r.sets) s->hold_for_fork();
  for (const Hooks& h : r.hooks) h.prepare();
  if (!all_quiet) {
    // Not logged here: the log's own locks must not be taken with the sets
    // frozen. The count is the trace.
    not_quiesced.fetch_add(1);
  }
}

void in_parent() {
  Registry& r = registry();
  for (const Hooks& h : r.hooks) h.parent();
  for (LaneSet* s : r.sets) s->thaw_in_parent();
  r.mu.unlock();
}

void in_child() {
  Registry& r = registry();
  for (LaneSet* s : r.sets) s->thaw_in_child();
  r.sets.clear();
  for (const Hooks& h : r.hooks) h.child();
  r.mu.unlock();
}

void install_once() {
  // The log sink's handlers first, so that they run after ours in prepare:
  // the pools are quiesced before the log is held (see log_sink.h).
  install_log_fork_guard();
  static const int rc = pthread_atfork(prepare, in_parent, in_child);
  if (rc != 0) log().error("pthread_atfork failed: {}; fork() while a pool is busy is unsafe", errno_text(rc));
}

}  // namespace

void register_set(LaneSet* set) {
  install_once();
  std::lock_guard lk(registry().mu);
  registry().sets.push_back(set);
}

void unregister_set(LaneSet* set) {
  std::lock_guard lk(registry().mu);
  auto& v = registry().sets;
  v.erase(std::remove(v.begin(), v.end(), set), v.end());
}

void add_hooks(Hooks hooks) {
  install_once();
  std::lock_guard lk(registry().mu);
  auto& v = registry().hooks;
  if (std::none_of(v.begin(), v.end(), [&](const Hooks& h) { return h.prepare == hooks.prepare; }))
    v.push_back(hooks);
}

unsigned long forks_not_quiesced() { return not_quiesced.load(); }

}  // namespace spindle::services::fork_guard
