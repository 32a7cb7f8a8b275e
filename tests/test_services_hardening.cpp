// Services against hostile callers (issue #11): a caller's bytes cannot forge
// the log; user callbacks never run under the host's mutex; a caller that
// never reads cannot stall a worker with its replies; the work a peer queues
// for a service is charged to that peer and bounded; the callers joining one
// deduplicated computation are bounded. The peers that misbehave are raw
// sockets (tests/raw_peer.h) talking to an in-process router with a listener,
// so the kernel's socket buffers and the router's accounts are the real ones.

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <spdlog/sinks/base_sink.h>

#include "broker/log.h"
#include "services/envelope.h"
#include "stream/rx_buffer.h"
#include "services/reasons.h"
#include "tests/listener_test_util.h"
#include "tests/raw_peer.h"
#include "tests/router_test_util.h"
#include "tests/services_test_util.h"

namespace spindle {
namespace test_services_hardening {

using namespace testutil;
using namespace std::chrono_literals;
using services::Access;
using services::Request;
using services::RunMode;
using services::Service;

// Every formatted log record, kept whole: a record that holds a raw newline
// is one record that would print as two lines.
class RecordSink final : public spdlog::sinks::base_sink<std::mutex> {
 public:
  std::vector<std::string> records() {
    std::lock_guard lk(mutex_);
    return records_;
  }

 protected:
  void sink_it_(const spdlog::details::log_msg& msg) override {
    spdlog::memory_buf_t buf;
    formatter_->format(msg, buf);
    records_.emplace_back(buf.data(), buf.size());
  }
  void flush_() override {}

 private:
  std::vector<std::string> records_;
};

// Routes the log into a RecordSink at debug level while it lives.
class DebugLogCapture {
 public:
  DebugLogCapture() : level_(log().level()) {
    set_log_sinks({sink_});
    log().set_level(spdlog::level::debug);
  }
  ~DebugLogCapture() {
    log().set_level(level_);
    set_log_sinks({});
  }
  RecordSink& sink() { return *sink_; }

 private:
  spdlog::level::level_enum level_;
  std::shared_ptr<RecordSink> sink_ = std::make_shared<RecordSink>();
};

// A test whose regression is a deadlock fails instead of hanging the suite:
// past the guard the process is ended with a message saying which wait hung
// (a deadlocked worker could not be joined by any later teardown).
void run_or_abort(const char* what, std::function<void()> fn, std::chrono::seconds guard = 30s) {
  auto done = std::make_shared<std::promise<void>>();
  auto f = done->get_future();
  std::thread([fn = std::move(fn), done] {
    fn();
    done->set_value();
  }).detach();
  if (f.wait_for(guard) != std::future_status::ready) {
    std::fprintf(stderr, "FAILED: %s did not return within %lld s (deadlock)\n", what,
                 static_cast<long long>(guard.count()));
    std::fflush(stderr);
    std::abort();
  }
}

// A raw client of `rt`'s listener: the Spindle handshake, then frames by hand.
struct RawClient {
  explicit RawClient(const InProcessRouter& rt) : peer(RawPeer::connect_to(rt.address())) {
    id = peer.handshake();
  }
  // A CALL_SERVICE frame to the router, whose reply goes to `reply_to`.
  std::string call_frame(std::string_view service, std::string_view method, std::string_view args,
                         std::uint32_t reply_to) const {
    Payload body = services::encode_call(service, method, Payload::copy_of(args));
    return frame_bytes(frame(peer.server_id, id, id, kHandleCallService, reply_to), body.to_string());
  }
  RawPeer peer;
  std::uint32_t id = 0;
};

// Reply handles the raw clients ask for: far above the router's own handles,
// so a control frame the router sends them is never taken for an answer.
constexpr std::uint32_t kReplyBase = 1u << 20;

// The next answer to one of `c`'s calls (control frames are skipped); false
// if none came within the hang guard.
bool next_answer(RawClient& c, Message& m) {
  while (c.peer.read_frame(m, 20s))
    if (m.header.handle >= kReplyBase) return true;
  return false;
}

// A thread that writes a burst the router may stop reading (it pauses a peer
// over its limit): joined however the test ends, after `release` lets the
// router read again; a write that fails once the test is over is ignored.
class BurstWriter {
 public:
  BurstWriter(RawClient& c, std::string burst, std::function<void()> release)
      : release_(std::move(release)), thread_([&c, b = std::move(burst)] {
          try {
            c.peer.write_all(b);
          } catch (const std::exception&) {
          }
        }) {}
  ~BurstWriter() { join(); }
  void join() {
    if (!thread_.joinable()) return;
    release_();
    thread_.join();
  }

