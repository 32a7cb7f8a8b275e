// The broker's shutdown: a request from any thread (shutdown()), the drain
// it starts on the loop (begin_shutdown: every ShutdownParticipant is told
// to drain, the first ones before the rest, and a grace timer bounds the
// wait), the loop's end once all have drained (maybe_finish, end_loop), and
// finish(), which runs every deferred function accepted until then and only
// then refuses new ones, so that nothing accepted is lost. docs/DESIGN.md,
// "Shutdown semantics", gives the rules; broker.cpp has the rest of the
// broker (its thread, defer(), wake-ups, timers, children).
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include <asio/post.hpp>

#include "broker/broker.h"
#include "broker/errors.h"
#include "broker/log.h"

namespace spindle {

void Broker::shutdown() { shutdown(opts_.shutdown_grace); }

void Broker::shutdown(std::chrono::milliseconds grace) {
  bool again;
  {
    std::lock_guard lk(request_mu_);
    again = shutdown_requested_.exchange(true);
  }
  if (again) {
    // A later request may only shorten the grace period (a second Ctrl-C).
    try_post([this, grace] { shorten_grace(grace); });
    return;
  }
  request_cv_.notify_all();
  std::vector<std::function<void()>> fns;
  {
    std::lock_guard lk(request_mu_);
    fns.swap(request_fns_);
  }
  for (auto& fn : fns) fn();
  try_post([this, grace] { begin_shutdown(grace); });
}

void Broker::on_shutdown_request(std::function<void()> fn) {
  {
    std::lock_guard lk(request_mu_);
    if (!shutdown_requested_.load()) {
      request_fns_.push_back(std::move(fn));
      return;
    }
  }
  fn();
}

void Broker::wait_for_shutdown_request() {
  std::unique_lock lk(request_mu_);
  request_cv_.wait(lk, [this] { return shutdown_requested_.load(); });
}

void Broker::join() {
  if (on_broker_thread()) throw Error("Broker::join() called on the broker thread");
  if (thread_.joinable()) thread_.join();
  if (hosted()) {  // no thread to join: wait until the loop has finished us
    std::unique_lock lk(request_mu_);
    request_cv_.wait(lk, [this] { return state() == State::kStopped; });
  }
}

void Broker::on_finished(std::function<void()> fn) {
  {
    std::lock_guard lk(request_mu_);
    if (state() != State::kStopped) {
      finished_fns_.push_back(std::move(fn));
      return;
    }
  }
  fn();
}

void Broker::refuse_second_thread() const { throw Error(std::string(errtext::kSecondLoopThread)); }

// Hosted, on the loop thread: the whole shutdown in one step. A begin or
// deadline step still queued finds the broker stopped and does nothing.
void Broker::stop_here() {
  if (!hosted() || !on_broker_thread()) throw Error("Broker::stop_here() is for a hosted broker's loop thread");
  if (state() == State::kStopped) return;
  shutdown(std::chrono::milliseconds(0));  // the request's bookkeeping; its queued begin finds us done
  if (state() == State::kRunning) begin_shutdown(std::chrono::milliseconds(0));
  if (state() == State::kStopped) return;  // it drained at once
  tell_rest();
  auto left = participants_;
  for (auto* p : left)
    if (participants_.count(p) && !drained_.count(p)) p->on_shutdown_deadline();
  finishing_ = true;
  end_loop();
}

// The loop's work for this broker is over. Its own loop stops (run() then
// calls finish()); a hosted loop belongs to the application and runs on, so
// the broker finishes here and cancels all it waits on, which lets the
// application's run() return once nothing else is pending.
void Broker::end_loop() {
  if (!hosted()) return io_.stop();
  if (state() == State::kStopped) return;
  finish();
  std::error_code ignored;
  waker_.cancel(ignored);
  for (auto& w : child_watches_)
    if (auto watch = w.lock()) watch->cancel(ignored);
  child_watches_.clear();
}

void Broker::begin_shutdown(std::chrono::milliseconds grace) {
  if (state() != State::kRunning) return;  // stop_here() came first
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
  deadline_->async_wait([this, life = std::weak_ptr<char>(life_)](const std::error_code& ec) {
    if (ec == asio::error::operation_aborted || life.expired()) return;
    log().warn("broker: shutdown grace period over; force-closing {} participant(s)",
               participants_.size() - drained_.size());
    tell_rest();
    auto left = participants_;
    for (auto* p : left) {
      if (!drained_.count(p)) p->on_shutdown_deadline();
    }
    finishing_ = true;
    end_loop();
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

// A participant that joins while the broker drains is told at once: it
// would otherwise never be told, never drain, and hold the shutdown until
// the grace period ends (a pool a child's main made after SHUTDOWN came).
void Broker::add_participant(ShutdownParticipant* p) {
  participants_.insert(p);
  if (state() == State::kDraining && rest_told_) p->on_shutdown_begin();
}

void Broker::add_first_participant(ShutdownParticipant* p) {
  participants_.insert(p);
  first_.insert(p);
  if (state() == State::kDraining) p->on_shutdown_begin();
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
  asio::post(io_, [this, life = std::weak_ptr<char>(life_)] {
    if (life.expired()) return;  // a hosted broker already gone
    if (deadline_) deadline_->cancel();
    end_loop();
  });
}

// Runs on the broker thread after the loop ended: runs every deferred function
// accepted so far (and the wake sinks, whose queues may hold work too), then
// refuses all later ones.
void Broker::finish() {
  producers_.close();
  // A producer may be waiting for room in a sink's queue: keep draining.
  while (!producers_.empty()) {
    run_sinks();
    std::this_thread::yield();
  }
  do {
    run_sinks();
  } while (drain_deferred());
  timers_.clear();
  deadline_.reset();
  // The eventfd stays open until the destructor: a late wake() from another
  // thread must write to it, never to a number reused by something else.
  state_.store(State::kStopped, std::memory_order_release);
  std::vector<std::function<void()>> fns;
  {
    std::lock_guard lk(request_mu_);
    shutdown_requested_.store(true);
    fns.swap(request_fns_);
  }
  request_cv_.notify_all();
  for (auto& fn : fns) fn();
  {
    std::lock_guard lk(request_mu_);
    fns.swap(finished_fns_);
  }
  for (auto& fn : fns) fn();
  log().debug("broker: stopped");
}

}  // namespace spindle
