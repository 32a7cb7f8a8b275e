// The defer queue is a Boost.Lockfree queue of heap-held tasks, with one flag
// saying a wake-up is already on its way. A producer writes the eventfd only
// when it turns the flag on; the loop turns it off before it drains, so a
// function queued after the drain began writes a fresh wake-up and is never
// stranded. No producer takes a lock.
//
// Finishing (broker_shutdown.cpp, with the rest of the shutdown) closes
// producers_ (a SectionGate) and then waits until no producer is inside it,
// between its check and its push, so every defer() either lands in a batch
// that runs or is refused and throws.
#include "broker/broker.h"

#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <algorithm>
#include <system_error>

#include <asio/executor_work_guard.hpp>
#include <asio/post.hpp>

#include "broker/errors.h"
#include "broker/fd_registry.h"
#include "broker/fork_park.h"
#include "broker/log.h"
#include "broker/sigpipe.h"

namespace spindle {
namespace {
thread_local bool t_own_thread = false;
}  // namespace

bool Broker::on_an_own_thread() { return t_own_thread; }

Broker::Broker() : Broker(Options{}) {}

Broker::Broker(Options opts) : Broker(opts, nullptr) {}

Broker::Broker(asio::io_context& loop, Options opts) : Broker(opts, &loop) {}

Broker::Broker(Options opts, asio::io_context* hosted)
    : opts_(opts),
      free_fds_before_(hosted ? std::vector<int>{} : fd_registry::lowest_free_fds(kAsioFdProbes)),
      own_io_(hosted ? nullptr : std::make_unique<asio::io_context>(1)),
      io_(hosted ? *hosted : *own_io_),
      waker_(io_) {
  wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake_fd_ < 0) throw std::system_error(errno, std::generic_category(), "eventfd");
  fd_registry::note(wake_fd_);
  // A hosted loop's own fds are the application's: a forked child keeps them.
  for (int fd : fd_registry::anon_inode_fds_among(free_fds_before_))
    if (fd != wake_fd_) asio_fds_.push_back(fd);
  for (int fd : asio_fds_) fd_registry::note(fd);
  free_fds_before_ = {};
  waker_.assign(wake_fd_);
  arm_waker();
  if (hosted) {
    bind_thread();
  } else {
    thread_ = std::thread([this] { run(); });
    fork_park::add(this);  // parked while any runtime of this process forks
  }
}

Broker::~Broker() {
  fork_park::remove(this);
  // Anonymous inodes all look alike: forget them before they close, or a
  // child forked later would close the application's eventfd that took
  // one of their numbers.
  fd_registry::forget(wake_fd_);
  for (int fd : asio_fds_) fd_registry::forget(fd);
  if (hosted() && on_broker_thread() && state() != State::kStopped) stop_here();
  shutdown();
  if (!on_broker_thread() && thread_.joinable()) thread_.join();
  if (thread_.joinable()) thread_.detach();  // destroyed from its own thread: cannot join
  reap_children();
  // Tasks accepted but never run cannot exist (finish() ran them all); any
  // left over from a broker that never ran are freed here.
  Task* t;
  while (tasks_.pop(t)) delete t;
  life_.reset();  // before the members: what a hosted loop runs later sees us gone
  unblock_sigpipe();
}

// The calling thread becomes the broker thread.
void Broker::bind_thread() {
  thread_id_.store(std::this_thread::get_id());
  tid_.store(static_cast<pid_t>(::syscall(SYS_gettid)));
  // Writes to a closed pipe must come back as EPIPE, not kill the process.
  // Only this thread blocks SIGPIPE; streams consume any that stays pending.
  // A hosted broker's thread is the application's: what it changes there it
  // undoes when it goes (~Broker), unless SIGPIPE was blocked already.
  const sigset_t set = sigpipe::only();
  sigset_t old;
  if (int err = pthread_sigmask(SIG_BLOCK, &set, &old)) {
    log().error("broker: cannot block SIGPIPE ({}); a write to a closed pipe may kill the process",
                errno_text(err));
    return;
  }
  if (hosted() && !sigismember(&old, SIGPIPE)) sigpipe_blocked_on_ = std::this_thread::get_id();
}

