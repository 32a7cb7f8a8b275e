// Broker: the one thread that runs the IO loop.
//
// Role: owns an asio::io_context and the thread that runs it. Everything that
// touches a socket runs on that thread. Other threads reach it only through
// defer() (or post()), which queue a function on a lock-free queue
// (Boost.Lockfree) and wake the loop at most once per batch: the producer
// that finds no wake-up pending writes the broker's eventfd, later ones ride
// on it, so 10,000 defers from another thread cost a handful of syscalls, not
// 10,000, and no producer ever takes a lock. Other queues (the router's
// outbox) share the same wake-up: wake() and on_wake(). When nothing is
// queued and no timer is armed the thread sleeps in epoll_wait with no
// timeout: zero wake-ups per second while idle.
//
// Children: child processes registered with watch_child() are reaped when
// they exit; the destructor reaps those still running (after the shutdown
// grace, SIGKILL): a process using Spindle leaves no zombies.
//
// Shutdown (any thread, idempotent): the broker stops accepting new work,
// tells every ShutdownParticipant to drain (flush, say goodbye), and force-
// closes whatever remains when the grace period (default 5 s) runs out.
// Work accepted during the grace period still runs, including the deferred
// functions still queued when the loop ends; defer() after that throws
// ShutdownError. Nothing accepted is dropped, nothing refused is silent.
//
// Thread safety: defer(), post(), wake(), call_later(), cancel_timer(),
// shutdown(), join(), watch_child() and the state queries are safe from any
// thread. io(), on_wake() and the participant calls are for the broker
// thread only.
// Hosted mode (Broker(asio::io_context&)): no thread of its own. The loop is
// the user's io_context, and the broker thread is the thread that made the
// broker, which must be the one that runs that io_context: a handler of ours
// run by another thread throws Error(kSecondLoopThread) out of its run().
// Finishing cancels what the broker waits on instead of stopping the loop,
// so the user's run() returns once Spindle has nothing left to do;
// on_finished() tells who waits for that. stop_here() finishes at once on
// the loop thread (a hosted runtime destroyed without async_shutdown).
//
// Leader/follower (own thread only): the loop is a role, not a thread. A
// thread that would sleep until the loop brings it something (a blocking
// call's reply) runs the loop itself while no one else does (lead_until), so
// the kernel wakes that thread straight from epoll_wait and no hand-off from
// the broker thread to it is needed. The broker's own thread keeps the loop
// otherwise; after it wakes a sleeping caller it steps aside for a short
// while (kLinger), so that the caller's next wait can lead, and takes the
// loop back when that time passes with the loop free, when a wake() or a
// sleeping caller needs it, or when the loop stops. Only one thread runs the
// loop at a time (loop_owner_), and on_broker_thread() is true on whichever
// does: every rule for "the broker thread" holds for it. The price: a
// socket event that arrives while the loop is free waits up to kLinger (up
// to kMaxLinger after a run of back-to-back leads, loop_lead.cpp).
// A leading thread first polls the loop for up to Options::wait_spin
// (yielding between polls) and only then sleeps in epoll_wait: an answer
// that comes within that window costs neither side a wake-up. The own
// thread does the same after each turn only if Options::own_thread_polls.
//
// Ownership: the owner of a Broker destroys it; the destructor shuts down and
// joins. Participants are borrowed and must unregister before they die. A
// hosted broker borrows its io_context, which must outlive it.
#pragma once

#include <signal.h>

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

#include "broker/fd_registry.h"
#include "broker/input_turns.h"
#include "broker/section_gate.h"

#include <asio/io_context.hpp>
#include <asio/posix/stream_descriptor.hpp>
#include <asio/steady_timer.hpp>
#include <boost/lockfree/queue.hpp>

