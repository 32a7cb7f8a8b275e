// Leader/follower: who runs the loop (broker.h).
//
// A blocking call used to cost its caller a hand-off: the broker thread woke
// from epoll_wait, read the reply, and woke the caller from its futex, two
// wake-ups where a raw socket read costs one. Here the caller runs the loop
// itself while it waits, when no one else runs it: epoll_wait wakes the
// caller, the reply's handler completes the caller's own slot, and it returns.
//
// loop_owner_ says who runs the loop: the own thread, a caller, or nobody.
// Taking it is one compare-and-swap; leaving it is one store, plus a nudge
// (a futex wake of the own thread) only when someone needs the loop then: a
// thread sleeping on a reply, a wake-up waiting in the eventfd, or a stopped
// loop that the own thread must finish. The own thread steps aside after it
// wakes a sleeping caller, and takes the loop back after kLinger with the
// loop free, so a caller that calls again at once leads every time after
// the first, and a caller that goes away leaves the loop unattended for at
// most kLinger (a wake() from another thread ends that at once). Each linger
// that ends with a new lead begun (callers calling back to back) doubles
// the next, up to kMaxLinger. At one look per kLinger the own thread woke
// about once per call over ssh (100-200 us): on the 2-vCPU guest those
// wake-ups took the CPU from ssh and sshd on the call's path (bench_ssh's
// round trip 1.55x of raw `ssh cat`, 1.23x with the doubling). With short
// calls it woke every few calls, in the middle of one: on one CPU those
// calls were the round trip's p99 (37 us against a 13 us median; 17-19 us
// with a 3.2 ms cap, 37 us with 0.8 ms). The price is that a caller that
// stops after such a run leaves the loop unattended for up to kMaxLinger;
// while callers keep calling, each of their leads runs the loop anyway.
//
// A leader polls before it sleeps (Options::wait_spin). A wake-up is the
// dearest step of a round trip: on the 2-vCPU guest this was measured on, a
// Python call to a forked child took 92 us unpinned with both sides asleep
// in epoll_wait between messages, and 25 us when each polled for up to 50 us
// first, with less CPU in all (the wake-ups' inter-processor interrupts and
// context switches cost more than the polls). The poller yields between
// polls, so a peer on the same CPU still runs (pinned to one CPU: 29 us
// either way), and a thread whose polls keep finding nothing stops polling
// for a while (broker/poll_history.h), so a thread that waits long wastes
// little.
// The window stretches to what the thread's answers have been taking, up
// to four times wait_spin (spin_window()): over ssh to localhost a call's
// answer takes about 100 us, so a 50 us window always missed, the thread
// backed off and slept, and each call paid the wake-up (bench_ssh's round
// trip 128 us against raw `ssh cat`'s 87 us; with the stretch, see
// DESIGN.md). A thread pays for it in CPU: up to the window per wait.
// Slower answers get that longest window (spin_window()).
//
// Each pair of "store mine, then load theirs" below (owner against sleepers_,
// owner against wake_pending_) is sequentially consistent: of two threads
// racing, at least one sees the other, so no wake-up is lost.
#include <pthread.h>
#include <sched.h>
#include <signal.h>

#include <algorithm>

#include "broker/broker.h"
#include "broker/errors.h"
#include "broker/futex.h"
#include "broker/log.h"
#include "broker/poll_history.h"
#include "broker/sigpipe.h"

