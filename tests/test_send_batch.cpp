// SendBatch (api/send_batch.h) against a real forked child: a batch's sends
// leave together, in order, with no wake-up of the broker until it ends; a
// send in it that must wait (a full gauge, a full outbox) hands the batch
// over instead of waiting on itself; a call inside one goes at once, after
// what came before it; batches nest, and one may outlive its runtime.
//
// The child counts what arrives on kData, checking each message's sequence
// number, and answers kReport with "<received> <out of order>".
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "broker/broker.h"
#include "router/child.h"
#include "router/router.h"
#include "spindle/runtime.h"
#include "spindle/send_batch.h"
#include "tests/router_test_util.h"

namespace spindle {
namespace test_send_batch {

using namespace testutil;
using namespace std::chrono_literals;

constexpr std::uint32_t kData = 3100;
constexpr std::uint32_t kReport = 3101;

int counting_child(ChildEnv& env) {
  Router& r = env.router();
  std::uint64_t received = 0, out_of_order = 0;  // the child's broker thread only
  r.add_handler([&](Message&& m) {
    std::uint64_t seq = ~0ull;
    if (m.data.size() >= sizeof seq) {
      std::string bytes = m.data.to_string();
      std::memcpy(&seq, bytes.data(), sizeof seq);
    }
    if (seq != received) ++out_of_order;
    ++received;
  }, {}, kData);
  r.add_handler([&](Message&& m) {
    r.reply(m, Payload::copy_of(fmt::format("{} {}", received, out_of_order)));
  }, {}, kReport);
  env.serve();
  return 0;
}

// `n` messages of `size` bytes (at least 8), numbered from `first`.
void send_numbered(const Context& c, std::uint64_t first, int n, std::size_t size = 16) {
  std::string body(size, 'x');
  for (int i = 0; i < n; ++i) {
    const std::uint64_t seq = first + static_cast<std::uint64_t>(i);
    std::memcpy(body.data(), &seq, sizeof seq);
    c.send(kData, std::string_view(body));
  }
}

std::string report(const Context& c) { return c.call(kReport, std::string_view(""), 20s); }

// This process's broker and router, and a counting child forked from them.
struct Counted {
  explicit Counted(RouterOptions ro = root_opts())
      : router(broker, std::move(ro)), c(fork_child(router, counting_child, named("counter"))) {}
  Broker broker;
  Router router;
  Context c;
};

TEST(SendBatch, ItsSendsLeaveTogetherInOrderWhenItEnds) {
  Counted t;
  auto& [broker, router, c] = t;
  ASSERT_EQ(report(c), "0 0");

  const auto before = broker.stats().wakeups_posted;
  std::uint64_t during = 0;
  {
    SendBatch batch(c);
    send_numbered(c, 0, 1000);
    during = broker.stats().wakeups_posted;
  }
  // Without the batch, 1,000 sends from this thread wake the broker at
  // least once (the first goes straight to the idle stream, the rest queue).
  EXPECT_EQ(during, before) << "a send inside the batch woke the broker";
  EXPECT_GT(broker.stats().wakeups_posted, during) << "the batch's end did not wake it";
  EXPECT_EQ(report(c), "1000 0");

  // And without a batch, as before.
  send_numbered(c, 1000, 1000);
  EXPECT_EQ(report(c), "2000 0");
  c.shutdown();
  expect_exit_code(c, 0);
}

// `n` messages of `size` bytes sent in one batch, from a thread of their
// own, must all arrive in order within 30 s under the bounds `ro` sets.
void expect_one_batch_delivered(RouterOptions ro, int n, std::size_t size) {
  Counted t(std::move(ro));
  const Context& c = t.c;
  ASSERT_EQ(report(c), "0 0");
  auto sent = std::async(std::launch::async, [&] {
    SendBatch batch(c);
    send_numbered(c, 0, n, size);
  });
  ASSERT_EQ(sent.wait_for(30s), std::future_status::ready) << "the batch waited on itself";
  sent.get();
  EXPECT_EQ(report(c), fmt::format("{} 0", n));
  c.shutdown();
  expect_exit_code(c, 0);
}

// 4 MiB through a 64 KiB high-water mark, all in one batch: each send that
// finds the gauge full must first hand the batch to the broker, or it
// would wait for its own frames, which nobody writes.
TEST(SendBatch, ASendOverTheHighWaterMarkHandsTheBatchOver) {
  RouterOptions ro = root_opts();
  ro.high_water_mark = 64 * 1024;
  expect_one_batch_delivered(ro, 4096, 1024);
}

// The same with the send queue (the outbox) as the bound: 16 KiB of ring,
// 2 MiB sent in one batch.
TEST(SendBatch, AFullSendQueueHandsTheBatchOver) {
  RouterOptions ro = root_opts();
  ro.outbox_size = 16 * 1024;
  expect_one_batch_delivered(ro, 4096, 512);
}

TEST(SendBatch, ACallInsideABatchGoesAtOnceAfterWhatWasSentBeforeIt) {
  Counted t;
  auto& [broker, router, c] = t;
  ASSERT_EQ(report(c), "0 0");
  SendBatch batch(c);
  send_numbered(c, 0, 10);
  EXPECT_EQ(report(c), "10 0");  // would wait for ever if the call were gathered
  send_numbered(c, 10, 10);
  EXPECT_EQ(report(c), "20 0");
}

TEST(SendBatch, AnInnerBatchLeavesTheHandOverToTheOuterOne) {
  Counted t;
  auto& [broker, router, c] = t;
  ASSERT_EQ(report(c), "0 0");
  const auto before = broker.stats().wakeups_posted;
  std::uint64_t after_inner = 0;
  {
    SendBatch outer(c);
    send_numbered(c, 0, 100);
    {
      SendBatch inner(c);
      send_numbered(c, 100, 100);
    }
    after_inner = broker.stats().wakeups_posted;
    send_numbered(c, 200, 100);
  }
  EXPECT_EQ(after_inner, before) << "the inner batch's end woke the broker";
  EXPECT_EQ(report(c), "300 0");
}

// A batch ended on another thread (a coroutine resumed elsewhere) hands its
// sends over, and the thread that made it stops gathering: its next sends
// are written or wake the broker, never left waiting for a batch that ended.
TEST(SendBatch, ABatchEndedOnAnotherThreadStopsGathering) {
  Counted t;
  auto& [broker, router, c] = t;
  ASSERT_EQ(report(c), "0 0");
  auto batch = std::make_unique<SendBatch>(c);
  send_numbered(c, 0, 100);
  std::thread([&] { batch.reset(); }).join();
  EXPECT_EQ(report(c), "100 0");
  // router.stats() asks the broker thread, which wakes it: outside the count.
  const auto direct = router.stats().direct_writes;
  const auto wakes = broker.stats().wakeups_posted;
  send_numbered(c, 100, 100);
  const auto woken = broker.stats().wakeups_posted - wakes;
  const auto written = router.stats().direct_writes - direct;
  EXPECT_GT(woken + written, 0u) << "this thread still gathers for a batch that ended";
  EXPECT_EQ(report(c), "200 0");
}

// A batch that outlives its runtime ends quietly (ASan: nothing freed is
// touched), and the thread's sends through a new runtime are not gathered.
TEST(SendBatch, ABatchMayOutliveItsRuntime) {
  std::optional<Runtime> rt(std::in_place, root_opts("first"));
  std::optional<SendBatch> batch(std::in_place, rt->context(rt->id()));
  rt.reset();
  batch.reset();

  Counted t;
  auto& [broker, router, c] = t;
  send_numbered(c, 0, 10);
  EXPECT_EQ(report(c), "10 0");
  const Context orphan = [] {
    Runtime gone(root_opts("gone"));
    return gone.context(1);
  }();
  EXPECT_THROW(SendBatch{orphan}, ShutdownError);
}

}  // namespace test_send_batch
}  // namespace spindle
