// One process-wide registry under one mutex: target thread -> its watcher
// (the brokers to shut down), and broker -> its shutdown participant. A
// thread_local Token in each target runs the watcher when the thread exits.
// The registry has a generation, bumped in a forked child: a Token from an
// older generation (the forking thread's copy) does nothing.
//
// A watched broker shutting down removes itself under the same mutex before
// it can be destroyed, so a Token never calls shutdown() on a dead broker.
#include "services/watcher.h"

#include <future>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "broker/errors.h"
#include "broker/log.h"
#include "services/fork.h"

namespace spindle::services {
namespace {

class BrokerWatch;
struct Registry;
void forget_locked(Registry& r, Broker& broker);

struct Registry {
  std::mutex mu;
  std::uint64_t generation = 0;
  std::unordered_map<std::thread::id, std::unordered_set<Broker*>> targets;
  std::unordered_map<Broker*, std::unique_ptr<BrokerWatch>> brokers;
};

Registry& registry() {
  static Registry* r = new Registry;  // leaked: thread exits may follow static destruction
  return *r;
}

// Forgets its broker when the broker begins to shut down.
class BrokerWatch : public ShutdownParticipant {
 public:
  explicit BrokerWatch(Broker& b) : broker_(b) {}
  void on_shutdown_begin() override { forget(); }
  void on_shutdown_deadline() override { forget(); }

 private:
  void forget() {
    std::unique_ptr<BrokerWatch> self;
    {
      Registry& r = registry();
      std::lock_guard lk(r.mu);
      auto it = r.brokers.find(&broker_);
      if (it == r.brokers.end()) return;
      self = std::move(it->second);
      forget_locked(r, broker_);
    }
    broker_.remove_participant(this);
    // `self` (this) is destroyed on return; nothing touches a member after.
  }
  Broker& broker_;
};

struct Token {
  std::uint64_t generation = 0;
  bool armed = false;
  ~Token() {
    if (!armed) return;
    Registry& r = registry();
    std::lock_guard lk(r.mu);
    if (generation != r.generation) return;  // inherited across fork: not ours
    auto it = r.targets.find(std::this_thread::get_id());
    if (it == r.targets.end()) return;
    for (Broker* b : it->second) b->shutdown();
    r.targets.erase(it);
  }
};

thread_local Token tl_token;

// Held across fork(), so the child's copy of the mutex is not left locked by
// a thread that does not exist there.
void lock_for_fork() { registry().mu.lock(); }
void unlock_in_parent() { registry().mu.unlock(); }
void reset_in_child() {
  Registry& r = registry();
  // The parent's brokers do not run here; their watch objects are leaked.
  for (auto& [b, w] : r.brokers) (void)w.release();
  r.brokers.clear();
  r.targets.clear();
  ++r.generation;
  r.mu.unlock();
}

// Under r.mu: drops what install_watcher registered for `broker`.
void forget_locked(Registry& r, Broker& broker) {
  for (auto& [tid, set] : r.targets) set.erase(&broker);
  r.brokers.erase(&broker);
}

}  // namespace

void install_watcher(Broker& broker) {
  fork_guard::add_hooks({lock_for_fork, unlock_in_parent, reset_in_child});
  Registry& r = registry();
  BrokerWatch* fresh = nullptr;
  {
    std::lock_guard lk(r.mu);
    r.targets[std::this_thread::get_id()].insert(&broker);
    tl_token.generation = r.generation;
    tl_token.armed = true;
    if (!r.brokers.count(&broker)) {
      auto w = std::make_unique<BrokerWatch>(broker);
      fresh = w.get();
      r.brokers.emplace(&broker, std::move(w));
    }
  }
  if (!fresh) return;
  // A broker already shutting down would wait for a participant it never
  // told: such a broker is not watched (it is on its way down anyway).
  auto add = [&broker, fresh, &r] {
    if (broker.accepting()) return broker.add_participant(fresh);
    std::unique_ptr<BrokerWatch> gone;
    std::lock_guard lk(r.mu);
    auto it = r.brokers.find(&broker);
    if (it != r.brokers.end() && it->second.get() == fresh) gone = std::move(it->second);
    forget_locked(r, broker);
  };
  std::promise<void> added;
  auto f = added.get_future();
  if (!broker.try_defer([&] {
        add();
        added.set_value();
      })) {
    std::lock_guard lk(r.mu);
    forget_locked(r, broker);
    throw ShutdownError(std::string(errtext::kBrokerShutDown));
  }
  f.wait();
}

std::size_t watcher_count() {
  std::lock_guard lk(registry().mu);
  return registry().targets.size();
}

std::size_t watched_brokers_of_this_thread() {
  Registry& r = registry();
  std::lock_guard lk(r.mu);
  auto it = r.targets.find(std::this_thread::get_id());
  return it == r.targets.end() ? 0 : it->second.size();
}

}  // namespace spindle::services