 private:
  std::function<void()> release_;
  std::thread thread_;
};

// A test that fails while handlers are held lets them go before its
// teardown waits for the pool.
struct OpenOnExit {
  Gate& gate;
  ~OpenOnExit() { gate.open(); }
};

// Service "slow", method "wait": answers "ok" once the gate opens. One call
// holds a one-worker pool, so later calls queue in its lane.
void host_slow_service(services::ServiceHost& host, Gate& gate) {
  auto s = std::make_unique<Service>("slow");
  s->expose("wait", Access::any(), [&gate](Request&) {
    gate.wait(60s);
    return Payload::copy_of("ok");
  });
  host.add(std::move(s));
}

std::optional<ClientStats> client(Router& router, std::uint32_t id) {
  for (const ClientStats& c : router.client_stats())
    if (c.id == id) return c;
  return std::nullopt;
}

// --- 1. client-supplied bytes in the log ---------------------------------

// A service or method name is the caller's bytes. Before, a rejected call
// logged its reason raw at debug level ("unknown service: <name>"), so a
// name holding "\n" and an escape sequence wrote a line of the caller's
// choosing into the router's log.
TEST(ServicesHardening, ACallersNamesReachTheLogEscaped) {
  ServiceRig rig(2);
  auto s = std::make_unique<Service>("known");
  s->expose("m", Access::any(), [](Request& r) { return r.args(); });
  rig.add(std::move(s));
  const std::string forged = "x\n[2026-01-01 00:00:00.000] [root] [critical] forged\x1b[2J";
  DebugLogCapture capture;
  EXPECT_NE(dead_reason([&] { services::call(rig.self, forged, "m"); }), "");
  EXPECT_NE(dead_reason([&] { services::call(rig.self, "known", forged); }), "");
  std::vector<std::string> records = capture.sink().records();
  int rejections = 0;
  for (const std::string& r : records) {
    if (contains(r, "rejected")) ++rejections;
    std::string_view body(r);
    if (!body.empty() && body.back() == '\n') body.remove_suffix(1);
    EXPECT_EQ(body.find('\n'), std::string_view::npos) << "one record, two lines: " << r;
    EXPECT_EQ(body.find('\x1b'), std::string_view::npos) << "a raw ESC in the log: " << r;
  }
  EXPECT_EQ(rejections, 2) << "both rejections are logged (at debug level), escaped";
}

// --- 2. user callbacks and the host's mutex -------------------------------

// on_shutdown() is user code: it may use the host it belongs to. Before, the
// host ran it holding its own mutex, so a find() or names() from it
// deadlocked the last worker, and with it the pool's stop.
class CallsBackIntoTheHost : public Service {
 public:
  CallsBackIntoTheHost(services::ServiceHost*& host, std::atomic<int>& found)
      : Service("calls-back"), host_(host), found_(found) {}
  void on_shutdown() override {
    if (host_->find("calls-back") == this) ++found_;
    found_ += static_cast<int>(host_->names().size());
  }

