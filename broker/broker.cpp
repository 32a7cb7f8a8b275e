// The defer queue is a mutex-guarded vector swapped out whole by the loop, with
// one flag saying a wake-up is already on its way. A producer posts to the
// io_context only when it turns the flag on; the loop turns it off before it
// takes the batch, so a function queued after the swap posts a fresh wake-up
// and is never stranded.
//
// Finishing takes the same mutex to set closed_ and collect the last batch, so
// every defer() either lands in a batch that runs or sees closed_ and throws.
#include "broker/broker.h"

#include <pthread.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <asio/executor_work_guard.hpp>
#include <asio/post.hpp>

#include "broker/errors.h"
#include "broker/log.h"

namespace spindle {

Broker::Broker() : Broker(Options{}) {}

Broker::Broker(Options opts) : opts_(opts) {
  thread_ = std::thread([this] { run(); });
}

Broker::~Broker() {
  shutdown();
  if (!on_broker_thread() && thread_.joinable()) thread_.join();
  if (thread_.joinable()) thread_.detach();  // destroyed from its own thread: cannot join
}

void Broker::run() {
  thread_id_.store(std::this_thread::get_id());
  tid_.store(static_cast<pid_t>(::syscall(SYS_gettid)));
  // Writes to a closed pipe must come back as EPIPE, not kill the process.
  // Only this thread blocks SIGPIPE; streams consume any that stays pending.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGPIPE);
  if (int err = pthread_sigmask(SIG_BLOCK, &set, nullptr))
    log().error("broker: cannot block SIGPIPE ({}); a write to a closed pipe may kill the process",
                errno_text(err));
  pthread_setname_np(pthread_self(), "spindle-broker");  // cosmetic: failure is harmless

  auto guard = asio::make_work_guard(io_);
  while (true) {
    try {
      io_.run();
      break;
    } catch (const std::exception& e) {
      // A handler threw: log it and keep serving everyone else.
      log().error("broker: handler threw: {}", e.what());
    }
  }
  finish();
}

bool Broker::try_defer(std::function<void()> fn) {
  if (on_broker_thread()) {
    fn();
    return true;
  }
  bool post = false;
  {
    std::lock_guard lk(defer_mu_);
    if (closed_) return false;
    deferred_.push_back(std::move(fn));
    ++stats_.deferred;
    if (!wake_posted_) {
      wake_posted_ = true;
      ++stats_.wakeups_posted;
      post = true;
    }
  }
  if (post) asio::post(io_, [this] { drain_deferred(); });
  return true;
}

void Broker::defer(std::function<void()> fn) {
  if (!try_defer(std::move(fn))) throw ShutdownError(std::string(errtext::kBrokerShutDown));
}

void Broker::drain_deferred() {
  std::vector<std::function<void()>> batch;
  {
    std::lock_guard lk(defer_mu_);
    wake_posted_ = false;
    batch.swap(deferred_);
    ++stats_.drains;
  }
  for (auto& fn : batch) {
    try {
      fn();
    } catch (const std::exception& e) {
      log().error("broker: deferred function threw: {}", e.what());
    }
  }
}

Broker::Stats Broker::stats() const {
  std::lock_guard lk(defer_mu_);
  return stats_;
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
    std::lock_guard lk(defer_mu_);
    unborn_timers_.insert(id);
  }
  defer([this, id, delay, fn = std::move(fn)]() mutable {
    {
      std::lock_guard lk(defer_mu_);
      if (!unborn_timers_.erase(id)) return;  // cancelled before it was created
    }
    create_timer(id, delay, std::move(fn));
  });
  return id;
}

void Broker::create_timer(TimerId id, std::chrono::nanoseconds delay, std::function<void()> fn) {
  auto timer = std::make_unique<asio::steady_timer>(io_, delay);
  timer->async_wait([this, id, fn = std::move(fn)](const std::error_code& ec) {
    if (ec == asio::error::operation_aborted) return;
    timers_.erase(id);
    fn();
  });
  timers_.emplace(id, std::move(timer));
}

void Broker::cancel_timer(TimerId id) {
  {
    std::lock_guard lk(defer_mu_);
    if (unborn_timers_.erase(id)) return;
  }
  try_defer([this, id] {
    auto it = timers_.find(id);
    if (it == timers_.end()) return;
    it->second->cancel();
    timers_.erase(it);
  });
}

void Broker::shutdown() { shutdown(opts_.shutdown_grace); }

