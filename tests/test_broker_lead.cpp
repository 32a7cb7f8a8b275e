// Leader/follower (broker.h, loop_lead.cpp): a waiting caller runs the loop
// itself while no one else does, and the broker's own thread takes it back
// when the caller leaves. Each test checks on which kernel thread the loop's
// work really ran, and that nothing waits for a thread that is not coming.
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include <asio/posix/stream_descriptor.hpp>
#include <gtest/gtest.h>

#include "broker/broker.h"
#include "router/child.h"
#include "router/router.h"
#include "services/pool.h"
#include "spindle/frame.h"
#include "spindle/options.h"
#include "stream/tx_queue.h"
#include "stream_test_util.h"
#include "tests/router_test_util.h"

namespace spindle {
namespace test_broker_lead {

using namespace std::chrono_literals;
using testutil::flag_set;
using testutil::gettid_now;
using testutil::join_bounded;
using testutil::kGuard;
using testutil::lead_after_step_aside;
using testutil::run_on;
using testutil::voluntary_switches;
using testutil::wait_for_a_lead;
using Clock = std::chrono::steady_clock;

TEST(BrokerLead, AWaitingCallerRunsTheLoopAndWorkFromOtherThreadsRunsOnIt) {
  Broker broker;
  std::atomic<bool> done{false};
  std::atomic<pid_t> ran_on{0};
  std::atomic<bool> inside_is_broker{false};
  const auto leads_before = broker.stats().caller_leads;
  std::thread other([&] {
    wait_for_a_lead(broker, leads_before);
    broker.defer([&] {
      ran_on = gettid_now();
      inside_is_broker = broker.on_broker_thread();
      done = true;
    });
  });
  EXPECT_EQ(lead_after_step_aside(broker, done, Clock::now() + kGuard), Broker::Lead::kDone);
  other.join();
  EXPECT_EQ(ran_on.load(), gettid_now()) << "the deferred function ran on the leading caller";
  EXPECT_NE(ran_on.load(), broker.native_tid());
  EXPECT_TRUE(inside_is_broker.load()) << "on_broker_thread() holds for whoever runs the loop";
  EXPECT_FALSE(broker.on_broker_thread()) << "and stops holding when it leaves";
  EXPECT_EQ(broker.stats().caller_leads, leads_before + 1);
}

TEST(BrokerLead, TheOwnThreadHoldsTheLoopUntilItStepsAside) {
  Broker broker;
  std::atomic<bool> done{false};
  EXPECT_EQ(broker.lead_until(&flag_set, &done, Clock::now() + 1s), Broker::Lead::kBusy);
  const pid_t ran_on = run_on(broker, [] { return gettid_now(); });
  EXPECT_EQ(ran_on, broker.native_tid());
}

TEST(BrokerLead, TheOwnThreadTakesTheLoopBackForDefersAndSocketsWhenTheCallerLeaves) {
  Broker broker;
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  std::promise<pid_t> readable;
  auto readable_fut = readable.get_future();
  auto desc = run_on(broker, [&] {
    auto d = std::make_shared<asio::posix::stream_descriptor>(broker.io(), sv[0]);
    d->async_wait(asio::posix::descriptor_base::wait_read,
                  [&readable](const std::error_code& ec) {
                    if (!ec) readable.set_value(gettid_now());
                  });
    return d;
  });
  std::atomic<bool> done{true};  // leads, finds nothing to wait for, and leaves
  EXPECT_EQ(lead_after_step_aside(broker, done, Clock::now() + kGuard), Broker::Lead::kDone);

  // No one nudges the own thread for a socket: it comes back by itself.
  ASSERT_EQ(::write(sv[1], "x", 1), 1);
  ASSERT_EQ(readable_fut.wait_for(kGuard), std::future_status::ready) << "a socket event was stranded";
  EXPECT_EQ(readable_fut.get(), broker.native_tid());

  EXPECT_EQ(lead_after_step_aside(broker, done, Clock::now() + kGuard), Broker::Lead::kDone);
  std::promise<pid_t> deferred;
  broker.defer([&] { deferred.set_value(gettid_now()); });
  auto fut = deferred.get_future();
  ASSERT_EQ(fut.wait_for(kGuard), std::future_status::ready) << "a deferred function was stranded";
  EXPECT_EQ(fut.get(), broker.native_tid());
  run_on(broker, [&] { desc.reset(); });
  ::close(sv[1]);
}

TEST(BrokerLead, ALongLeadCostsTheOwnThreadNoWakeUpPerLinger) {
  Broker broker;
  std::atomic<bool> never{false};
  testutil::settle(broker);  // the own thread has started: native_tid() is known
  const pid_t own = broker.native_tid();
  const auto leads = broker.stats().caller_leads;
  std::atomic<long> switches{-1};
  std::thread watcher([&] {
    wait_for_a_lead(broker, leads);
    const long before = voluntary_switches(own);
    std::this_thread::sleep_for(300ms);
    switches = voluntary_switches(own) - before;
  });
  EXPECT_EQ(lead_after_step_aside(broker, never, Clock::now() + 600ms), Broker::Lead::kTimedOut);
  watcher.join();
  // One look per linger would be about 3000 in 300 ms: the own thread looks
  // twice (the window may catch those), then sleeps until the caller leaves.
  EXPECT_GE(switches.load(), 0);
  EXPECT_LT(switches.load(), 10) << "the own thread polled through a long lead";
}

// Calls back to back, each longer than a linger (a call over ssh takes
// 100-200 us): every linger ends with a new lead begun, so the own thread
// lingers again, and each linger doubles, up to kMaxLinger. At one look
// per kLinger the own thread would wake up to 3000 times in 300 ms of
// such leads (measured: 1,700-1,800 wake-ups); doubling brings it near
// 300ms / kMaxLinger (measured: 94).
// Each lead here polls (wait_spin) until its 150 us are up, as a caller
// whose answer comes within its window does.
bool past(const void* t) { return Clock::now() >= *static_cast<const Clock::time_point*>(t); }

TEST(BrokerLead, BackToBackLeadsLengthenTheOwnThreadsLinger) {
  Broker::Options o;
  o.wait_spin = 1ms;
  Broker broker(o);
  std::atomic<bool> never{false};
  testutil::settle(broker);
  const pid_t own = broker.native_tid();
  constexpr auto kLead = 150us;
  ASSERT_EQ(lead_after_step_aside(broker, never, Clock::now() + kLead), Broker::Lead::kTimedOut);
  const long before = voluntary_switches(own);
  const auto end = Clock::now() + 300ms;
  int leads = 0, taken_back = 0;
  while (Clock::now() < end) {
    const Clock::time_point lead_end = Clock::now() + kLead;
    // Ends kDone when its polls see the time up, or kTimedOut when it slept
    // instead (this thread backing off from polling, or a window lost to
    // preemption: epoll_wait then ends at the deadline, to the millisecond).
    const Broker::Lead how = broker.lead_until(&past, &lead_end, lead_end);
    if (how == Broker::Lead::kBusy) {
      // The own thread took the loop back (a slow machine): make it step aside again.
      ++taken_back;
      ASSERT_EQ(lead_after_step_aside(broker, never, Clock::now() + kLead), Broker::Lead::kTimedOut);
    } else {
      ASSERT_TRUE(how == Broker::Lead::kDone || how == Broker::Lead::kTimedOut) << static_cast<int>(how);
    }
    ++leads;
  }
  const long switches = voluntary_switches(own) - before;
  constexpr long kPerLinger = 300ms / Broker::kLinger, kPerMaxLinger = 300ms / Broker::kMaxLinger;
  EXPECT_LT(switches, 2 * kPerMaxLinger + 4 * taken_back + 20)
      << leads << " leads, " << taken_back << " taken back; one look per kLinger would be about " << kPerLinger;
}

TEST(BrokerLead, TheWindowStretchesToAnswersALittleLaterThanIt) {
  using std::chrono::nanoseconds;
  const nanoseconds base = 50us;
  EXPECT_EQ(Broker::spin_window(base, 0ns), base) << "no history yet";
  EXPECT_EQ(Broker::spin_window(base, 20us), base) << "answers inside the window";
  EXPECT_EQ(Broker::spin_window(base, 100us), 125us) << "a quarter more than they take";
  EXPECT_EQ(Broker::spin_window(base, 190us), base * Broker::kSpinStretch) << "capped";
  EXPECT_EQ(Broker::spin_window(base, 201us), base * Broker::kSpinStretch)
      << "answers slower than the longest window: that window, then the back-off";
  EXPECT_EQ(Broker::spin_window(0us, 100us), 0ns) << "wait_spin 0 never polls";
}

// `waits` leading waits on a thread of its own (no history of other tests'
// waits) of a broker whose wait_spin is 10 ms, wait i answered
// answer_after(i) after it begins; returns how many a poll answered, in
// the first of up to `runs` runs in which any was. Milliseconds, not the
// microseconds of real calls, so that a loaded machine's preemptions (a
// few ms) rarely cost a window; and a machine whose other threads hold
// both CPUs for long stretches can starve a run (the own thread answers
// while the caller waits for a CPU), hence the runs.
std::uint64_t answered_while_polling(int waits, int runs, std::chrono::milliseconds (*answer_after)(int)) {
  Broker::Options o;
  o.wait_spin = 10ms;
  Broker broker(o);
  testutil::settle(broker);
  auto run = [&] {
    int done_waits = 0;
    std::uint64_t answered = 0;
    std::thread caller([&] {
      for (int i = 0; i < waits; ++i) {
        auto done = std::make_shared<std::atomic<bool>>(false);
        const std::uint64_t before = broker.stats().wait_polls_answered;
        bool asked = false;
        const Broker::Lead how = lead_after_step_aside(broker, *done, Clock::now() + kGuard, [&] {
          if (!std::exchange(asked, true)) broker.call_later(answer_after(i), [done] { *done = true; });
        });
        if (how != Broker::Lead::kDone) return;
        ++done_waits;
        answered += broker.stats().wait_polls_answered - before;
      }
    });
    caller.join();
    EXPECT_EQ(done_waits, waits);
    return answered;
  };
  std::uint64_t answered = 0;
  for (int r = 0; r < runs && answered == 0; ++r) answered = run();
  return answered;
}

// Leading waits answered 20 ms after they begin, with a 10 ms window:
// without the stretch every window missed (and the thread backed off after
// four): 0 in every run. With it, the thread's history says 20 ms, and the
// next windows (25 ms) catch them.
TEST(BrokerLead, AThreadWhoseAnswersComeJustAfterTheWindowReadsThemWhilePolling) {
  constexpr int kRuns = 6;
  EXPECT_GE(answered_while_polling(10, kRuns, [](int) { return 20ms; }), 1u)
      << "in " << kRuns << " runs, waits answered 2x the window after they began still slept";
}

// Answers that straddle the longest window (40 ms with a 10 ms wait_spin):
// 35 ms and 80 ms in turn, so the thread's typical wait stays above 40 ms.
// A window of wait_spin then could see none of them, and the thread backed
// off after four: so a caller whose answers over ssh drifted past the
// longest window (slept through, they came later still) never polled
// again. The longest window catches the 35 ms ones.
TEST(BrokerLead, AThreadWhoseAnswersStraddleTheLongestWindowStillCatchesTheEarlyOnes) {
  constexpr int kRuns = 6;
  EXPECT_GE(answered_while_polling(12, kRuns, [](int i) { return i % 2 == 0 ? 35ms : 80ms; }), 1u)
      << "in " << kRuns << " runs, no 35 ms answer was read while polling";
}

TEST(BrokerLead, ACallerLeadingWhenTheLoopStopsIsToldAndTheBrokerFinishes) {
  Broker broker;
  std::atomic<bool> never{false};
  const auto leads = broker.stats().caller_leads;
  std::thread stopper([&] {
    wait_for_a_lead(broker, leads);
    broker.shutdown(0ms);
  });
  EXPECT_EQ(lead_after_step_aside(broker, never, Clock::now() + kGuard), Broker::Lead::kStopped);
  stopper.join();
  join_bounded(broker);
  EXPECT_EQ(broker.state(), Broker::State::kStopped);
}

TEST(BrokerLead, ALeadingCallerBlocksSigpipeOnlyWhileItLeads) {
  Broker broker;
  int p[2];
  ASSERT_EQ(::pipe2(p, O_CLOEXEC), 0);
  ::close(p[0]);
  std::atomic<bool> done{false};
  std::atomic<int> write_errno{0};
  std::atomic<pid_t> wrote_on{0};
  const auto leads_before = broker.stats().caller_leads;
  std::thread other([&] {
    wait_for_a_lead(broker, leads_before);
    broker.defer([&] {
      broker.quiet_sigpipe();
      if (::write(p[1], "x", 1) < 0) write_errno = errno;
      wrote_on = gettid_now();
      done = true;
    });
  });
  EXPECT_EQ(lead_after_step_aside(broker, done, Clock::now() + kGuard), Broker::Lead::kDone);
  other.join();
  EXPECT_EQ(wrote_on.load(), gettid_now()) << "the write ran on the leading caller";
  EXPECT_EQ(write_errno.load(), EPIPE) << "a closed pipe gives EPIPE, and the process lives";
  sigset_t now;
  ASSERT_EQ(pthread_sigmask(SIG_BLOCK, nullptr, &now), 0);
  EXPECT_FALSE(sigismember(&now, SIGPIPE)) << "the caller's signal mask is restored";
  ::close(p[1]);
}

TEST(BrokerLead, AHostedBrokerIsNeverLedByACaller) {
  asio::io_context io;
  Broker broker(io, {});
  std::atomic<bool> done{false};
  std::thread t([&] { EXPECT_EQ(broker.lead_until(&flag_set, &done, Clock::now() + 1s), Broker::Lead::kBusy); });
  t.join();
  broker.stop_here();
}

// A hosted broker blocks SIGPIPE on the application's thread that runs it
// (a write to a closed pipe must come back as EPIPE), and unblocks it when
// it is destroyed there, consuming a SIGPIPE left pending (else unblocking
// would deliver it and kill the process). A thread that had SIGPIPE
// blocked before keeps it blocked.
bool sigpipe_blocked() {
  sigset_t now;
  if (pthread_sigmask(SIG_BLOCK, nullptr, &now) != 0) return false;
  return sigismember(&now, SIGPIPE) == 1;
}

TEST(BrokerLead, AHostedBrokerGivesItsThreadBackItsSignalMask) {
  std::thread([] {
    ASSERT_FALSE(sigpipe_blocked());
    {
      asio::io_context io;
      Broker broker(io, {});
      EXPECT_TRUE(sigpipe_blocked()) << "the hosted loop's thread blocks SIGPIPE while it runs the broker";
      int p[2];
      ASSERT_EQ(::pipe2(p, O_CLOEXEC), 0);
      ::close(p[0]);
      EXPECT_EQ(::write(p[1], "x", 1), -1);  // EPIPE, and a SIGPIPE left pending on this thread
      EXPECT_EQ(errno, EPIPE);
      ::close(p[1]);
      broker.stop_here();
    }
    EXPECT_FALSE(sigpipe_blocked()) << "the thread's mask was not restored";
  }).join();
  std::thread([] {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGPIPE);
    ASSERT_EQ(pthread_sigmask(SIG_BLOCK, &set, nullptr), 0);
    {
      asio::io_context io;
      Broker broker(io, {});
      broker.stop_here();
    }
    EXPECT_TRUE(sigpipe_blocked()) << "a thread that blocked SIGPIPE itself keeps it blocked";
  }).join();
}

// A pool worker waiting for work runs the loop too: once the own thread has
// handed it a message (and stepped aside), its next wait leads, so the loop
// work that brings the following message runs on the worker itself and the
// hand-off to it needs no wake-up.
TEST(BrokerLead, AnIdlePoolWorkerRunsTheLoopThatBringsItsNextMessage) {
  Broker broker;
  services::Pool pool({.threads = 1, .name = "lead-pool"});
  pool.attach(broker);
  std::mutex mu;
  std::condition_variable cv;
  std::vector<pid_t> ran_on;
  services::Lane& lane = pool.add_lane(
      {.name = "lead"},
      [&](Message&&) {
        std::lock_guard lk(mu);
        ran_on.push_back(gettid_now());
        cv.notify_all();
      },
      [](Message&&, std::string_view) {});
  auto wait_for_jobs = [&](std::size_t n) {
    std::unique_lock lk(mu);
    return cv.wait_for(lk, kGuard, [&] { return ran_on.size() >= n; });
  };
  const pid_t worker = pool.worker_tids().at(0);
  // The worker slept before the pool had a loop, so the first message only
  // teaches it that the loop was busy; the own thread steps aside after it
  // hands over the next, and the worker's next wait leads. On a busy
  // machine the own thread may take the loop back first (its linger ran out
  // before the worker got a CPU): each further message is another chance.
  const auto leads = broker.stats().caller_leads;
  std::size_t jobs = 0;
  for (int round = 0; round < 50 && broker.stats().caller_leads == leads; ++round) {
    broker.defer([&] { pool.submit(lane, Message::make(0, 1, Payload::copy_of("warm"))); });
    ASSERT_TRUE(wait_for_jobs(++jobs));
    if (round > 0) wait_for_a_lead(broker, leads, 100ms);
  }
  ASSERT_GT(broker.stats().caller_leads, leads) << "in 50 hand-overs the idle worker never ran the loop";
  std::atomic<pid_t> loop_ran_on{0};
  broker.defer([&] {
    loop_ran_on = gettid_now();
    pool.submit(lane, Message::make(0, 1, Payload::copy_of("led")));
  });
  ASSERT_TRUE(wait_for_jobs(jobs + 1));
  EXPECT_EQ(loop_ran_on.load(), worker) << "the deferred function ran on the leading worker";
  for (pid_t t : ran_on) EXPECT_EQ(t, worker);
  pool.stop();
}

// Sends queued and written on a thread free their blocks there. Only a
// broker's own thread keeps free blocks for reuse: an application thread
// that ran the loop for a while keeps none.
std::size_t queue_and_write_frames(TxQueue& q, std::size_t bytes) {
  std::vector<std::uint8_t> body(1000, 0x5a);
  Header h{};
  h.length = static_cast<std::uint32_t>(body.size());
  while (q.queued_bytes() < bytes) q.append_inline(encode_header(h), body.data(), body.size());
  const std::size_t used = q.blocks();
  q.advance(q.queued_bytes());
  return used;
}

std::size_t queue_and_write_200_frames() {
  TxQueue q;
  return queue_and_write_frames(q, 200 * (kHeaderSize + 1000));
}

TEST(BrokerLead, OnlyABrokersOwnThreadKeepsFreeSendBlocks) {
  std::size_t used = 0;
  std::thread caller([&] {
    used = queue_and_write_200_frames();
    EXPECT_EQ(TxQueue::cached_blocks(), 0u) << "an application thread kept free send blocks";
  });
  caller.join();
  EXPECT_GT(used, 4u) << "the frames did not fill several blocks";
  Broker broker;
  const std::size_t kept = run_on(broker, [] {
    queue_and_write_200_frames();
    return TxQueue::cached_blocks();
  });
  EXPECT_GT(kept, 0u) << "the broker's own thread reuses its free blocks";
}

// A queue that fills to the high-water mark and drains, again and again (a
// receiver that reads in bursts), allocates its blocks once: the broker's
// thread keeps every one of them for the next fill.
TEST(BrokerLead, ABrokersThreadKeepsTheBlocksOfAQueueFilledToItsHighWaterMark) {
  Broker broker;
  const auto [used, kept, left] = run_on(broker, [] {
    TxQueue q;
    const std::size_t used = queue_and_write_frames(q, kDefaultHighWaterMark);
    const std::size_t kept = TxQueue::cached_blocks();
    queue_and_write_frames(q, kDefaultHighWaterMark);
    return std::tuple{used, kept, TxQueue::cached_blocks()};
  });
  EXPECT_GE(used, kDefaultHighWaterMark / kTxBlockSize) << "the queue did not reach the mark";
  EXPECT_GE(kept, used) << "free blocks were given back to malloc, to be allocated again";
  EXPECT_EQ(left, kept) << "the second fill did not reuse the same blocks";
}

// Blocking calls from several threads at once: one leads, the others sleep
// and are served by it or by the own thread; every reply reaches its caller.
TEST(BrokerLead, ConcurrentBlockingCallsLeadOrSleepAndAllComplete) {
  Broker broker;
  Router router(broker, testutil::root_opts());
  constexpr std::uint32_t kEcho = 3000;
  Context child = fork_child(
      router,
      [](ChildEnv& env) {
        Router& r = env.router();
        r.add_handler([&r](Message&& m) { r.reply(m, m.data); }, {}, kEcho);
        env.serve();
        return 0;
      },
      testutil::named("lead-echo"));
  constexpr int kThreads = 3, kCalls = 500;
  std::atomic<int> wrong{0};
  std::vector<std::thread> callers;
  for (int t = 0; t < kThreads; ++t)
    callers.emplace_back([&, t] {
      for (int i = 0; i < kCalls; ++i) {
        std::string msg = std::to_string(t) + ":" + std::to_string(i);
        if (child.call(kEcho, std::string_view(msg), 20s) != msg) ++wrong;
      }
    });
  for (auto& c : callers) c.join();
  EXPECT_EQ(wrong.load(), 0);
  const auto leads_after_concurrent = broker.stats().caller_leads;
  // One caller alone: after its first call the own thread steps aside, and
  // the calls that follow run the loop themselves.
  for (int i = 0; i < 200; ++i) ASSERT_EQ(child.call(kEcho, std::string_view("solo"), 20s), "solo");
  EXPECT_GT(broker.stats().caller_leads, leads_after_concurrent) << "no call ever led the loop";
  child.shutdown();
  testutil::expect_exit_code(child, 0);
}

}  // namespace test_broker_lead
}  // namespace spindle