 private:
  services::ServiceHost*& host_;
  std::atomic<int>& found_;
};

TEST(ServicesHardening, OnShutdownMayCallBackIntoItsHost) {
  ServiceRig rig(2);
  services::ServiceHost* host = &rig.host;
  std::atomic<int> found{0};
  rig.add(std::make_unique<CallsBackIntoTheHost>(host, found));
  run_or_abort("Pool::stop() with an on_shutdown() that calls ServiceHost::find()",
               [&] { rig.pool.stop(); });
  EXPECT_EQ(found.load(), 2) << "find() saw the service and names() listed it";
}

// --- 3. replies never block a worker --------------------------------------

// A caller that sends calls with large answers and never reads its socket.
// Before 5ad49d7 a worker sent each answer with Router::send(), which waits
// (up to 30 s) while the caller's queue is over its high-water mark: with one
// worker, every other caller then waited too. Now an answer is queued and
// charged to the caller who asked for it (post_reply) and the worker goes
// on. The stall timeout is set far beyond the test so that disconnecting the
// silent caller cannot be what frees the worker.
TEST(ServicesHardening, ACallerThatNeverReadsCannotStallTheWorker) {
  RouterOptions ro = root_opts("router");
  ro.stall_timeout = std::chrono::minutes(10);
  InProcessRouter rt({}, ro);
  services::Pool pool(pool_of(1));
  services::ServiceHost host(rt.router(), pool);
  constexpr std::size_t kAnswer = 512 * 1024;  // under the memfd threshold: sent inline
  auto s = std::make_unique<Service>("bulk");
  s->expose("blob", Access::any(), [](Request&) { return Payload::copy_of(std::string(kAnswer, 'b')); });
  s->expose("ping", Access::any(), [](Request& r) { return r.args(); });
  host.add(std::move(s));

  RawClient silent(rt);
  const std::size_t calls = 2 * rt.router().options().high_water_mark / kAnswer + 16;  // 48
  std::string burst;
  for (std::size_t i = 0; i < calls; ++i) burst += silent.call_frame("bulk", "blob", "", kReplyBase + i);
  silent.peer.write_all(burst);
  // Its queue reaches the high-water mark (within one answer of it), where
  // a waiting send blocks.
  ASSERT_TRUE(eventually([&] {
    auto c = client(rt.router(), silent.id);
    return c && c->queued_bytes + kAnswer + kHeaderSize > rt.router().options().high_water_mark;
  })) << "the silent caller's answers never filled its queue";

  auto honest = rt.client();
  std::string answer;
  try {
    answer = services::call_text(honest->router_context(), "bulk", "ping", "still served", 20s);
  } catch (const std::exception& e) {
    ADD_FAILURE() << "the honest caller was not served: " << e.what();
  }
  EXPECT_EQ(answer, "still served");
  // Every one of the silent caller's calls was answered: what it did not
  // read waits on its own output queue, not in a worker.
  EXPECT_TRUE(eventually([&] { return host.stats().answered == calls + 1; }))
      << host.stats().answered << " of " << calls + 1 << " calls run";
  auto c = client(rt.router(), silent.id);
  ASSERT_TRUE(c) << "the silent caller is still connected";
  EXPECT_GT(c->queued_bytes, rt.router().options().high_water_mark);
  honest.reset();
}

// --- 4. work queued for services is charged to the peer -------------------

// Calls waiting in a service's lane hold their bytes (the receive chunks
// they pin): that is charged to the peer that sent them, so a peer whose
// queued calls reach its memory limit is paused (not read), and the lane
// holds no more of its calls than its limit allows. Once the service runs
// again the charges are released and the peer is read and answered in full.
TEST(ServicesHardening, QueuedServiceWorkIsChargedToThePeerAndBoundedByItsLimit) {
  RouterOptions ro = root_opts("router");
  ro.peer_memory_limit = 4u << 20;
  ro.stall_timeout = std::chrono::minutes(10);
  InProcessRouter rt({}, ro);
  services::Pool pool(pool_of(1));
  services::ServiceHost host(rt.router(), pool);
  Gate gate;
  host_slow_service(host, gate);
  OpenOnExit release(gate);

  RawClient peer(rt);
  peer.peer.write_all(peer.call_frame("slow", "wait", "", kReplyBase));
  ASSERT_TRUE(eventually([&] { return gate.waiting() == 1; }));  // the one worker is held
  // 16 MiB of calls, four times its limit, from a thread of its own: the
  // router stops reading it, so the writes block until the gate opens.
  constexpr std::size_t kArgs = 16 * 1024;
  constexpr std::size_t kCalls = 1024;
  const std::string args(kArgs, 'a');
  std::string burst;
  for (std::size_t i = 0; i < kCalls; ++i) burst += peer.call_frame("slow", "wait", args, kReplyBase + 1 + i);
  BurstWriter writer(peer, std::move(burst), [&] { gate.open(); });

  ASSERT_TRUE(eventually([&] {
    auto c = client(rt.router(), peer.id);
    return c && c->paused;
  })) << "a peer whose queued calls reach its limit is paused";
  // Paused: nothing more of it reaches the lane.
  const std::size_t queued = pool.stats().queued;
  auto c = client(rt.router(), peer.id);
  ASSERT_TRUE(c);
  // The calls' bytes lie in receive chunks, each charged whole once the
  // stream moves past it; only the chunk it is still reading into is not.
  EXPECT_GE(c->memory_held + kChunkSize, queued * kArgs) << "the queued calls are on the peer's account";
  EXPECT_GT(queued, 0u);
  EXPECT_LT(queued, kCalls) << "the lane took all of a paused peer's calls";
  // The limit, plus what a stream takes in past it before it pauses: the
  // chunk it is reading into (not yet charged) and the last read's worth.
  // Margin to spare: 16 MiB were sent, and without the charge all of it lands.
  EXPECT_LE(queued * kArgs, ro.peer_memory_limit + 4 * kChunkSize);

  writer.join();  // opens the gate first
  int answered = 0;
  Message m;
  while (answered < static_cast<int>(kCalls) + 1 && next_answer(peer, m)) {
    EXPECT_FALSE(m.is_dead()) << m.text();
    ++answered;
  }
  EXPECT_EQ(answered, static_cast<int>(kCalls) + 1) << "every call is answered once it can run";
  EXPECT_TRUE(eventually([&] {
    auto now = client(rt.router(), peer.id);
    return now && !now->paused && now->memory_held < ro.peer_memory_limit / 4;
  })) << "the charges go with the work";
}

// The "slow" service on a one-worker pool, held shut (its lane fills) until
// the test opens the gate, or ends.
struct HeldLane {
  // Limits that let one client fill the lane: its 65,541 calls in flight
  // are pledged at Router::kCallInFlightBytes each, 1 GiB in all, which the
  // default 64 MiB would stop at 4,096 (CallsInFlightArePledgedToTheClient).
  static RouterOptions roomy() {
    RouterOptions ro = root_opts("router");
    ro.peer_memory_limit = std::size_t{4} << 30;
    ro.memory_limit = std::size_t{8} << 30;
    return ro;
  }
  InProcessRouter rt{{}, roomy()};
  services::Pool pool{pool_of(1)};
  services::ServiceHost host{rt.router(), pool};
  Gate gate;
  OpenOnExit release{gate};
  HeldLane() { host_slow_service(host, gate); }