// ~Broker of a hosted broker, on the thread it blocked SIGPIPE on: a SIGPIPE
// left pending there (a write to a closed pipe) is consumed, or unblocking
// would deliver it, and SIGPIPE is unblocked. Destroyed on another thread,
// the mask cannot be reached (it is per thread) and stays as it is.
void Broker::unblock_sigpipe() {
  if (sigpipe_blocked_on_ != std::this_thread::get_id()) return;
  sigpipe_blocked_on_ = {};
  sigpipe::consume_pending();
  const sigset_t set = sigpipe::only();
  if (int err = pthread_sigmask(SIG_UNBLOCK, &set, nullptr))
    log().error("broker: cannot unblock SIGPIPE again ({})", errno_text(err));
}

void Broker::run() {
  bind_thread();
  pthread_setname_np(pthread_self(), "spindle-broker");  // cosmetic: failure is harmless
  t_own_thread = true;

  auto guard = asio::make_work_guard(io_);
  // The loop may pass to a waiting caller and back (loop_lead.cpp); this
  // thread holds it whenever serve() runs and when finish() does.
  while (true) {
    serve();
    if (io_.stopped()) break;
    step_aside();
    if (io_.stopped()) break;
  }
  finish();
}

bool Broker::push_task(std::function<void()> fn) {
  {
    ProducerGuard producing(*this);
    if (!producing) return false;
    auto* t = new Task{std::move(fn)};
    if (!tasks_.push(t)) {  // out of memory for a node
      delete t;
      throw std::bad_alloc();
    }
  }
  deferred_count_.fetch_add(1, std::memory_order_relaxed);
  wake();
  return true;
}

bool Broker::try_defer(std::function<void()> fn) {
  if (on_broker_thread()) {
    fn();
    return true;
  }
  return push_task(std::move(fn));
}

bool Broker::try_post(std::function<void()> fn) { return push_task(std::move(fn)); }

void Broker::defer(std::function<void()> fn) {
  if (!try_defer(std::move(fn))) throw ShutdownError(std::string(errtext::kBrokerShutDown));
}

// wake() and on_waker() are the two halves of a Dekker pair: the producer
// stores its record (the outbox publishes with a plain release store) and then
// loads wake_pending_; the loop stores wake_pending_ = false and then loads the
// records. Without a full fence between each side's store and its load, both
// loads may run before the other side's store is visible (x86 reorders a store
// with a later load through its store buffer): the producer sees a wake-up
// still pending and skips its own, the loop sees no record, and the record
// waits in the outbox while the loop sleeps. bench_services' call section hung
// that way (a call's request stuck in the outbox; see
// ServicesCalls.BackToBackCallsNeverStrandARequestInTheOutbox).
// Both fences are needed. The producer's is one locked instruction per send
// (GCC emits `lock or` on the stack, not mfence); a build without it (which
// can lose wake-ups) measured the same one-way sender CPU, 129-149 ns
// against 128-142 in four alternated bench_core runs each (2026-12-02), so
// folding the check into the outbox's compare-and-swap, which would make a
// drain wait for a producer between its reservation and its publication,
// would buy nothing measurable.
void Broker::wake() {
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (wake_pending_.load(std::memory_order_relaxed) || wake_pending_.exchange(true)) return;
  wakeups_.fetch_add(1, std::memory_order_relaxed);
  std::uint64_t one = 1;
  ssize_t n;
  do {
    n = ::write(wake_fd_, &one, sizeof one);
  } while (n < 0 && errno == EINTR);
  // EAGAIN: the counter is full, so a wake-up is pending anyway.
  if (n < 0 && errno != EAGAIN)
    log().error("broker: cannot wake the loop: write(eventfd): {}", errno_text(errno));
  // No one waits in epoll_wait while the own thread steps aside: call it
  // back (the exchange above and this load pair with step_aside()).
  if (loop_owner_.load(std::memory_order_seq_cst) == kLoopFree) nudge_dedicated();
}

