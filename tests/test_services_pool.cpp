// The worker pool: the wake rule (one idle worker woken per message, none
// when all are busy), no fd per worker, the fairness rule between services,
// and the three run modes. Calls go to the root's own services through its
// router ("self"), so every message takes the real path: broker thread,
// CALL_SERVICE handler, lane, worker, reply.

#include <atomic>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "broker/errors.h"
#include "services/lanes.h"
#include "tests/process_util.h"
#include "tests/services_test_util.h"
#include "tests/stream_test_util.h"

namespace spindle {
namespace test_services_pool {

using namespace testutil;
using namespace std::chrono_literals;
using services::Access;
using services::Request;
using services::RunMode;
using services::Service;

long total_switches(const std::vector<pid_t>& tids) {
  long sum = 0;
  for (pid_t t : tids) sum += voluntary_switches(t);
  return sum;
}

std::unique_ptr<Service> echo_service(std::string name = "echo", RunMode mode = RunMode::kConcurrent) {
  auto s = std::make_unique<Service>(std::move(name), mode);
  s->expose("say", Access::any(), [](Request& r) { return r.args(); });
  return s;
}

TEST(ServicesPool, OneWakeUpPerMessage) {
  ServiceRig rig(8);
  rig.add(echo_service());
  ASSERT_TRUE(eventually([&] { return rig.pool.stats().idle == 8; }));
  ASSERT_EQ(services::call_text(rig.self, "echo", "say", "warm"), "warm");
  constexpr int kCalls = 300;
  auto before = rig.pool.stats();
  long switches_before = total_switches(rig.pool.worker_tids());
  for (int i = 0; i < kCalls; ++i)
    ASSERT_EQ(services::call_text(rig.self, "echo", "say", std::to_string(i)), std::to_string(i));
  long switches = total_switches(rig.pool.worker_tids()) - switches_before;
  auto after = rig.pool.stats();
  // Each call found idle workers: exactly one was handed the message and woken.
  EXPECT_EQ(after.wakeups - before.wakeups, std::uint64_t{kCalls});
  EXPECT_EQ(after.handed - before.handed, std::uint64_t{kCalls});
  // The kernel agrees: the 8 workers slept about once per message in all (a
  // herd would cost about 8). Slack for a rare contended lock.
  EXPECT_LT(switches, 2 * kCalls) << switches << " voluntary switches for " << kCalls << " messages";
}

// A worker that has run a message polls for the next one for its broker's
// wait_spin before it sleeps (services/futex.h): the next call within that
// window wakes nobody. One caller calling back to back is the case: before,
// its worker slept after every message and each call paid a wake-up. As in
// WaitSpin's tests, one of up to three calls must find the worker awake (a
// contended lock can cost it a switch now and then).
TEST(ServicesPool, AWorkerWhoseNextMessageComesWithinThePollWindowDoesNotSleep) {
  Broker broker(Broker::Options{.wait_spin = 10s});
  Router router(broker, RouterOptions{.name = "root"});
  services::Pool pool(pool_of(1));
  services::ServiceHost host(router, pool);
  host.add(echo_service());
  Context self(router, router.id(), "self");
  ASSERT_EQ(services::call_text(self, "echo", "say", "warm"), "warm");
  const pid_t worker = pool.worker_tids().at(0);
  std::string seen;
  bool slept = true;
  for (int attempt = 0; attempt < 3 && slept; ++attempt) {
    std::this_thread::sleep_for(20ms);  // the worker polls meanwhile
    const long before = voluntary_switches(worker);
    ASSERT_EQ(services::call_text(self, "echo", "say", "again"), "again");
    const long switched = voluntary_switches(worker) - before;
    seen += std::to_string(switched) + " ";
    slept = switched != 0;
  }
  EXPECT_FALSE(slept) << "the worker slept between messages 20 ms apart, inside a 10 s window; "
                      << "its voluntary switches per call: " << seen;
}

TEST(ServicesPool, BusyWorkerTakesQueuedWorkWithoutWakeUps) {
  ServiceRig rig(1);
  Gate gate;
  auto s = echo_service();
  s->expose("block", Access::any(), [&](Request&) {
    gate.wait();
    return Payload::copy_of("unblocked");
  });
  rig.add(std::move(s));
  ASSERT_TRUE(eventually([&] { return rig.pool.stats().idle == 1; }));
  auto before = rig.pool.stats();
  auto blocked = services::call_async(rig.self, "echo", "block");
  ASSERT_TRUE(eventually([&] { return gate.waiting() == 1; }));
  std::vector<std::future<Message>> queued;
  for (int i = 0; i < 50; ++i)
    queued.push_back(services::call_async(rig.self, "echo", "say", Payload::copy_of(std::to_string(i))));
  ASSERT_TRUE(eventually([&] { return rig.pool.stats().queued == 50; }));
  gate.open();
  EXPECT_EQ(blocked.get().text(), "unblocked");
  for (int i = 0; i < 50; ++i) EXPECT_EQ(queued[i].get().text(), std::to_string(i));
  // One wake for the first message; the 50 that queued behind it were taken
  // by the busy worker on its way back, with no wake at all.
  EXPECT_EQ(rig.pool.stats().wakeups - before.wakeups, 1u);
}

TEST(ServicesPool, SixtyFourWorkersOpenNoFds) {
  std::size_t before = count_open_fds();
  services::Pool pool(pool_of(64));
  ASSERT_TRUE(eventually([&] { return pool.stats().idle == 64; }));
  EXPECT_EQ(count_open_fds(), before);
  pool.stop();
  EXPECT_EQ(count_open_fds(), before);
}

TEST(ServicesPool, BadThreadCountIsRefused) {
  EXPECT_THROW(services::Pool(pool_of(0)), Error);
  EXPECT_THROW(services::Pool(pool_of(services::Pool::kMaxThreads + 1)), Error);
}

// Fairness rule: lanes (services) with queued calls take turns, one call
// each. A flooded service delays another's call by at most one of its own.
TEST(ServicesPool, BusyServiceDoesNotStarveAnother) {
  ServiceRig rig(1);
  Gate gate;
  std::mutex mu;
  std::vector<std::string> ran;
  auto record = [&](std::string what) {
    std::lock_guard lk(mu);
    ran.push_back(std::move(what));
  };
  auto flood = std::make_unique<Service>("flood");
  flood->expose("block", Access::any(), [&](Request&) {
    gate.wait();
    return Payload();
  });
  flood->expose("work", Access::any(), [&](Request& r) {
    record("flood " + r.args_text());
    return Payload();
  });
  auto quiet = std::make_unique<Service>("quiet");
  quiet->expose("work", Access::any(), [&](Request&) {
    record("quiet");
    return Payload();
  });
  rig.add(std::move(flood));
  rig.add(std::move(quiet));
  std::vector<std::future<Message>> calls;
  calls.push_back(services::call_async(rig.self, "flood", "block"));
  ASSERT_TRUE(eventually([&] { return gate.waiting() == 1; }));
  for (int i = 0; i < 20; ++i)
    calls.push_back(services::call_async(rig.self, "flood", "work", Payload::copy_of(std::to_string(i))));
  calls.push_back(services::call_async(rig.self, "quiet", "work"));
  ASSERT_TRUE(eventually([&] { return rig.pool.stats().queued == 21; }));
  gate.open();
  for (auto& f : calls) ASSERT_EQ(f.wait_for(20s), std::future_status::ready);
  std::lock_guard lk(mu);
  ASSERT_EQ(ran.size(), 21u);
  EXPECT_EQ(ran[0], "flood 0");
  EXPECT_EQ(ran[1], "quiet") << "the quiet service waited behind more than one flood call";
  for (int i = 1; i < 20; ++i) EXPECT_EQ(ran[i + 1], fmt::format("flood {}", i));
}

TEST(ServicesPool, SerializedServiceRunsOneAtATimeInArrivalOrder) {
  ServiceRig rig(4);
  std::atomic<int> inside{0}, most{0};
  std::mutex mu;
  std::vector<int> order;
  auto s = std::make_unique<Service>("serial", RunMode::kSerialized);
  s->expose("step", Access::any(), [&](Request& r) {
    int now = ++inside;
    int seen = most.load();
    while (now > seen && !most.compare_exchange_weak(seen, now)) {}
    for (int i = 0; i < 200; ++i) std::this_thread::yield();  // room for an overlap, were there one
    {
      std::lock_guard lk(mu);
      order.push_back(std::stoi(r.args_text()));
    }
    --inside;
    return Payload();
  });
  rig.add(std::move(s));
  std::vector<std::future<Message>> calls;
  for (int i = 0; i < 16; ++i)
    calls.push_back(services::call_async(rig.self, "serial", "step", Payload::copy_of(std::to_string(i))));
  for (auto& f : calls) f.get();
  EXPECT_EQ(most.load(), 1);
  std::vector<int> expect(16);
  for (int i = 0; i < 16; ++i) expect[i] = i;
  EXPECT_EQ(order, expect);
}

TEST(ServicesPool, ConcurrentServiceRunsCallsInParallel) {
  ServiceRig rig(2);
  std::mutex mu;
  std::condition_variable cv;
  int arrived = 0;
  auto s = std::make_unique<Service>("meet");
  // Each call waits for the other to arrive: both must run at once.
  s->expose("meet", Access::any(), [&](Request&) {
    std::unique_lock lk(mu);
    ++arrived;
    cv.notify_all();
    bool met = cv.wait_for(lk, 20s, [&] { return arrived == 2; });
    return Payload::copy_of(met ? "met" : "alone");
  });
  rig.add(std::move(s));
  auto a = services::call_async(rig.self, "meet", "meet");
  auto b = services::call_async(rig.self, "meet", "meet");
  EXPECT_EQ(a.get().text(), "met");
  EXPECT_EQ(b.get().text(), "met");
}

// A deduplicated service "dedup" whose method "slow" counts each
// computation and waits for the gate; it answers with describe(args, n).
struct GatedDedup {
  explicit GatedDedup(std::function<std::string(const Request&, int)> describe) {
    auto s = std::make_unique<Service>("dedup", RunMode::kDeduplicated);
    s->expose("slow", Access::any(), [this, describe = std::move(describe)](Request& r) {
      int n = ++computed;
      gate.wait();
      return Payload::copy_of(describe(r, n));
    });
    svc = &rig.add(std::move(s));
  }
  ServiceRig rig{4};
  Gate gate;
  std::atomic<int> computed{0};
  Service* svc = nullptr;
};

TEST(ServicesPool, DeduplicatedCallsShareOneComputation) {
  GatedDedup d([](const Request& r, int n) { return fmt::format("{} computed as #{}", r.args_text(), n); });
  ServiceRig& rig = d.rig;
  std::atomic<int>& computed = d.computed;
  Service& svc = *d.svc;
  std::vector<std::future<Message>> same;
  for (int i = 0; i < 5; ++i) same.push_back(services::call_async(rig.self, "dedup", "slow", Payload::copy_of("x")));
  auto other = services::call_async(rig.self, "dedup", "slow", Payload::copy_of("y"));
  // Two computations run (x and y); the four other x calls joined x's.
  // `answered` counts a call before Service::run registers it, so the
  // condition also waits for both handlers to have begun (computed == 2),
  // which is after their dedup entries exist.
  ASSERT_TRUE(eventually([&] {
    auto st = rig.pool.stats();
    return rig.host.stats().answered == 6 && computed.load() == 2 && st.running == 2 && st.queued == 0;
  }));
  EXPECT_EQ(svc.dedup_pending(), 2u);
  d.gate.open();
  std::string first = same[0].get().text();
  for (int i = 1; i < 5; ++i) EXPECT_EQ(same[i].get().text(), first);
  EXPECT_NE(other.get().text(), first);
  EXPECT_EQ(computed.load(), 2);
  EXPECT_EQ(svc.dedup_pending(), 0u);
  // Results are shared, not cached: a later identical call computes again.
  services::call_text(rig.self, "dedup", "slow", "x");
  EXPECT_EQ(computed.load(), 3);
}

// Large arguments: identical bytes join however they are sliced; bytes that
// differ only in the middle (the same size, head and tail: the same hash)
// compute apart. The table compares the arguments it shares with the
// request instead of copying them into its key.
TEST(ServicesPool, DeduplicationComparesLargeArgumentsWithoutCopyingThem) {
  GatedDedup d([](const Request& r, int n) { return fmt::format("#{} of {} bytes", n, r.args().size()); });
  ServiceRig& rig = d.rig;
  std::atomic<int>& computed = d.computed;
  Service& svc = *d.svc;
  const std::string bytes(1 << 20, 'a');
  std::string middle = bytes;
  middle[bytes.size() / 2] = 'b';
  Payload split;  // the same bytes as `bytes`, in three slices
  split.append(Payload::copy_of(std::string_view(bytes).substr(0, 1000)).slices()[0]);
  split.append(Payload::copy_of(std::string_view(bytes).substr(1000, 500000)).slices()[0]);
  split.append(Payload::copy_of(std::string_view(bytes).substr(501000)).slices()[0]);
  ASSERT_EQ(split.size(), bytes.size());
  auto a = services::call_async(rig.self, "dedup", "slow", Payload::copy_of(bytes));
  auto b = services::call_async(rig.self, "dedup", "slow", split);
  auto c = services::call_async(rig.self, "dedup", "slow", Payload::copy_of(middle));
  ASSERT_TRUE(eventually([&] { return rig.host.stats().answered == 3 && computed.load() == 2; }));
  EXPECT_EQ(svc.dedup_pending(), 2u);
  d.gate.open();
  const std::string first = a.get().text();
  EXPECT_EQ(b.get().text(), first);
  EXPECT_NE(c.get().text(), first);
  EXPECT_EQ(computed.load(), 2);
  EXPECT_EQ(svc.dedup_pending(), 0u);
}

// A message of `n` bytes for a lane.
Message lane_msg(std::size_t n) { return Message::make(1, 2, Payload::copy_of(std::string(n, 'x'))); }

// What a peer queues for a service or a receiver is bounded: past a lane's
// maximum (messages or bytes) a push is refused, and the pool answers the
// sender with "service queue full" (issue #11 §1).
TEST(ServicesLanes, ALaneRefusesPastItsMaximum) {
  services::LaneSet set;
  services::LaneOptions o;
  o.name = "small";
  o.max_messages = 3;
  o.max_bytes = 1000;
  services::Lane& lane = set.add_lane(o);
  for (int i = 0; i < 3; ++i) {
    Message m = lane_msg(10);
    EXPECT_EQ(set.push(lane, m), services::LaneSet::Push::kQueued);
  }
  Message over = lane_msg(10);
  EXPECT_EQ(set.push(lane, over), services::LaneSet::Push::kFull);
  EXPECT_EQ(over.data.size(), 10u) << "a refused message is left to the caller";
  auto t = set.take(std::chrono::steady_clock::now() + 1s);
  ASSERT_TRUE(t);
  set.done(*t->lane);
  Message again = lane_msg(10);
  EXPECT_EQ(set.push(lane, again), services::LaneSet::Push::kQueued);
  // The byte bound: 3 messages queued of 10 bytes; 990 more do not fit.
  while (auto u = set.take(std::chrono::steady_clock::now())) set.done(*u->lane);
  Message big = lane_msg(990);
  EXPECT_EQ(set.push(lane, big), services::LaneSet::Push::kQueued);
  Message more = lane_msg(11);
  EXPECT_EQ(set.push(lane, more), services::LaneSet::Push::kFull);
  EXPECT_EQ(set.stats().refused_full, 2u);
  set.close();
}

// A message larger than the byte bound is admitted into an empty lane, once:
// before, a call with a 65 MiB argument was refused ("service queue full")
// by a service that had nothing queued at all.
TEST(ServicesLanes, AnEmptyLaneTakesOneMessageLargerThanItsByteBound) {
  services::LaneSet set;
  services::LaneOptions o;
  o.name = "small";
  o.max_bytes = 1000;
  services::Lane& lane = set.add_lane(o);
  Message huge = lane_msg(5000);
  EXPECT_EQ(set.push(lane, huge), services::LaneSet::Push::kQueued);
  Message tiny = lane_msg(1);
  EXPECT_EQ(set.push(lane, tiny), services::LaneSet::Push::kFull)
      << "past its bound the lane takes nothing more until it drains";
  auto t = set.take(std::chrono::steady_clock::now() + 1s);
  ASSERT_TRUE(t);
  EXPECT_EQ(t->msg.data.size(), 5000u);
  set.done(*t->lane);
  Message next = lane_msg(5000);
  EXPECT_EQ(set.push(lane, next), services::LaneSet::Push::kQueued) << "empty again";
  set.close();
}

// Past twice its bounds a lane takes nobody's message, not even from a
// sender that holds nothing there (which passes its share): a peer that
// reconnects is a new sender each time. And a small message queued behind
// others keeps its own bytes, not the receive chunk it arrived in.
TEST(ServicesLanes, ALaneHoldsAtMostTwiceItsBoundsAndCopiesWhatWaits) {
  services::LaneSet set;
  services::LaneOptions o;
  o.name = "small";
  o.max_messages = 4;
  services::Lane& lane = set.add_lane(o);
  auto chunk = std::make_shared<std::vector<std::uint8_t>>(128 * 1024, 'c');
  for (std::uint64_t sender = 1; sender <= 8; ++sender) {
    Message m = Message::make(1, 2, {});
    m.data.append(Slice{chunk, chunk->data(), 64});  // as a receive chunk's slice
    EXPECT_EQ(set.push(lane, m, sender, process_uid()), services::LaneSet::Push::kQueued)
        << "sender " << sender;
  }
  EXPECT_EQ(chunk.use_count(), 2) << "only the first, taken by nobody yet, shares the chunk";
  Message fresh = lane_msg(10);
  EXPECT_EQ(set.push(lane, fresh, 9, process_uid()), services::LaneSet::Push::kFull);
  EXPECT_EQ(set.stats().queued, 8u);
  auto t = set.take(std::chrono::steady_clock::now() + 1s);
  ASSERT_TRUE(t);
  EXPECT_EQ(t->msg.data.to_string(), std::string(64, 'c'));
  set.done(*t->lane);
  set.close();
}

// Past its bounds a lane divides them among the uids with work queued
// first, then among each uid's senders, as a router's memory budget does:
// a user with many connections (senders) divides his own part. By sender,
// the 6 of one uid below left the 1 of another a 7th of the bounds (1 of 8
// messages); by uid it keeps half (4).
TEST(ServicesLanes, PastItsBoundsALaneDividesThemAmongUidsFirst) {
  constexpr std::uint32_t kMine = 1000, kOther = 2000;
  services::LaneSet set;
  services::LaneOptions o;
  o.name = "shared";
  o.max_messages = 8;
  services::Lane& lane = set.add_lane(o);
  auto push = [&](std::uint64_t sender, std::uint32_t uid) {
    Message m = lane_msg(10);
    return set.push(lane, m, sender, uid);
  };
  for (std::uint64_t sender = 1; sender <= 6; ++sender)
    EXPECT_EQ(push(sender, kOther), services::LaneSet::Push::kQueued) << "sender " << sender;
  EXPECT_EQ(push(100, kMine), services::LaneSet::Push::kQueued);
  EXPECT_EQ(push(1, kOther), services::LaneSet::Push::kQueued) << "8: at the bound";
  for (int i = 0; i < 3; ++i)
    EXPECT_EQ(push(100, kMine), services::LaneSet::Push::kQueued)
        << "its uid's half of 8 among its 1 sender: message " << i + 2 << " of 4";
  EXPECT_EQ(push(100, kMine), services::LaneSet::Push::kFull) << "a 5th is past its 4";
  EXPECT_EQ(push(2, kOther), services::LaneSet::Push::kFull)
      << "the other uid's senders hold 1 each, over their 4 / 6";
  EXPECT_EQ(push(7, kOther), services::LaneSet::Push::kQueued)
      << "a sender holding nothing still passes its share";
  // The uid whose work is all taken leaves: the other has the whole bounds.
  while (auto t = set.take(std::chrono::steady_clock::now())) set.done(*t->lane);
  for (std::uint64_t sender = 1; sender <= 8; ++sender)
    EXPECT_EQ(push(sender, kOther), services::LaneSet::Push::kQueued) << "sender " << sender;
  set.close();
}

// A worker's done() goes with its next take(): a serialized lane's next
// message becomes runnable under that same lock, so the take finds it
// at once instead of waiting (the lane is out of the ring while its message
// runs), and the set counts the finished message as no longer running.
TEST(ServicesLanes, TakeWithTheFinishedLaneIsDoneThenTake) {
  services::LaneSet set;
  services::LaneOptions o;
  o.serialized = true;
  services::Lane& lane = set.add_lane(o);
  Message a = lane_msg(1), b = lane_msg(2);
  ASSERT_EQ(set.push(lane, a), services::LaneSet::Push::kQueued);
  ASSERT_EQ(set.push(lane, b), services::LaneSet::Push::kQueued);
  auto first = set.take(std::chrono::steady_clock::now() + 1s);
  ASSERT_TRUE(first);
  EXPECT_EQ(first->msg.data.size(), 1u);
  EXPECT_FALSE(set.take(std::chrono::steady_clock::now() + 20ms)) << "the serialized lane ran a second message";
  auto second = set.take(std::chrono::steady_clock::now() + 1s, first->lane);
  ASSERT_TRUE(second) << "take() did not finish the message it was given";
  EXPECT_EQ(second->msg.data.size(), 2u);
  EXPECT_EQ(set.stats().running, 1u);
  EXPECT_FALSE(set.take(std::chrono::steady_clock::now() + 20ms, second->lane));
  EXPECT_EQ(set.stats().running, 0u);
  set.close();
}

}  // namespace test_services_pool
}  // namespace spindle