  // `peer` holds the one worker with a call, then sends the lane's bound of
  // calls and `over` more: the refusals, as they come (nothing else may).
  std::vector<std::string> fill(RawClient& peer, std::size_t over) {
    peer.peer.write_all(peer.call_frame("slow", "wait", "", kReplyBase));
    EXPECT_TRUE(eventually([&] { return gate.waiting() == 1; }));
    std::string burst;
    for (std::size_t i = 0; i < services::kDefaultLaneMaxMessages + over; ++i)
      burst += peer.call_frame("slow", "wait", "", kReplyBase + 1 + static_cast<std::uint32_t>(i));
    std::vector<std::string> refusals;
    Message m;
    // The refusals come while the gate is shut and the writer may still be
    // writing: the burst is larger than the socket's buffers.
    BurstWriter writer(peer, std::move(burst), [] {});
    while (refusals.size() < over && next_answer(peer, m)) {
      EXPECT_TRUE(m.is_dead()) << "nothing but refusals while the service is held: " << m.text();
      refusals.push_back(m.text());
    }
    return refusals;
  }
};

// Past its lane's bound (65,536 calls), a peer's call is refused at once
// with a dead reply that says why, rather than queued without bound.
TEST(ServicesHardening, APeerPastALanesBoundGetsServiceQueueFull) {
  HeldLane lane;
  services::Pool& pool = lane.pool;
  Gate& gate = lane.gate;
  RawClient peer(lane.rt);
  constexpr std::size_t kOver = 5;
  const std::size_t bound = services::kDefaultLaneMaxMessages;
  const std::vector<std::string> refusals = lane.fill(peer, kOver);
  Message m;
  ASSERT_EQ(refusals.size(), kOver);
  for (const std::string& r : refusals) {
    EXPECT_TRUE(r.starts_with(services::reason::kQueueFull)) << r;
    EXPECT_TRUE(contains(r, fmt::format("{} messages", bound))) << r;
  }
  EXPECT_EQ(pool.stats().queued, bound) << "the lane holds its bound, no more";
  EXPECT_EQ(pool.stats().refused_full, kOver);
  gate.open();
  std::size_t answered = 0;
  while (answered < bound + 1 && next_answer(peer, m)) {
    EXPECT_FALSE(m.is_dead()) << m.text();
    ++answered;
  }
  EXPECT_EQ(answered, bound + 1) << "what the lane accepted is answered";
}

// One peer that fills a lane does not shut the others out of it: past the
// bound, a peer holding less than its share (the bound divided among the
// peers with work queued) is still queued, while the one holding more is
// refused. Before, once one peer had filled a shared lane (a router's ping
// service), every other peer's call was refused until it drained.
TEST(ServicesHardening, APeerThatFillsALaneLeavesTheOthersTheirShare) {
  HeldLane lane;
  services::Pool& pool = lane.pool;
  Gate& gate = lane.gate;
  RawClient flooder(lane.rt), other(lane.rt);
  constexpr std::size_t kOver = 3, kOthers = 10;
  const std::size_t bound = services::kDefaultLaneMaxMessages;
  const std::vector<std::string> refusals = lane.fill(flooder, kOver);
  ASSERT_EQ(refusals.size(), kOver);
  for (const std::string& r : refusals) EXPECT_TRUE(r.starts_with(services::reason::kQueueFull)) << r;
  Message m;
  ASSERT_EQ(pool.stats().queued, bound);

  // The full lane still takes the other peer's calls...
  std::string calls;
  for (std::size_t i = 0; i < kOthers; ++i) calls += other.call_frame("slow", "wait", "", kReplyBase + i);
  other.peer.write_all(calls);
  ASSERT_TRUE(eventually([&] { return pool.stats().queued == bound + kOthers; }))
      << pool.stats().queued << " queued, " << pool.stats().refused_full << " refused";
  // ...and still refuses the flooder's.
  flooder.peer.write_all(flooder.call_frame("slow", "wait", "", kReplyBase + 2 * bound));
  ASSERT_TRUE(next_answer(flooder, m));
  EXPECT_TRUE(m.is_dead());
  EXPECT_TRUE(contains(m.text(), fmt::format("context {} holds its share", flooder.id))) << m.text();
  EXPECT_EQ(pool.stats().refused_full, kOver + 1);

  gate.open();
  for (std::size_t i = 0; i < kOthers; ++i) {
    ASSERT_TRUE(next_answer(other, m));
    EXPECT_FALSE(m.is_dead()) << m.text();
  }
}

// A peer's share is its link's, not each context it announces behind it:
// ids are one ALLOCATE_ID each, and before, each announced id counted as
// another sender, whose first call a full lane always took (and whose
// share shrank everyone else's).
TEST(ServicesHardening, ContextsAPeerAnnouncesShareItsLinksShare) {
  HeldLane lane;
  services::Pool& pool = lane.pool;
  RawClient flooder(lane.rt);
  ASSERT_EQ(lane.fill(flooder, 1).size(), 1u);
  constexpr std::size_t kSybils = 4;
  const std::vector<std::uint32_t> sybils = flooder.peer.allocate_and_announce(flooder.id, kSybils);
  ASSERT_EQ(sybils.size(), kSybils);
  std::string calls;
  for (std::size_t i = 0; i < kSybils; ++i) {
    Payload body = services::encode_call("slow", "wait", Payload());
    calls += frame_bytes(frame(flooder.peer.server_id, sybils[i], sybils[i], kHandleCallService,
                               kReplyBase + (1u << 19) + static_cast<std::uint32_t>(i)),
                         body.to_string());
  }
  flooder.peer.write_all(calls);
  Message m;
  for (std::size_t i = 0; i < kSybils; ++i) {
    ASSERT_TRUE(next_answer(flooder, m));
    EXPECT_TRUE(m.is_dead() && m.text().starts_with(services::reason::kQueueFull)) << m.text();
  }
  EXPECT_EQ(pool.stats().refused_full, 1 + kSybils);
  EXPECT_EQ(pool.stats().queued, services::kDefaultLaneMaxMessages);
}

// A client's calls a service holds are pledged to its account
// (Router::kCallInFlightBytes each), and reading it stops at the frame that
// puts it over its limit, not at its next read: however cheap its calls,
// the work it has in flight is bounded by its limit. Before, a client that
// never read its answers had every call read ahead of them answered (an
// audit's 20,000 names.find calls, 14 KB each). Once the service runs, the
// pledges go with the answers and the client is read to the end.
//
// A router whose client may hold 1 MiB (64 pledges) sends 2,000 calls of a
// few dozen bytes to slow.wait, held shut: 100 KB, one read's worth, which
// the limit on bytes alone would have taken whole. `held_by()` counts the
// calls the service holds, once the pool has settled (nullopt before).
void expect_calls_in_flight_pledged(
    std::size_t threads, const std::function<void(services::ServiceHost&, Gate&)>& host_it,
    const std::function<std::optional<std::size_t>(services::Pool&)>& held_by) {
  RouterOptions ro = root_opts("router");
  ro.peer_memory_limit = 1u << 20;
  ro.stall_timeout = std::chrono::minutes(10);
  InProcessRouter rt({}, ro);
  services::Pool pool(pool_of(threads));  // after the router: it leaves the broker first
  services::ServiceHost host(rt.router(), pool);
  Gate gate;
  host_it(host, gate);
  OpenOnExit release(gate);

  RawClient peer(rt);
  constexpr std::size_t kCalls = 2000;
  std::string burst;
  for (std::size_t i = 0; i < kCalls; ++i) burst += peer.call_frame("slow", "wait", "", kReplyBase + i);
  BurstWriter writer(peer, std::move(burst), [&] { gate.open(); });
  ASSERT_TRUE(eventually([&] {
    auto c = client(rt.router(), peer.id);
    return c && c->paused;
  })) << "a client whose calls in flight reach its limit is paused";
  const std::size_t pledged = ro.peer_memory_limit / Router::kCallInFlightBytes;  // 64
  // Paused, it sends the pool nothing more: what the pool holds settles.
  std::size_t now = 0;
  ASSERT_TRUE(eventually([&] {
    const std::optional<std::size_t> held = held_by(pool);
    now = held.value_or(0);
    return held.has_value();
  }));
  EXPECT_LE(now, pledged + 1) << "calls past the client's limit were read";
  EXPECT_GE(now, pledged / 2) << "paused before its pledges reached its limit";
  auto c = client(rt.router(), peer.id);
  ASSERT_TRUE(c);
  EXPECT_GE(c->memory_held, now * Router::kCallInFlightBytes) << "the calls in flight are not on its account";

  writer.join();  // opens the gate first
  std::size_t answered = 0;
  Message m;
  while (answered < kCalls && next_answer(peer, m)) {
    EXPECT_FALSE(m.is_dead()) << m.text();
    ++answered;
  }
  EXPECT_EQ(answered, kCalls) << "every call is answered once it can run";
  EXPECT_TRUE(eventually([&] {
    auto after = client(rt.router(), peer.id);
    return after && !after->paused && after->memory_held < Router::kCallInFlightBytes;
  })) << "the pledges go with the answers";
}

TEST(ServicesHardening, CallsInFlightArePledgedToTheClient) {
  // One worker, held by the first call; the rest queue.
  expect_calls_in_flight_pledged(1, host_slow_service, [](services::Pool& pool) {
    return std::optional<std::size_t>(pool.stats().queued + pool.stats().running);
  });
}

// The same for calls joined to a deduplicated computation: they wait
// outside any lane, holding only their headers (ReplyState), and their
// pledges with them.
TEST(ServicesHardening, CallsJoinedToADeduplicatedComputationArePledgedToo) {
  std::mutex mu;
  std::shared_ptr<services::ReplyState> computing;
  auto host_it = [&](services::ServiceHost& host, Gate& gate) {
    auto s = std::make_unique<Service>("slow", RunMode::kDeduplicated);
    s->expose("wait", Access::any(), [&](Request& r) {
      {
        std::lock_guard lk(mu);
        computing = r.reply().state();
      }
      gate.wait(60s);
      return Payload::copy_of("ok");
    });
    host.add(std::move(s));
  };
  // Two workers: one computes, the other joins callers to it until the lane
  // is empty and only the computation runs.
  expect_calls_in_flight_pledged(2, host_it, [&](services::Pool& pool) -> std::optional<std::size_t> {
    const auto st = pool.stats();
    std::lock_guard lk(mu);
    if (!computing || st.queued != 0 || st.running != 1) return std::nullopt;
    return computing->joined();
  });
}

// --- 5. the callers joining one deduplicated computation ------------------

// Identical calls to a deduplicated service join the computation that is
// running (ReplyState::join). Joined callers wait outside any lane, so their
// number is bounded (kMaxJoined): the caller past it starts a computation of
// its own, which later identical callers join. Before the bound, one running
// computation could collect any number of waiting callers.
TEST(ServicesHardening, JoinedCallersAreBoundedPerComputation) {
  ServiceRig rig(3);  // two computations held, one worker to join callers to them
  Gate gate;
  std::atomic<int> computed{0};
  std::mutex states_mu;
  std::vector<std::shared_ptr<services::ReplyState>> states;
  auto s = std::make_unique<Service>("dedup", RunMode::kDeduplicated);
  s->expose("slow", Access::any(), [&](Request& r) {
    int n = ++computed;
    {
      std::lock_guard lk(states_mu);
      states.push_back(r.reply().state());
    }
    gate.wait(60s);
    return Payload::copy_of(fmt::format("computation #{}", n));
  });
  rig.add(std::move(s));
  OpenOnExit release(gate);
  constexpr std::size_t kMax = services::ReplyState::kMaxJoined;
  constexpr std::size_t kOver = 3;
  std::vector<std::future<Message>> calls;
  calls.push_back(services::call_async(rig.self, "dedup", "slow", Payload::copy_of("x"), 60s));
  ASSERT_TRUE(eventually([&] { return gate.waiting() == 1; }));
  for (std::size_t i = 1; i < kMax + kOver; ++i)
    calls.push_back(services::call_async(rig.self, "dedup", "slow", Payload::copy_of("x"), 60s));
  // The first computation fills up; the call past the bound computes anew,
  // and the two after it join that second computation.
  ASSERT_TRUE(eventually([&] {
    return gate.waiting() == 2 && rig.pool.stats().queued == 0 && rig.pool.stats().running == 2;
  })) << "computed " << computed.load() << ", queued " << rig.pool.stats().queued;
  {
    std::lock_guard lk(states_mu);
    ASSERT_EQ(states.size(), 2u);
    EXPECT_EQ(states[0]->joined(), kMax) << "one computation answers at most kMaxJoined callers";
    EXPECT_EQ(states[1]->joined(), kOver);
  }
  gate.open();
  std::size_t first = 0, second = 0;
  for (auto& f : calls) {
    std::string r = f.get().text();
    if (r == "computation #1") ++first;
    else if (r == "computation #2") ++second;
    else ADD_FAILURE() << "unexpected answer " << r;
  }
  EXPECT_EQ(first, kMax);
  EXPECT_EQ(second, kOver);
  EXPECT_EQ(computed.load(), 2);
}

}  // namespace test_services_hardening
}  // namespace spindle
