// A thread waiting in Select::get() runs its receivers' broker loop while no
// one else does (services/lanes.h: join_loop), as a blocking call and an idle
// pool worker do (test_broker_lead.cpp). Each test checks on which kernel
// thread the loop's work ran, and that a receiver leaving lets go of the
// loop before its broker may be destroyed.
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <future>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include "broker/broker.h"
#include "router/router.h"
#include "services/select.h"
#include "tests/raw_peer.h"
#include "tests/router_test_util.h"
#include "tests/stream_test_util.h"

namespace spindle {
namespace test_select_lead {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using namespace testutil;

// A thread taking messages from `sel` one at a time; it remembers its tid
// and what it got.
class Taker {
 public:
  explicit Taker(services::Select& sel) : sel_(sel), thread_([this] { run(); }) {
    while (tid_.load() == 0) std::this_thread::yield();
  }
  ~Taker() { thread_.join(); }
  pid_t tid() const { return tid_.load(); }
  int got() const { return got_.load(); }
  bool wait_for(int n) const {
    const auto give_up = Clock::now() + 30s;
    while (got_.load() < n && Clock::now() < give_up) std::this_thread::sleep_for(1ms);
    return got_.load() >= n;
  }
  bool finished() const { return finished_.load(); }

 private:
  void run() {
    tid_ = gettid_now();
    while (auto ev = sel_.get(60s)) {
      EXPECT_EQ(ev->msg.text(), "ping");
      ++got_;
    }
    finished_ = true;
  }
  services::Select& sel_;
  std::atomic<pid_t> tid_{0};
  std::atomic<int> got_{0};
  std::atomic<bool> finished_{false};
  std::thread thread_;
};

constexpr std::uint32_t kProbe = 2300;

// A peer process's socket, as a raw client attached to `router`: its frames
// are read by whichever thread runs the loop.
class Peer {
 public:
  explicit Peer(Router& router) : router_(router) {
    id_ = router.allocate_id();
    if (!attach_raw(router, raw_, id_)) throw std::runtime_error("cannot attach the raw peer");
    if (raw_.handshake() != id_) throw std::runtime_error("the raw peer's handshake failed");
  }
  // "ping" to `rx`; first, when asked, a probe frame whose handler (kProbe,
  // added by the test) notes the thread that ran the loop.
  void ping(const services::Receiver& rx, bool probe = false) {
    std::string bytes;
    if (probe) bytes += frame_bytes(frame(0, id_, id_, kProbe, 0), "probe");
    bytes += frame_bytes(frame(0, id_, id_, rx.handle(), 0), "ping");
    raw_.write_all(bytes);
  }

