// Broker: the one thread that runs the IO loop.
//
// Role: owns an asio::io_context and the thread that runs it. Everything that
// touches a socket runs on that thread. Other threads reach it only through
// defer(), which queues a function and wakes the loop at most once per batch:
// the first defer() into an empty queue posts one wake-up, later ones ride on
// it, so 10,000 defers from another thread cost a handful of syscalls, not
// 10,000. When nothing is queued and no timer is armed the thread sleeps in
// epoll_wait with no timeout: zero wake-ups per second while idle.
//
// Shutdown (any thread, idempotent): the broker stops accepting new work,
// tells every ShutdownParticipant to drain (flush, say goodbye), and force-
// closes whatever remains when the grace period (default 5 s) runs out.
// Work accepted during the grace period still runs, including the deferred
// functions still queued when the loop ends; defer() after that throws
// ShutdownError. Nothing accepted is dropped, nothing refused is silent.
//
// Thread safety: defer(), call_later(), cancel_timer(), shutdown(), join(),
// and the state queries are safe from any thread. io() and the participant
// calls are for the broker thread only.
// Ownership: the owner of a Broker destroys it; the destructor shuts down and
// joins. Participants are borrowed and must unregister before they die.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <asio/io_context.hpp>
#include <asio/steady_timer.hpp>

namespace spindle {

class Broker;

// Something that must drain before the broker stops (a Router, a listener).
class ShutdownParticipant {
 public:
  virtual ~ShutdownParticipant() = default;
  // Begin draining; call broker.participant_drained(this) when done.
  virtual void on_shutdown_begin() = 0;
  // The grace period is over: close everything now.
  virtual void on_shutdown_deadline() = 0;
};

class Broker {
 public:
  using Clock = std::chrono::steady_clock;
  using TimerId = std::uint64_t;

  struct Options {
    std::chrono::milliseconds shutdown_grace{5000};
  };

  struct Stats {
    std::uint64_t deferred = 0;       // functions accepted by defer() from other threads
    std::uint64_t wakeups_posted = 0; // wake-ups actually posted to the loop
    std::uint64_t drains = 0;         // times the loop drained the defer queue
  };

  enum class State { kRunning, kDraining, kStopped };

  Broker();
  explicit Broker(Options opts);
  ~Broker();
  Broker(const Broker&) = delete;
  Broker& operator=(const Broker&) = delete;

  // Runs fn on the broker thread: inline if called there, else queued.
  // Throws ShutdownError once the broker has stopped.
  void defer(std::function<void()> fn);
  // Like defer(), but returns false instead of throwing.
  bool try_defer(std::function<void()> fn);

  // Runs fn on the broker thread after `delay`. The id can cancel it.
  TimerId call_later(std::chrono::nanoseconds delay, std::function<void()> fn);
  void cancel_timer(TimerId id);

  // Begins graceful shutdown. `grace` overrides Options::shutdown_grace. A
  // later call can only shorten the grace period still left.
  void shutdown();
  void shutdown(std::chrono::milliseconds grace);
  // Waits for the broker thread to finish. Must not be called on it.
  void join();
  // Blocks until shutdown() has been called (by anyone, for any reason).
  void wait_for_shutdown_request();

  State state() const { return state_.load(std::memory_order_acquire); }
  bool accepting() const { return state() == State::kRunning; }
  bool on_broker_thread() const { return std::this_thread::get_id() == thread_id_.load(); }
  // Kernel thread id of the broker thread (for tests reading /proc).
  pid_t native_tid() const { return tid_.load(); }
  Stats stats() const;

  // --- broker thread only ---
  asio::io_context& io() { return io_; }
  void add_participant(ShutdownParticipant* p);
  // Told first: the others are told only once every first participant has
  // drained (or the grace period ends). Worker pools use it, so a broker
  // shutdown stops its pools before the router closes the streams.
  void add_first_participant(ShutdownParticipant* p);
  void remove_participant(ShutdownParticipant* p);
  void participant_drained(ShutdownParticipant* p);

 private:
  void run();
  void drain_deferred();
  void create_timer(TimerId id, std::chrono::nanoseconds delay, std::function<void()> fn);
  void begin_shutdown(std::chrono::milliseconds grace);
  void wait_for_grace_deadline();
  void shorten_grace(std::chrono::milliseconds grace);
  void maybe_finish();
  void tell_rest_once_firsts_drained();
  void tell_rest();
  void finish();

  Options opts_;
  asio::io_context io_;
  std::atomic<State> state_{State::kRunning};
  std::atomic<pid_t> tid_{0};
  std::atomic<std::thread::id> thread_id_{};
  std::thread thread_;

  mutable std::mutex defer_mu_;
  std::vector<std::function<void()>> deferred_;  // guarded by defer_mu_
  bool wake_posted_ = false;                     // guarded by defer_mu_
  bool closed_ = false;                          // guarded by defer_mu_: no more defers
  Stats stats_;                                  // guarded by defer_mu_
  std::unordered_set<TimerId> unborn_timers_;    // guarded by defer_mu_

  std::atomic<bool> shutdown_requested_{false};
  std::mutex request_mu_;
  std::condition_variable request_cv_;
  std::atomic<TimerId> next_timer_{1};
  // broker thread only:
  std::unordered_map<TimerId, std::unique_ptr<asio::steady_timer>> timers_;
  std::unordered_set<ShutdownParticipant*> participants_;
  std::unordered_set<ShutdownParticipant*> drained_;
  std::unordered_set<ShutdownParticipant*> first_;  // subset of participants_
  bool rest_told_ = false;
  std::unique_ptr<asio::steady_timer> deadline_;
  bool finishing_ = false;
};

}  // namespace spindle
