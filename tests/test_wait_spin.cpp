// A leader polls before it sleeps (Broker::Options::wait_spin,
// RouterOptions::wait_spin; loop_lead.cpp): an answer that comes within the
// window is taken without sleeping, a thread whose windows keep finding
// nothing stops polling for a while and then looks again, and 0 never polls.
// Each test counts what the broker did (Stats) and, where it matters,
// whether the waiting kernel thread slept at all.
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include <spindle/spindle.h>

#include "broker/broker.h"
#include "stream_test_util.h"
#include "tests/router_test_util.h"

namespace spindle {
namespace test_wait_spin {

using namespace std::chrono_literals;
using testutil::gettid_now;
using testutil::kGuard;
using testutil::lead_after_step_aside;
using testutil::run_on;
using testutil::voluntary_switches;
using Clock = std::chrono::steady_clock;

// Sets `done` through the loop (defer) once the broker has begun one more
// polling window than `polls_before`: an answer that surely comes while the
// leader polls, when the window is long. Notes then how often `leader` had
// slept so far (voluntary context switches), when asked to.
std::thread answer_while_polling(Broker& b, std::uint64_t polls_before, std::atomic<bool>& done,
                                 pid_t leader = 0, std::atomic<long>* slept_before = nullptr) {
  return std::thread([&b, polls_before, &done, leader, slept_before] {
    const auto give_up = Clock::now() + kGuard;
    while (b.stats().wait_polls == polls_before && Clock::now() < give_up) std::this_thread::yield();
    if (slept_before) *slept_before = voluntary_switches(leader);
    b.defer([&done] { done = true; });
  });
}

// Whether the leader slept is read from its voluntary context switches. A
// leader that polls can still block for a few microseconds on a lock it
// shares with the answering thread (Asio's scheduler mutex, which the
// answer's post takes; a sanitizer's allocator lock): one switch in a few
// hundred ASan runs. A leader that sleeps for its answer instead switches
// every time. So the test takes up to three answers and needs one that
// came without a switch; every one of them must have been polled for.
TEST(WaitSpin, AnAnswerWithinTheWindowIsTakenWithoutSleeping) {
  Broker broker(Broker::Options{.wait_spin = 10s});
  std::string switches_seen;
  bool slept_every_time = true;
  for (int attempt = 0; attempt < 3 && slept_every_time; ++attempt) {
    std::atomic<bool> done{false};
    std::atomic<long> slept_before{-1};
    const auto before = broker.stats();
    std::thread answerer;
    ASSERT_EQ(lead_after_step_aside(broker, done, Clock::now() + kGuard,
                   [&] {
                     if (!answerer.joinable())
                       answerer = answer_while_polling(broker, before.wait_polls, done, gettid_now(), &slept_before);
                   }),
              Broker::Lead::kDone);
    const long slept_after = voluntary_switches(gettid_now());
    answerer.join();
    const auto after = broker.stats();
    ASSERT_EQ(after.wait_polls, before.wait_polls + 1);
    ASSERT_EQ(after.wait_polls_answered, before.wait_polls_answered + 1);
    ASSERT_GE(slept_before.load(), 0);
    switches_seen += std::to_string(slept_after - slept_before.load()) + " ";
    slept_every_time = slept_after != slept_before.load();
  }
  EXPECT_FALSE(slept_every_time) << "the leader slept although the answer came while it polled; "
                                 << "voluntary switches per attempt: " << switches_seen;
}

TEST(WaitSpin, ZeroNeverPolls) {
  Broker broker(Broker::Options{.wait_spin = 0us});
  std::atomic<bool> done{false};
  std::thread setter;
  ASSERT_EQ(lead_after_step_aside(broker, done, Clock::now() + kGuard,
                 [&] {
                   if (!setter.joinable())
                     setter = std::thread([&] { broker.call_later(2ms, [&done] { done = true; }); });
                 }),
            Broker::Lead::kDone);
  setter.join();
  EXPECT_EQ(broker.stats().wait_polls, 0u);
}

// Windows that end unanswered (here: the lead's deadline comes first) four
// times in a row make the thread sleep at once for its next 15 waits; the
// 16th polls again, and an answer then restores polling on every wait.
TEST(WaitSpin, AThreadWhosePollsFindNothingBacksOffAndLooksAgain) {
  Broker broker(Broker::Options{.wait_spin = 10s});
  std::thread([&] {  // a fresh thread: the history is per thread
    std::atomic<bool> never{false};
    auto polls = [&] { return broker.stats().wait_polls; };
    for (int i = 0; i < 4; ++i) {
      const auto p = polls();
      EXPECT_EQ(lead_after_step_aside(broker, never, Clock::now() + 2ms), Broker::Lead::kTimedOut);
      EXPECT_EQ(polls(), p + 1) << "miss " << i << " did not poll";
    }
    const auto p = polls();
    for (int i = 0; i < 15; ++i)
      EXPECT_EQ(lead_after_step_aside(broker, never, Clock::now() + 1ms), Broker::Lead::kTimedOut);
    EXPECT_EQ(polls(), p) << "a thread whose last four windows missed still polled";
    for (int round = 0; round < 2; ++round) {  // the probe, then polling as before
      std::atomic<bool> done{false};
      const auto st = broker.stats();
      std::thread answerer;
      EXPECT_EQ(lead_after_step_aside(broker, done, Clock::now() + kGuard,
                     [&] {
                       if (!answerer.joinable()) answerer = answer_while_polling(broker, st.wait_polls, done);
                     }),
                Broker::Lead::kDone);
      answerer.join();
      EXPECT_EQ(broker.stats().wait_polls, st.wait_polls + 1) << "round " << round;
      EXPECT_EQ(broker.stats().wait_polls_answered, st.wait_polls_answered + 1) << "round " << round;
    }
  }).join();
}

// Options::own_thread_polls: after a turn the broker's own thread polls for
// the next one, and takes work that arrives within the window without
// sleeping; without it (the default) the own thread never polls.
TEST(WaitSpin, AnOwnThreadThatPollsTakesItsNextTurnWithoutSleeping) {
  Broker broker(Broker::Options{.wait_spin = 10s, .own_thread_polls = true});
  // As above, one of up to three turns must come without a switch.
  const auto give_up = Clock::now() + kGuard;
  std::string switches_seen;
  bool slept_every_time = true;
  for (int attempt = 0; attempt < 3 && slept_every_time; ++attempt) {
    const auto turn = broker.stats();
    run_on(broker, [] {});  // a turn: the own thread now polls for the next
    while (broker.stats().wait_polls == turn.wait_polls && Clock::now() < give_up) std::this_thread::yield();
    ASSERT_GT(broker.stats().wait_polls, turn.wait_polls) << "the own thread did not poll after its turn";
    const auto polling = broker.stats();
    const long slept_before = voluntary_switches(broker.native_tid());
    std::atomic<bool> ran{false};
    broker.defer([&ran] { ran = true; });
    while (!ran && Clock::now() < give_up) std::this_thread::yield();
    ASSERT_TRUE(ran.load());
    const long slept = voluntary_switches(broker.native_tid()) - slept_before;
    switches_seen += std::to_string(slept) + " ";
    slept_every_time = slept != 0;
    EXPECT_GT(broker.stats().wait_polls_answered, polling.wait_polls_answered);
  }
  EXPECT_FALSE(slept_every_time) << "the own thread slept although the work came while it polled; "
                                 << "voluntary switches per attempt: " << switches_seen;

  Broker plain;
  run_on(plain, [] {});
  run_on(plain, [] {});
  EXPECT_EQ(plain.stats().wait_polls, 0u) << "an own thread polled without own_thread_polls";
}

int echo_child(ChildEnv& env) {
  env.expose(method<long(long)>{"echo"}, [](long n) { return n; });
  return env.serve();
}

// RouterOptions::wait_spin reaches the broker of the runtime that is given
// it: blocking calls to a real forked child poll (and, with a long window,
// are answered while polling), and with 0 they never poll.
TEST(WaitSpin, RouterOptionsSetTheRuntimesWindow) {
  for (auto spin : {std::chrono::microseconds(10s), std::chrono::microseconds(0)}) {
    Runtime rt(RouterOptions{.name = "spin-parent", .wait_spin = spin});
    Child child = rt.fork_child(echo_child, {.name = "spin-echo"});
    for (long i = 0; i < 50; ++i) ASSERT_EQ(child.call(method<long(long)>{"echo"}, i), i);
    const auto st = rt.broker().stats();
    if (spin.count() > 0) {
      EXPECT_GT(st.caller_leads, 0u);
      EXPECT_EQ(st.wait_polls_answered, st.wait_polls) << "a 10 s window missed an echo";
      EXPECT_GT(st.wait_polls, 0u);
    } else {
      EXPECT_EQ(st.wait_polls, 0u);
    }
    EXPECT_EQ(child.stop(), 0);
  }
}

}  // namespace test_wait_spin
}  // namespace spindle
