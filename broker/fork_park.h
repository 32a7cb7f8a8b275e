// fork_park: every broker of the process parked for a fork().
//
// A forked child inherits every lock as it was at the fork. glibc's malloc
// and Spindle's own global locks (the log sink, the service pools) are taken
// by pthread_atfork handlers, but GCC 12's ASan allocator is not: a thread
// allocating at the moment of the fork leaves its size class locked in the
// child, and the child's first allocation of that size (its broker thread
// starting) hangs. So fork_child parks, on a gate, the loop of every broker
// in the process, not only the one it forks from: an application with two
// runtimes (a Connection and a Runtime, say) forks from one while the
// other's loop may be allocating.
//
// Which brokers: every one that runs its own thread (a hosted broker's loop
// is the application's thread, and parking it could wait for ever), except
// one whose loop the calling thread runs (it cannot wait for itself). The
// broker forked from is waited for without a deadline, as before; the
// others for a bounded time each, so a broker stuck in a long handler delays
// a fork, never blocks it.
//
// Thread safety: add/remove from any thread (a Broker's constructor and
// destructor); park_all from the thread about to fork. In a child the
// registry is emptied by a pthread_atfork handler: the parent's brokers have
// no threads there.
#pragma once

#include <chrono>
#include <memory>
#include <vector>

namespace spindle {

class Broker;

namespace fork_park {

void add(Broker* b);
void remove(Broker* b);

struct Gate;

// Lets the parked brokers go on when destroyed (in the parent). The child
// calls abandon(): nothing there waits on the gates.
class Parked {
 public:
  Parked() = default;
  explicit Parked(std::vector<std::shared_ptr<Gate>> gates) : gates_(std::move(gates)) {}
  Parked(Parked&&) = default;
  // Assigning over held gates would drop them unreleased: not allowed.
  Parked& operator=(Parked&&) = delete;
  ~Parked();
  std::size_t count() const { return gates_.size(); }
  // In the child: lets go of the gates without touching them.
  void abandon();

 private:
  std::vector<std::shared_ptr<Gate>> gates_;
};

// How long a fork waits for the brokers it need not wait for.
inline constexpr std::chrono::milliseconds kOthersParkWithin{200};

// Parks `must` (waited for until it parks), if given, and every other
// registered broker (all of them within `others_within`). fork_child()
// names the broker it forks from; Zygote::start() names none, since the
// zygote copies the whole process and no broker in particular.
Parked park_all(Broker* must, std::chrono::milliseconds others_within = kOthersParkWithin);

}  // namespace fork_park
}  // namespace spindle