 private:
  Router& router_;
  RawPeer raw_;
  std::uint32_t id_ = 0;
};

// Two messages to `rx`, then until the taker leads `b`'s loop: the first
// finds the taker asleep (the own thread held the loop); handing it over,
// the own thread steps aside, and the taker's next wait leads. False if a
// message did not arrive or no lead began; `got` counts what arrived.
bool warm_until_a_lead(Broker& b, Peer& peer, const services::Receiver& rx, Taker& taker, int& got) {
  const auto leads = b.stats().caller_leads;
  // On a busy machine the own thread may take the loop back before the
  // taker gets a CPU (its linger ran out): each message is another chance.
  for (int round = 0; round < 50 && b.stats().caller_leads == leads; ++round) {
    peer.ping(rx);
    if (!taker.wait_for(++got)) return false;
    if (round > 0) wait_for_a_lead(b, leads, 100ms);
  }
  return b.stats().caller_leads > leads;
}

TEST(SelectLead, AThreadWaitingInASelectRunsTheLoopThatBringsItsMessage) {
  Broker broker;
  Router router(broker, root_opts());
  std::atomic<pid_t> ran_on{0};
  router.add_handler([&](Message&&) { ran_on = gettid_now(); }, {}, kProbe);
  services::Select sel;
  services::Receiver rx(router, sel);
  Peer peer(router);
  Taker taker(sel);
  int sent = 0;
  ASSERT_TRUE(warm_until_a_lead(broker, peer, rx, taker, sent)) << "the waiting thread never ran the loop";
  // On a busy machine the own thread may win the loop back between two
  // waits (a linger passed unused); each message gives the taker another
  // chance, and it must take it.
  bool on_taker = false;
  for (int round = 0; round < 20 && !on_taker; ++round) {
    peer.ping(rx, /*probe=*/true);
    ASSERT_TRUE(taker.wait_for(++sent));
    on_taker = ran_on.load() == taker.tid();
  }
  EXPECT_TRUE(on_taker) << "in 20 rounds the loop never read the peer on the waiting thread";
  sel.close();
}

// The last receiver leaving takes the loop from a taker that runs it, and
// returns only once the taker has let go: the broker may then be destroyed
// while the taker still waits (ASan sees any touch of it).
TEST(SelectLead, TheLastReceiverLeavingTakesTheLoopFromAWaitingThread) {
  services::Select sel;
  std::optional<Taker> taker;
  int got = 0;
  {
    auto broker = std::make_unique<Broker>();
    auto router = std::make_unique<Router>(*broker, root_opts());
    auto rx = std::make_unique<services::Receiver>(*router, sel);
    auto peer = std::make_unique<Peer>(*router);
    taker.emplace(sel);
    ASSERT_TRUE(warm_until_a_lead(*broker, *peer, *rx, *taker, got));
    const auto t0 = Clock::now();
    rx.reset();
    EXPECT_LT(Clock::now() - t0, 5s) << "leaving waited for the taker's 60 s wait";
    // The taker runs this loop no more: the broker's work runs elsewhere.
    std::promise<pid_t> ran_on;
    broker->defer([&] { ran_on.set_value(gettid_now()); });
    EXPECT_NE(ran_on.get_future().get(), taker->tid()) << "the taker still ran the loop";
    peer.reset();
    router.reset();
    broker.reset();
  }
  EXPECT_FALSE(taker->finished()) << "the taker stopped waiting when the receiver left";
  // A receiver on a new broker serves the same waiting thread.
  Broker broker2;
  Router router2(broker2, root_opts());
  services::Receiver rx2(router2, sel);
  Peer peer2(router2);
  peer2.ping(rx2);
  EXPECT_TRUE(taker->wait_for(++got));
  sel.close();
  taker.reset();
}

// The receiver destroyed by a deferred function, which runs on the taker
// that leads (the Python binding moves receivers between Selects that way):
// leaving must not wait for the very thread it runs on.
TEST(SelectLead, AReceiverDestroyedOnTheLeadingTakerDoesNotWaitForItself) {
  Broker broker;
  Router router(broker, root_opts());
  services::Select sel;
  Peer peer(router);
  Taker taker(sel);
  // Each round: a fresh receiver, warmed until the taker leads, destroyed
  // by a deferred function. It counts when that function ran on the taker
  // (on a busy machine the own thread may hold the loop instead).
  int got = 0;
  bool on_taker = false;
  for (int round = 0; round < 20 && !on_taker; ++round) {
    auto rx = std::make_unique<services::Receiver>(router, sel);
    for (int i = 0; i < 3; ++i) {
      peer.ping(*rx);
      ASSERT_TRUE(taker.wait_for(++got));
    }
    std::promise<pid_t> ran_on;
    broker.defer([&] {
      ran_on.set_value(gettid_now());
      rx.reset();
    });
    auto f = ran_on.get_future();
    ASSERT_EQ(f.wait_for(10s), std::future_status::ready) << "the deferred function never ran";
    on_taker = f.get() == taker.tid();
    // It returned: the loop goes on.
    std::promise<void> later;
    broker.defer([&] { later.set_value(); });
    ASSERT_EQ(later.get_future().wait_for(10s), std::future_status::ready) << "the loop is stuck";
  }
  EXPECT_TRUE(on_taker) << "in 20 rounds the deferred function never ran on the leading taker";
  sel.close();
}

// A receiver on a second broker: a thread running the first loop would not
// see the second's messages, so the lead ends, nobody leads any more, and
// the messages of both arrive.
TEST(SelectLead, AReceiverOnASecondBrokerEndsTheLeadAndBothAreServed) {
  Broker b1, b2;
  Router r1(b1, root_opts("one")), r2(b2, root_opts("two"));
  services::Select sel;
  services::Receiver rx1(r1, sel);
  Peer p1(r1);
  Taker taker(sel);
  int got = 0;
  ASSERT_TRUE(warm_until_a_lead(b1, p1, rx1, taker, got)) << "the waiting thread never ran the first loop";
  services::Receiver rx2(r2, sel);
  Peer p2(r2);
  p2.ping(rx2);
  ASSERT_TRUE(taker.wait_for(++got)) << "the second broker's message waited behind the first loop";
  const auto leads1 = b1.stats().caller_leads, leads2 = b2.stats().caller_leads;
  for (int i = 0; i < 20; ++i) {
    if (i % 2) p2.ping(rx2);
    else p1.ping(rx1);
    ASSERT_TRUE(taker.wait_for(++got)) << "message " << i << " did not arrive";
  }
  EXPECT_EQ(b1.stats().caller_leads, leads1);
  EXPECT_EQ(b2.stats().caller_leads, leads2);
  sel.close();
}

}  // namespace test_select_lead
}  // namespace spindle