#include "broker/process.h"
#include "spindle/options.h"

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
    // A thread that leads the loop while it waits (lead_until) polls it for
    // up to this long before it sleeps in epoll_wait; 0 never polls.
    std::chrono::microseconds wait_spin{kDefaultWaitSpin};
    // The own thread polls too, after each turn (the same window): for a
    // process whose own thread does the answering (spindle-router).
    bool own_thread_polls = false;
  };
  // What a context's RouterOptions ask of its broker.
  static Options options_for(const RouterOptions& ro) {
    return Options{.wait_spin = ro.wait_spin, .own_thread_polls = ro.own_thread_polls};
  }

  struct Stats {
    std::uint64_t deferred = 0;       // functions accepted by defer() from other threads
    std::uint64_t wakeups_posted = 0; // wake-ups actually posted to the loop
    std::uint64_t drains = 0;         // times the loop drained the defer queue
    std::uint64_t caller_leads = 0;   // waits in which a caller ran the loop itself
    std::uint64_t loop_returns = 0;   // times the own thread took the loop back
    std::uint64_t wait_polls = 0;     // waits that polled before sleeping (wait_spin)
    std::uint64_t wait_polls_answered = 0;  // ... and were answered while polling
  };

  enum class State { kRunning, kDraining, kStopped };

  Broker();
  explicit Broker(Options opts);
  // Hosted: runs on `loop`, driven by the thread calling this (see above).
  Broker(asio::io_context& loop, Options opts);
  ~Broker();
  Broker(const Broker&) = delete;
  Broker& operator=(const Broker&) = delete;

  // Runs fn on the broker thread: inline if called there, else queued.
  // Throws ShutdownError once the broker has stopped.
  void defer(std::function<void()> fn);
  // Like defer(), but returns false instead of throwing.
  bool try_defer(std::function<void()> fn);
  // Always queued, even on the broker thread: fn runs after the current
  // handler returns (no recursion through the caller's stack).
  bool try_post(std::function<void()> fn);
  // Wakes the loop for the on_wake() sinks (once per batch: coalesced).
  void wake();
  // Held by a producer while it appends to a queue an on_wake() sink drains:
  // the broker's end waits for it, then drains, so nothing accepted is
  // stranded. False (and nothing held) once the broker has finished.
  class ProducerGuard {
   public:
    explicit ProducerGuard(Broker& b) : scope_(b.producers_) {}
    explicit operator bool() const { return static_cast<bool>(scope_); }

   private:
    SectionGate::Scope scope_;
  };
  // Reaps `child` when it exits (its pidfd is watched), then calls on_exit
  // with the wait status on the broker thread. Children still running when
  // the broker is destroyed are reaped there.
  void watch_child(std::shared_ptr<ChildProcess> child, std::function<void(int)> on_exit);

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
  // Runs fn once, on the thread that first calls shutdown() (the broker's
  // for a SHUTDOWN message), or at once if that has happened. fn must not
  // block.
  void on_shutdown_request(std::function<void()> fn);

  bool hosted() const { return !own_io_; }
  // Hosted, on the loop thread: shuts down now, without waiting for the loop
  // (participants are told the grace period is over at once).
  void stop_here();
  // Runs fn once the broker has finished (at once if it has): on the broker
  // thread, or on the thread that finds it finished.
  void on_finished(std::function<void()> fn);
  // Hosted: throws Error unless the calling thread is the loop thread. The
  // handlers that begin every broker turn call it.
  void check_loop_thread() const {
    if (!own_io_ && !on_broker_thread()) refuse_second_thread();
  }

  State state() const { return state_.load(std::memory_order_acquire); }
  bool accepting() const { return state() == State::kRunning; }
  bool on_broker_thread() const { return std::this_thread::get_id() == thread_id_.load(); }
  // Whether the calling thread is some broker's own thread (not a caller
  // that leads a loop for a while): per-thread caches of the loop keep
  // memory only there.
  static bool on_an_own_thread();

  // --- leader/follower (see above) ---
  static constexpr std::chrono::microseconds kLinger{100};
  // A waker turn that found kStreamingBatch records or more drains on while
  // they come at most kStreamGap apart, for up to kStreamTurn
  // (keep_draining()). A sender that sends now and then costs no polling.
  static constexpr std::size_t kStreamingBatch = 8;
  static constexpr std::chrono::microseconds kStreamGap{5};
  static constexpr std::chrono::microseconds kStreamTurn{100};
  static constexpr std::chrono::microseconds kMaxLinger{3200};  // lingers double while callers lead
  // How long a would-be leader waits for the own thread to step aside.
  static constexpr std::chrono::microseconds kHandOverWait{50};
  // How long a leading wait polls before it sleeps: `base`
  // (Options::wait_spin), stretched to a quarter more than `typical` (how
  // long this thread's recent waits took to be answered) when that is
  // longer than `base`, up to kSpinStretch times `base`. A caller whose
  // answers take 100 us (a context over ssh) then reads them while polling,
  // where a 50 us window always missed and it slept; slower answers get
  // that longest window (loop_lead.cpp).
  static constexpr int kSpinStretch = 4;
  // Options::wait_spin: what other waits on this loop's work poll for too
  // (a pool worker's, a Select's).
  std::chrono::microseconds wait_spin() const { return opts_.wait_spin; }
  static std::chrono::nanoseconds spin_window(std::chrono::nanoseconds base, std::chrono::nanoseconds typical);
  enum class Lead { kDone, kBusy, kTimedOut, kStopped };
  // Runs the loop on the calling thread until done(ctx) is true (checked
  // before each handler), `deadline` passes or the loop stops. kBusy, at
  // once: another thread runs the loop, or the broker is hosted.
  Lead lead_until(bool (*done)(const void*), const void* ctx, Clock::time_point deadline);
  // A thread sleeps until something the loop brings (it could not lead):
  // while any does, someone must keep the loop. settle_sleeper() is called
  // exactly once per add_sleeper(), by whoever ends the sleep.
  void add_sleeper() { sleepers_.fetch_add(1, std::memory_order_seq_cst); }
  void settle_sleeper();
  // Loop thread: something was just handed to a thread that would run the
  // loop if it were free (a caller's reply, a pool worker's message); the
  // own thread steps aside after this turn, so that thread's next wait leads.
  void step_aside_soon();
  // A thread other than the loop's completed what a leading caller may be
  // waiting for: wakes the loop so that the caller sees it.
  void nudge_leading_caller();
  // Loop thread, before a write that can raise SIGPIPE (to a pipe): a
  // leading caller's thread blocks it until it leaves the loop, so that a
  // closed pipe gives EPIPE. The own thread blocks it for good.
  void quiet_sigpipe();
  // Kernel thread id of the broker thread (for tests reading /proc).
  pid_t native_tid() const { return tid_.load(); }
  Stats stats() const;

  // --- broker thread only ---
  asio::io_context& io() { return io_; }
  // The streams' input turns queued on this loop (stream.cpp). They belong
  // to the loop, not to a thread: several threads may run it.
  InputTurns& input_turns() { return input_turns_; }
  void add_participant(ShutdownParticipant* p);
  // Told first: the others are told only once every first participant has
  // drained (or the grace period ends). Worker pools use it, so a broker
  // shutdown stops its pools before the router closes the streams.
  void add_first_participant(ShutdownParticipant* p);
  void remove_participant(ShutdownParticipant* p);
  void participant_drained(ShutdownParticipant* p);
  // Runs at every wake-up, after the deferred functions: a queue of another
  // module that producers signal with wake(). Returns an id for
  // remove_wake_sink().
  int on_wake(std::function<std::size_t()> sink);
  void remove_wake_sink(int id);

 private:
  struct Task {
    std::function<void()> fn;
  };
  Broker(Options opts, asio::io_context* hosted);
  [[noreturn]] void refuse_second_thread() const;
  void bind_thread();
  void unblock_sigpipe();  // ~Broker, hosted: undoes what bind_thread() did to this thread
  void end_loop();
  bool push_task(std::function<void()> fn);
  void arm_waker();
  void on_waker();
  void run();
  bool claim_loop(std::uint32_t who);
  void release_loop();
  std::size_t run_one_handler(Clock::time_point deadline);
  template <class Answered>
  std::size_t poll_window(Answered answered, Clock::time_point deadline);
  void serve();
  void step_aside();
  void nudge_dedicated();
  bool drain_deferred();
  std::size_t run_sinks();  // records the sinks handled
  void keep_draining();
  void reap_children();
  void create_timer(TimerId id, std::chrono::nanoseconds delay, std::function<void()> fn);
  void begin_shutdown(std::chrono::milliseconds grace);
  void wait_for_grace_deadline();
  void shorten_grace(std::chrono::milliseconds grace);
  void maybe_finish();
  void tell_rest_once_firsts_drained();
  void tell_rest();
  void finish();

  Options opts_;
  // Taken before io_ exists (empty when hosted): the lowest free fd
  // numbers, where Asio's epoll, eventfd and timerfd then land; those are
  // noted in fd_registry for forked children (fd_registry.h).
  std::vector<int> free_fds_before_;
  std::vector<int> asio_fds_;
  std::unique_ptr<asio::io_context> own_io_;  // null when hosted
  asio::io_context& io_;
  // Expires with the broker: what it posts to a hosted loop (which outlives
  // it) checks this first.
  std::shared_ptr<char> life_ = std::make_shared<char>();
  InputTurns input_turns_{io_, life_};  // after io_ and life_; before own_io_ goes, it drops its streams
  std::atomic<State> state_{State::kRunning};
  std::atomic<pid_t> tid_{0};
  std::atomic<std::thread::id> thread_id_{};
  std::thread thread_;
  // Who runs the loop (leader/follower). The own thread holds it from the
  // start; it parks on park_seq_, which a nudge bumps.
  static constexpr std::uint32_t kLoopFree = 0, kLoopDedicated = 1, kLoopCaller = 2;
  // Free fd numbers probed for the fds Asio makes (its 3 and our eventfd,
  // with room for a thread opening fds meanwhile).
  static constexpr int kAsioFdProbes = 8;
  std::atomic<std::uint32_t> loop_owner_{kLoopDedicated};
  std::atomic<std::uint32_t> park_seq_{0};
  std::atomic<int> sleepers_{0};
  bool step_aside_ = false;  // loop thread: a sleeping caller was woken
  // step_aside_ is set and the own thread has yet to leave: a thread that
  // finds the loop busy now waits a moment for it instead of sleeping.
  std::atomic<bool> handing_over_{false};
  // Leading caller: SIGPIPE blocked by quiet_sigpipe(), and the mask to restore.
  bool leader_quieted_ = false;
  sigset_t leader_old_mask_{};
  // Hosted: the application's thread that bind_thread() blocked SIGPIPE on,
  // unblocked again when the broker is destroyed there (it was not before).
  std::thread::id sigpipe_blocked_on_{};
  // Each lead, counted: the own thread takes the loop back only after a
  // whole linger with no caller leading.
  std::atomic<std::uint32_t> leads_{0};
  std::atomic<std::uint64_t> loop_returns_{0};
  std::atomic<std::uint64_t> wait_polls_{0}, wait_polls_answered_{0};
  // The own thread sleeps until the leading caller leaves (a long lead).
  std::atomic<bool> awaiting_release_{false};

  // The defer queue: producers enter producers_ before they push, so
  // finish() can close it and wait until none is half-way through a push
  // before it takes the last batch: every accepted function runs.
  boost::lockfree::queue<Task*> tasks_{128};
  SectionGate producers_;
  std::atomic<bool> wake_pending_{false};
  int wake_fd_ = -1;  // eventfd
  asio::posix::stream_descriptor waker_;
  std::atomic<std::uint64_t> deferred_count_{0}, wakeups_{0}, drains_{0};
  std::mutex timers_mu_;
  std::unordered_set<TimerId> unborn_timers_;    // guarded by timers_mu_

  std::atomic<bool> shutdown_requested_{false};
  std::vector<std::function<void()>> request_fns_;  // guarded by request_mu_
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
  std::vector<std::pair<int, std::function<std::size_t()>>> wake_sinks_;
  // Hosted: the pidfd watches, cancelled when the broker finishes.
  std::vector<std::weak_ptr<asio::posix::stream_descriptor>> child_watches_;
  std::vector<std::function<void()>> finished_fns_;  // guarded by request_mu_
  int next_sink_ = 1;
  std::mutex children_mu_;
  std::vector<std::shared_ptr<ChildProcess>> children_;  // guarded by children_mu_
};

}  // namespace spindle