void Broker::arm_waker() {
  // life: a hosted loop may run this after the broker is gone (a wait that
  // completed just before the broker cancelled it); cancelling is not enough.
  waker_.async_wait(asio::posix::descriptor_base::wait_read,
                    [this, life = std::weak_ptr<char>(life_)](const std::error_code& ec) {
    if (ec == asio::error::operation_aborted || life.expired()) return;
    on_waker();
  });
}

void Broker::on_waker() {
  check_loop_thread();
  std::uint64_t count;
  while (::read(wake_fd_, &count, sizeof count) < 0 && errno == EINTR) {
  }
  // Off before draining: whatever is queued from here on brings a new wake
  // (the fence: see wake()).
  wake_pending_.store(false, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  // The sinks (the router's outbox) first, and again before each deferred
  // function: a thread that sends and then asks for something else (a
  // shutdown) has its messages handled first.
  if (run_sinks() >= kStreamingBatch) keep_draining();
  if (drain_deferred()) run_sinks();
  arm_waker();
}

// A thread that streams sends publishes its next record within a
// microsecond or so. Back in epoll_wait the loop would sleep between
// records and each batch would cost the sender an eventfd write and the
// loop a wake-up; on the 2-vCPU guest a faster drain made that worse, not
// better (it slept sooner: four times the sendmsg calls and 1.5 times the
// context switches, bench_core oneway). So a turn that found a batch
// (kStreamingBatch records or more: the sender kept sending while the
// wake-up was on its way) keeps draining while records keep coming,
// kStreamGap apart at most, for up to kStreamTurn; wake_pending_ stays set
// meanwhile, which spares the producers their eventfd writes. The end is as
// in on_waker(): the flag goes off, then one more look. Other events (and
// deferred functions, run just after) wait for at most kStreamTurn.
void Broker::keep_draining() {
  wake_pending_.store(true, std::memory_order_seq_cst);
  const Clock::time_point turn_end = Clock::now() + kStreamTurn;
  Clock::time_point gap_end = Clock::now() + kStreamGap;
  for (Clock::time_point now = Clock::now(); now < gap_end && now < turn_end; now = Clock::now()) {
    if (run_sinks() > 0) gap_end = Clock::now() + kStreamGap;
    else sched_yield();
  }
  wake_pending_.store(false, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  run_sinks();
}

std::size_t Broker::run_sinks() {
  std::size_t n = 0;
  for (std::size_t i = 0; i < wake_sinks_.size(); ++i) n += wake_sinks_[i].second();
  return n;
}

// Runs what is queued now. Returns false if the queue was empty.
bool Broker::drain_deferred() {
  drains_.fetch_add(1, std::memory_order_relaxed);
  bool any = false;
  Task* t;
  while (tasks_.pop(t)) {
    any = true;
    std::unique_ptr<Task> owned(t);
    // Whatever the task's thread sent before deferring it is visible now
    // (the pop synchronises with the push): route it first, so a thread
    // that sends and then asks for a shutdown is obeyed in that order.
    run_sinks();
    try {
      owned->fn();
    } catch (const std::exception& e) {
      log().error("broker: deferred function threw: {}", e.what());
    } catch (...) {
      log().error("broker: deferred function threw a non-standard exception");
    }
  }
  return any;
}

int Broker::on_wake(std::function<std::size_t()> sink) {
  wake_sinks_.emplace_back(next_sink_, std::move(sink));
  return next_sink_++;
}

void Broker::remove_wake_sink(int id) {
  for (auto it = wake_sinks_.begin(); it != wake_sinks_.end(); ++it)
    if (it->first == id) {
      wake_sinks_.erase(it);
      return;
    }
}

Broker::Stats Broker::stats() const {
  return Stats{deferred_count_.load(), wakeups_.load(), drains_.load(), leads_.load(),
               loop_returns_.load(), wait_polls_.load(), wait_polls_answered_.load()};
}

// A timer requested from another thread is created later, on the broker
// thread. Until then its id sits in unborn_timers_, so a cancel that overtakes
// the creation (e.g. issued on the broker thread right after call_later()
// returned elsewhere) removes it there, and the creation then does nothing.
Broker::TimerId Broker::call_later(std::chrono::nanoseconds delay, std::function<void()> fn) {
  TimerId id = next_timer_.fetch_add(1);
  if (on_broker_thread()) {
    create_timer(id, delay, std::move(fn));
    return id;
  }
  {
    std::lock_guard lk(timers_mu_);
    unborn_timers_.insert(id);
  }
  defer([this, id, delay, fn = std::move(fn)]() mutable {
    {
      std::lock_guard lk(timers_mu_);
      if (!unborn_timers_.erase(id)) return;  // cancelled before it was created
    }
    create_timer(id, delay, std::move(fn));
  });
  return id;
}

void Broker::create_timer(TimerId id, std::chrono::nanoseconds delay, std::function<void()> fn) {
  auto timer = std::make_unique<asio::steady_timer>(io_, delay);
  timer->async_wait([this, id, fn = std::move(fn),
                     life = std::weak_ptr<char>(life_)](const std::error_code& ec) {
    if (ec == asio::error::operation_aborted || life.expired()) return;
    check_loop_thread();
    timers_.erase(id);
    fn();
  });
  timers_.emplace(id, std::move(timer));
}

void Broker::cancel_timer(TimerId id) {
  {
    std::lock_guard lk(timers_mu_);
    if (unborn_timers_.erase(id)) return;
  }
  try_defer([this, id] {
    auto it = timers_.find(id);
    if (it == timers_.end()) return;
    it->second->cancel();
    timers_.erase(it);
  });
}

void Broker::watch_child(std::shared_ptr<ChildProcess> child, std::function<void(int)> on_exit) {
  {
    std::lock_guard lk(children_mu_);
    children_.push_back(child);
  }
  // On the loop, once the child has exited: the status to on_exit.
  auto exited = [this, child, on_exit = std::move(on_exit)] {
    auto st = child->reap();
    {
      std::lock_guard lk(children_mu_);
      std::erase(children_, child);
    }
    if (st && on_exit) on_exit(*st);
  };
  // The broker watches its own duplicate, so ChildProcess::wait() can poll
  // the original from another thread.
  int fd;
  try {
    fd = child->dup_pidfd();
  } catch (const Error& e) {
    log().warn("{}; it is reaped by wait() or when the broker ends", e.what());
    return;
  }
  if (fd < 0) {  // a wait() on another thread reaped it already: nothing to watch
    try_defer(std::move(exited));
    return;
  }
  fd_registry::note(fd);
  try_defer([this, fd, exited = std::move(exited)] {
    auto watch = std::make_shared<asio::posix::stream_descriptor>(io_, fd);
    if (hosted()) {
      std::erase_if(child_watches_, [](const auto& w) { return w.expired(); });
      child_watches_.push_back(watch);
    }
    watch->async_wait(asio::posix::descriptor_base::wait_read,
                      [watch, exited, life = std::weak_ptr<char>(life_)](const std::error_code& ec) {
                        if (ec == asio::error::operation_aborted || life.expired()) return;
                        exited();
                      });
  });
}

// After the loop: every child still registered is reaped, waiting out the
// shutdown grace for it to exit on its own (its parent link has closed).
// A hosted broker destroyed on its loop thread must not hold the
// application's loop for that: a thread of its own waits instead.
void Broker::reap_children() {
  std::vector<std::shared_ptr<ChildProcess>> left;
  {
    std::lock_guard lk(children_mu_);
    left.swap(children_);
  }
  auto reap = [grace = opts_.shutdown_grace](std::vector<std::shared_ptr<ChildProcess>> children) {
    for (auto& c : children) {
      int st = c->finish(grace);
      log().debug("broker: reaped child pid={}: {}", c->pid(), describe_wait_status(st));
    }
  };
  std::erase_if(left, [](const auto& c) { return c->reap().has_value(); });  // gone already
  if (left.empty()) return;
  if (hosted() && on_broker_thread()) {
    try {
      std::thread(reap, std::move(left)).detach();
      return;
    } catch (const std::system_error& e) {  // no thread to be had: wait here
      log().warn("broker: no thread to reap {} child(ren) with ({}); the loop waits", left.size(), e.what());
    }
  }
  reap(std::move(left));
}

}  // namespace spindle