namespace spindle {

// The first Options::wait_spin of a wait: runs what is ready without
// sleeping, yielding the CPU after each empty poll, until answered(handlers
// run so far in this window), the window ends or the loop stops. Returns
// the handlers run; skipped (0) while this thread backs off (poll_history.h).
template <class Answered>
std::size_t Broker::poll_window(Answered answered, Clock::time_point deadline) {
  const auto window = poll_history::window(opts_.wait_spin);
  if (window.count() <= 0) return 0;
  wait_polls_.fetch_add(1, std::memory_order_relaxed);
  const Clock::time_point until = std::min(Clock::now() + window, deadline);
  std::size_t ran = 0;
  bool hit = false;
  while (!(hit = answered(ran)) && !io_.stopped() && Clock::now() < until) {
    const std::size_t n = run_one_handler(Clock::time_point::min());
    ran += n;
    if (n == 0) sched_yield();
  }
  if (hit) wait_polls_answered_.fetch_add(1, std::memory_order_relaxed);
  poll_history::polled(hit);
  return ran;
}

// Answers slower than the longest window get that window: the early ones
// among them are read while polling, and a thread whose polls keep missing
// backs off (poll_history.h). With `base` there instead, a thread whose
// answers drifted past the longest window never polled again, since
// sleeping made them slower still: bench_ssh's caller fell into that on a
// slow day (answers at 220-230 us, 1,313-1,381 of ~3,180 waits polled,
// 1.37x and 1.43x of raw `ssh cat`; 1.15-1.27x in seven runs after, with
// 2,671-3,167 polled).
std::chrono::nanoseconds Broker::spin_window(std::chrono::nanoseconds base, std::chrono::nanoseconds typical) {
  if (base.count() <= 0 || typical <= base) return base;
  return std::min(typical + typical / 4, base * kSpinStretch);
}

// Takes the free loop for the calling thread, as `who`.
bool Broker::claim_loop(std::uint32_t who) {
  std::uint32_t expect = kLoopFree;
  if (loop_owner_.load(std::memory_order_relaxed) != kLoopFree ||
      !loop_owner_.compare_exchange_strong(expect, who, std::memory_order_seq_cst))
    return false;
  thread_id_.store(std::this_thread::get_id());
  return true;
}

void Broker::release_loop() {
  thread_id_.store(std::thread::id{});
  loop_owner_.store(kLoopFree, std::memory_order_seq_cst);
}

// One handler, or none by `deadline` (0); Clock::time_point::min() only
// polls (runs one that is ready, never sleeps). A handler that threw is
// logged and counts as run: the loop keeps serving everyone else.
std::size_t Broker::run_one_handler(Clock::time_point deadline) {
  try {
    if (deadline == Clock::time_point::min()) return io_.poll_one();
    return deadline == Clock::time_point::max() ? io_.run_one() : io_.run_one_until(deadline);
  } catch (const std::exception& e) {
    log().error("broker: handler threw: {}", e.what());
  } catch (...) {
    log().error("broker: handler threw a non-standard exception");
  }
  return 1;
}

// The own thread, holding the loop: runs it until it stops, or until it has
// woken a sleeping caller and no other caller sleeps. With own_thread_polls
// it polls for its next turn first; a window in which a handler ran counts
// as answered.
void Broker::serve() {
  while (true) {
    const bool polled = opts_.own_thread_polls &&
                        poll_window([](std::size_t ran) { return ran > 0; }, Clock::time_point::max()) != 0;
    if (!polled && run_one_handler(Clock::time_point::max()) == 0) return;  // the loop stopped
    if (!step_aside_) continue;
    step_aside_ = false;
    if (sleepers_.load(std::memory_order_relaxed) == 0) return;
    handing_over_.store(false, std::memory_order_release);
  }
}

// The own thread leaves the loop free, and returns once it holds it again:
// at once when someone needs the loop (a sleeper, a pending wake-up, a
// stopped loop); after a whole linger in which no caller began to lead; or,
// when one caller's lead outlasts a linger (a long call), once that caller
// leaves: it nudges us then, so a long call costs no wake-up per linger.
void Broker::step_aside() {
  std::uint32_t seq = park_seq_.load(std::memory_order_seq_cst);
  release_loop();
  handing_over_.store(false, std::memory_order_release);
  auto take = [this] {
    if (!claim_loop(kLoopDedicated)) return false;
    loop_returns_.fetch_add(1, std::memory_order_relaxed);
    return true;
  };
  std::uint32_t leads = leads_.load(std::memory_order_seq_cst);
  bool until_release = false;
  auto linger = kLinger;
  while (true) {
    if ((sleepers_.load(std::memory_order_seq_cst) > 0 || wake_pending_.load(std::memory_order_seq_cst) ||
         io_.stopped()) &&
        take())
      return;
    auto until = Clock::now() + linger;
    if (until_release) {
      awaiting_release_.store(true, std::memory_order_seq_cst);
      if (loop_owner_.load(std::memory_order_seq_cst) == kLoopCaller) until = Clock::time_point::max();
    }
    bool timed_out = !futex::wait(park_seq_, seq, until);
    awaiting_release_.store(false, std::memory_order_relaxed);
    until_release = false;
    std::uint32_t now_seq = park_seq_.load(std::memory_order_seq_cst);
    if (now_seq != seq) {  // nudged
      seq = now_seq;
      if (take()) return;
      continue;
    }
    if (!timed_out && until != Clock::time_point::max()) continue;  // a spurious wake-up
    std::uint32_t now_leads = leads_.load(std::memory_order_seq_cst);
    if (now_leads != leads) {  // a caller began to lead: it is at work
      leads = now_leads;
      linger = std::min(linger * 2, kMaxLinger);
      continue;
    }
    if (take()) return;
    until_release = true;  // the same lead for a whole linger
  }
}

void Broker::nudge_dedicated() {
  park_seq_.fetch_add(1, std::memory_order_seq_cst);
  futex::wake(park_seq_, 1);
}

Broker::Lead Broker::lead_until(bool (*done)(const void*), const void* ctx, Clock::time_point deadline) {
  if (hosted()) return Lead::kBusy;
  if (!claim_loop(kLoopCaller)) {
    // The own thread may be finishing the very turn that handed this thread
    // its last message, and about to step aside for it: give it a moment
    // (bounded: that turn may run a slow handler) rather than sleep.
    if (!handing_over_.load(std::memory_order_acquire)) return Lead::kBusy;
    const auto until = Clock::now() + kHandOverWait;
    while (handing_over_.load(std::memory_order_acquire) && Clock::now() < until) std::this_thread::yield();
    if (!claim_loop(kLoopCaller)) return Lead::kBusy;
  }
  leads_.fetch_add(1, std::memory_order_relaxed);
  Lead how = Lead::kDone;
  const Clock::time_point began = Clock::now();
  if (!done(ctx)) poll_window([done, ctx](std::size_t) { return done(ctx); }, deadline);
  while (!done(ctx)) {
    if (run_one_handler(deadline) == 0) {
      how = io_.stopped() ? Lead::kStopped : Lead::kTimedOut;
      break;
    }
  }
  if (how == Lead::kDone) poll_history::answered_after(Clock::now() - began);
  if (leader_quieted_) {
    // A write to a closed pipe left SIGPIPE pending on this thread: consume
    // it, or unblocking would deliver it.
    leader_quieted_ = false;
    sigpipe::consume_pending();
    pthread_sigmask(SIG_SETMASK, &leader_old_mask_, nullptr);
  }
  release_loop();
  if (sleepers_.load(std::memory_order_seq_cst) > 0 || wake_pending_.load(std::memory_order_seq_cst) ||
      awaiting_release_.load(std::memory_order_seq_cst) || io_.stopped())
    nudge_dedicated();
  return how;
}

void Broker::settle_sleeper() {
  sleepers_.fetch_sub(1, std::memory_order_seq_cst);
  step_aside_soon();  // if the own thread woke the caller: its next wait leads
}

void Broker::step_aside_soon() {
  if (hosted() || !on_broker_thread() || loop_owner_.load(std::memory_order_relaxed) != kLoopDedicated) return;
  step_aside_ = true;
  handing_over_.store(true, std::memory_order_release);
}

// A pipe write that meets EPIPE consumes the SIGPIPE it left pending
// (stream_tx.cpp) before the mask is restored.
void Broker::quiet_sigpipe() {
  if (leader_quieted_ || loop_owner_.load(std::memory_order_relaxed) != kLoopCaller) return;
  const sigset_t set = sigpipe::only();
  if (int err = pthread_sigmask(SIG_BLOCK, &set, &leader_old_mask_)) {
    log().error("broker: cannot block SIGPIPE ({}); a write to a closed pipe may kill the process",
                errno_text(err));
    return;
  }
  leader_quieted_ = true;
}

void Broker::nudge_leading_caller() {
  if (loop_owner_.load(std::memory_order_seq_cst) == kLoopCaller) wake();
}

}  // namespace spindle
