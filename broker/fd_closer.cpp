// One closing thread per process, fed through a mutex-guarded queue: the
// sockets it gets are rare (a peer must set SO_LINGER to send one), so the
// queue is never hot. The thread and its state are leaked on purpose: they
// must outlive static destruction (a Message dropped at exit may still hand
// one over), and a detached thread blocked in close() must not find its
// state destroyed under it.
#include "broker/fd_closer.h"

#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <utility>

#include <fmt/format.h>

#include "broker/log.h"
#include "broker/summary_log.h"

namespace spindle::fd_closer {
namespace {

struct Batch {
  std::vector<UniqueFd> fds;
  std::shared_ptr<void> charge;
};

class Closer {
 public:
  explicit Closer(pid_t pid) : pid_(pid) {}
  pid_t pid() const { return pid_; }

  void start() {
    std::thread([this] { run(); }).detach();
  }

  void add(Batch b) {
    {
      std::lock_guard lk(mu_);
      queue_.push_back(std::move(b));
    }
    cv_.notify_one();
  }

 private:
  void run() {
    for (;;) {
      Batch b;
      {
        std::unique_lock lk(mu_);
        cv_.wait(lk, [&] { return !queue_.empty(); });
        b = std::move(queue_.front());
        queue_.pop_front();
      }
      b.fds.clear();  // the close()s that wait, here
      b.charge.reset();
    }
  }

  const pid_t pid_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Batch> queue_;
};

std::atomic<Closer*> g_closer{nullptr};

// This process's closer, started on first use. In a forked child the
// parent's thread is gone and its lock may be held: the child starts its
// own and leaves the parent's (and the fds queued there, copies the child
// also inherited, CLOEXEC) alone.
Closer& closer() {
  const pid_t me = ::getpid();
  Closer* c = g_closer.load(std::memory_order_acquire);
  while (!c || c->pid() != me) {
    auto* fresh = new Closer(me);
    if (g_closer.compare_exchange_strong(c, fresh, std::memory_order_acq_rel)) {
      try {
        fresh->start();
      } catch (...) {
        // No thread: nothing may queue there. The next caller tries again;
        // this one closes its fds itself (close_received). Leaked, as
        // another thread may be adding to it right now.
        Closer* expect = fresh;
        g_closer.compare_exchange_strong(expect, nullptr, std::memory_order_acq_rel);
        throw;
      }
      return *fresh;
    }
    delete fresh;  // another thread installed one: c holds it now
  }
  return *c;
}

// Whether close() of `fd` may wait: a socket with SO_LINGER on and a
// non-zero linger time.
bool close_may_wait(int fd) {
  linger l{};
  socklen_t n = sizeof l;
  // ENOTSOCK for anything but a socket: not ours to wait on.
  return ::getsockopt(fd, SOL_SOCKET, SO_LINGER, &l, &n) == 0 && l.l_onoff != 0 && l.l_linger > 0;
}

}  // namespace

void close_received(std::vector<UniqueFd> fds, std::shared_ptr<void> charge) noexcept {
  if (fds.empty() || !charge) return;  // an uncharged set is our own: it closes where it goes
  try {
    std::vector<UniqueFd> slow;
    for (UniqueFd& fd : fds)
      if (fd && close_may_wait(fd.get())) slow.push_back(std::move(fd));
    if (!slow.empty()) {
      static SummaryLog handed_over;
      handed_over.note([&] {
        return fmt::format("{} received socket(s) with SO_LINGER closed on the closing thread", slow.size());
      });
      closer().add(Batch{std::move(slow), charge});  // the closer releases the charge last
    }
  } catch (...) {
    // Closed here after all: what the thread would have spared us.
  }
  fds.clear();  // the others, here; then the charge goes
  charge.reset();
}

}  // namespace spindle::fd_closer
