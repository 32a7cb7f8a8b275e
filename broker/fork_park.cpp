// A gate is a deferred task that parks whichever thread runs the broker's
// loop until the fork is done. Gates are deferred under the registry's lock
// (a broker being destroyed waits there, so none is deferred to a dead
// one); the waiting happens after it is dropped. A gate that parks after
// park_all stopped waiting for it, or after the fork, sees `released` and
// returns at once: nothing is left parked.
#include "broker/fork_park.h"

#include <pthread.h>

#include <algorithm>
#include <condition_variable>
#include <mutex>

#include "broker/broker.h"
#include "broker/log.h"

namespace spindle::fork_park {

struct Gate {
  std::mutex mu;
  std::condition_variable cv;
  bool parked = false;
  bool released = false;
};

namespace {

// Leaked on purpose: brokers may outlive static destruction order.
std::mutex& registry_mu() {
  static auto* mu = new std::mutex;
  return *mu;
}
std::vector<Broker*>& registry() {
  static auto* v = new std::vector<Broker*>;
  return *v;
}

void install_child_reset() {
  static std::once_flag once;
  std::call_once(once, [] {
    // Held across the fork by the forking thread, which is the one that
    // goes on in the child and unlocks it there; the child has none of the
    // parent's broker threads, so its registry starts empty.
    ::pthread_atfork([] { registry_mu().lock(); }, [] { registry_mu().unlock(); },
                     [] {
                       registry().clear();
                       registry_mu().unlock();
                     });
  });
}

std::shared_ptr<Gate> defer_gate(Broker& b) {
  auto gate = std::make_shared<Gate>();
  const bool deferred = b.try_defer([gate] {
    std::unique_lock lk(gate->mu);
    gate->parked = true;
    gate->cv.notify_all();
    gate->cv.wait(lk, [&] { return gate->released; });
  });
  return deferred ? gate : nullptr;
}

}  // namespace

void add(Broker* b) {
  install_child_reset();
  std::lock_guard lk(registry_mu());
  registry().push_back(b);
}

void remove(Broker* b) {
  std::lock_guard lk(registry_mu());
  auto& r = registry();
  r.erase(std::remove(r.begin(), r.end(), b), r.end());
}

void Parked::abandon() {
  // A gate's mutex may have been held by a thread that does not exist
  // here: never locked, never destroyed.
  new std::vector<std::shared_ptr<Gate>>(std::move(gates_));
  gates_.clear();
}

Parked::~Parked() {
  for (auto& g : gates_) {
    std::lock_guard lk(g->mu);
    g->released = true;
    g->cv.notify_all();
  }
}

Parked park_all(Broker* must, std::chrono::milliseconds others_within) {
  std::shared_ptr<Gate> mine;
  std::vector<std::shared_ptr<Gate>> others;
  {
    std::lock_guard lk(registry_mu());
    if (must && !must->on_broker_thread()) mine = defer_gate(*must);
    for (Broker* b : registry())
      if (b != must && !b->hosted() && !b->on_broker_thread())
        if (auto g = defer_gate(*b)) others.push_back(std::move(g));
  }
  std::vector<std::shared_ptr<Gate>> all = others;
  if (mine) {
    all.push_back(mine);
    std::unique_lock lk(mine->mu);
    mine->cv.wait(lk, [&] { return mine->parked; });
  }
  std::size_t late = 0;
  const auto deadline = std::chrono::steady_clock::now() + others_within;
  for (auto& g : others) {
    std::unique_lock lk(g->mu);
    if (!g->cv.wait_until(lk, deadline, [&] { return g->parked; })) ++late;
  }
  if (late)
    log().warn("fork: {} other broker(s) of this process did not park within {} ms; forking anyway",
               late, others_within.count());
  return Parked(std::move(all));
}

}  // namespace spindle::fork_park