void Broker::shutdown(std::chrono::milliseconds grace) {
  bool again;
  {
    std::lock_guard lk(request_mu_);
    again = shutdown_requested_.exchange(true);
  }
  if (again) {
    // A later request may only shorten the grace period (a second Ctrl-C).
    try_defer([this, grace] { shorten_grace(grace); });
    return;
  }
  request_cv_.notify_all();
  try_defer([this, grace] { begin_shutdown(grace); });
}

void Broker::wait_for_shutdown_request() {
  std::unique_lock lk(request_mu_);
  request_cv_.wait(lk, [this] { return shutdown_requested_.load(); });
}

void Broker::join() {
  if (on_broker_thread()) throw Error("Broker::join() called on the broker thread");
  if (thread_.joinable()) thread_.join();
}

void Broker::begin_shutdown(std::chrono::milliseconds grace) {
  state_.store(State::kDraining, std::memory_order_release);
  log().debug("broker: shutdown begins, {} participant(s), grace {} ms", participants_.size(),
              grace.count());
  deadline_ = std::make_unique<asio::steady_timer>(io_, grace);
  wait_for_grace_deadline();
  // Copy: a participant may unregister itself while being told.
  auto firsts = first_;
  for (auto* p : firsts)
    if (participants_.count(p)) p->on_shutdown_begin();
  tell_rest_once_firsts_drained();
  maybe_finish();
}

void Broker::wait_for_grace_deadline() {
  deadline_->async_wait([this](const std::error_code& ec) {
    if (ec == asio::error::operation_aborted) return;
    log().warn("broker: shutdown grace period over; force-closing {} participant(s)",
               participants_.size() - drained_.size());
    tell_rest();
    auto left = participants_;
    for (auto* p : left) {
      if (!drained_.count(p)) p->on_shutdown_deadline();
    }
    finishing_ = true;
    io_.stop();
  });
}

void Broker::shorten_grace(std::chrono::milliseconds grace) {
  if (state() != State::kDraining || !deadline_ || finishing_) return;
  auto when = Clock::now() + grace;
  if (when >= deadline_->expiry()) return;
  deadline_->expires_at(when);  // aborts the pending wait, which then returns
  wait_for_grace_deadline();
}

// Participants added with add_first_participant() (worker pools) drain before
// the others are told, so that calls they finish can still be answered over
// streams that the router has not yet begun to close.
void Broker::tell_rest_once_firsts_drained() {
  for (auto* p : first_)
    if (!drained_.count(p)) return;
  tell_rest();
}

void Broker::tell_rest() {
  if (rest_told_) return;
  rest_told_ = true;
  auto all = participants_;
  for (auto* p : all)
    if (!first_.count(p) && participants_.count(p)) p->on_shutdown_begin();
}

void Broker::add_participant(ShutdownParticipant* p) { participants_.insert(p); }

void Broker::add_first_participant(ShutdownParticipant* p) {
  participants_.insert(p);
  first_.insert(p);
}

void Broker::remove_participant(ShutdownParticipant* p) {
  participants_.erase(p);
  drained_.erase(p);
  first_.erase(p);
  if (state() == State::kDraining) {
    tell_rest_once_firsts_drained();
    maybe_finish();
  }
}

void Broker::participant_drained(ShutdownParticipant* p) {
  if (participants_.count(p)) drained_.insert(p);
  if (state() == State::kDraining) {
    tell_rest_once_firsts_drained();
    maybe_finish();
  }
}

void Broker::maybe_finish() {
  if (finishing_ || drained_.size() < participants_.size()) return;
  finishing_ = true;
  // Let handlers already queued (e.g. deferred work) run before stopping.
  asio::post(io_, [this] {
    if (deadline_) deadline_->cancel();
    io_.stop();
  });
}

// Runs on the broker thread after the loop ended: runs every deferred function
// accepted so far, then refuses all later ones.
void Broker::finish() {
  while (true) {
    std::vector<std::function<void()>> batch;
    {
      std::lock_guard lk(defer_mu_);
      if (deferred_.empty()) {
        closed_ = true;
        break;
      }
      batch.swap(deferred_);
    }
    for (auto& fn : batch) {
      try {
        fn();
      } catch (const std::exception& e) {
        log().error("broker: deferred function threw during shutdown: {}", e.what());
      }
    }
  }
  timers_.clear();
  deadline_.reset();
  state_.store(State::kStopped, std::memory_order_release);
  shutdown_requested_.store(true);
  log().debug("broker: stopped");
}

}  // namespace spindle
