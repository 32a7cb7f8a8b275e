// Service calls in one process: replies, every dead-reply reason, CallError
// from a throwing method (the worker survives), replies kept and sent later
// from another thread, and the envelope's byte layout.
#include <atomic>
#include <future>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "broker/errors.h"
#include "services/envelope.h"
#include "services/reasons.h"
#include "tests/router_test_util.h"
#include "tests/services_test_util.h"

namespace spindle {
namespace test_services_calls {

using namespace testutil;
using namespace std::chrono_literals;
using services::Access;
using services::Request;
using services::Service;

struct Oops : std::logic_error {
  using std::logic_error::logic_error;
};

std::unique_ptr<Service> sample_service() {
  auto s = std::make_unique<Service>("sample");
  s->expose("echo", Access::any(), [](Request& r) { return r.args(); });
  s->expose("whoami", Access::any(), [](Request& r) {
    return Payload::copy_of(std::to_string(r.caller().src_id) + "/" + std::to_string(r.caller().auth_id));
  });
  s->expose("throw", Access::any(), [](Request& r) -> Payload { throw Oops("bad " + r.args_text()); });
  return s;
}

TEST(ServicesCalls, ResultAndCallerIds) {
  ServiceRig rig(2);
  rig.add(sample_service());
  EXPECT_EQ(services::call_text(rig.self, "sample", "echo", "hello"), "hello");
  std::string big(300 * 1024, 'z');
  EXPECT_EQ(services::call(rig.self, "sample", "echo", Payload::copy_of(big)).size(), big.size());
  EXPECT_EQ(services::call_text(rig.self, "sample", "whoami"), "0/0");
  EXPECT_EQ(services::call_async(rig.self, "sample", "echo", Payload::copy_of("later")).get().text(), "later");
}

TEST(ServicesCalls, UnknownServiceAndMethodGetDeadRepliesNamingThem) {
  ServiceRig rig(1);
  rig.add(sample_service());
  std::string r = dead_reason([&] { services::call(rig.self, "nosuch", "echo"); });
  EXPECT_TRUE(contains(r, services::reason::kUnknownService)) << r;
  EXPECT_TRUE(contains(r, "nosuch")) << r;
  r = dead_reason([&] { services::call(rig.self, "sample", "nomethod"); });
  EXPECT_TRUE(contains(r, services::reason::kUnknownMethod)) << r;
  EXPECT_TRUE(contains(r, "sample.nomethod")) << r;
}

TEST(ServicesCalls, MalformedEnvelopesGetDeadReplies) {
  ServiceRig rig(1);
  rig.add(sample_service());
  auto raw = [&](std::string bytes) {
    return dead_reason([&] { rig.self.call(kHandleCallService, Payload::copy_of(bytes), 10s); });
  };
  std::string r = raw("\x01");
  EXPECT_TRUE(contains(r, services::reason::kMalformed)) << r;
  r = raw(std::string("\x02\x00\x00\x01\x00\x01sm", 8));
  EXPECT_TRUE(contains(r, services::reason::kUnsupportedVersion)) << r;
  r = raw(std::string("\x01\x00\xff\xff\x00\x01", 6) + "s");  // absurd name length
  EXPECT_TRUE(contains(r, services::reason::kMalformed) && contains(r, "at most 255")) << r;
  r = raw(std::string("\x01\x00\x00\x09\x00\x09", 6) + "short");  // names run past the end
  EXPECT_TRUE(contains(r, services::reason::kMalformed)) << r;
  r = raw(std::string("\x01\x00\x00\x00\x00\x01", 6) + "m");  // empty service name
  EXPECT_TRUE(contains(r, "service name is empty")) << r;
  r = raw(std::string("\x01\x07\x00\x01\x00\x01", 6) + "sm");  // unknown flags
  EXPECT_TRUE(contains(r, "unknown flags")) << r;
  // The client refuses to build such calls in the first place.
  EXPECT_THROW(services::encode_call(std::string(256, 's'), "m", {}), Error);
  EXPECT_THROW(services::encode_call("s", "", {}), Error);
  EXPECT_THROW(services::encode_call(std::string("a\0b", 3), "m", {}), Error);
  EXPECT_EQ(rig.host.stats().rejected, 6u);
}

TEST(ServicesCalls, EnvelopeLayoutMatchesProtocolDoc) {
  Payload p = services::encode_call("echo", "say", Payload::copy_of("hi"));
  EXPECT_EQ(p.to_string(), std::string("\x01\x00\x00\x04\x00\x03" "echosayhi", 15));
  auto d = services::decode_call(p);
  ASSERT_TRUE(d.ok()) << d.error;
  EXPECT_EQ(d.envelope.service, "echo");
  EXPECT_EQ(d.envelope.method, "say");
  EXPECT_EQ(d.envelope.args.to_string(), "hi");
  // Split across slices anywhere, it decodes the same.
  std::string bytes = p.to_string();
  for (std::size_t cut = 1; cut < bytes.size(); ++cut) {
    Payload split = Payload::copy_of(std::string_view(bytes).substr(0, cut));
    Payload tail = Payload::copy_of(std::string_view(bytes).substr(cut));
    for (const Slice& s : tail.slices()) split.append(s);
    auto e = services::decode_call(split);
    ASSERT_TRUE(e.ok()) << "cut at " << cut << ": " << e.error;
    EXPECT_EQ(e.envelope.service + "|" + e.envelope.method + "|" + e.envelope.args.to_string(), "echo|say|hi");
  }
}

TEST(ServicesCalls, ExceptionBecomesCallErrorAndWorkerSurvives) {
  ServiceRig rig(1);
  rig.add(sample_service());
  for (int round = 0; round < 3; ++round) {
    try {
      services::call_text(rig.self, "sample", "throw", "input");
      ADD_FAILURE() << "no exception";
    } catch (const CallError& e) {
      EXPECT_TRUE(contains(e.type(), "Oops")) << e.type();
      EXPECT_EQ(e.message(), "bad input");
    }
    // The single worker is still there.
    EXPECT_EQ(services::call_text(rig.self, "sample", "echo", "alive"), "alive");
  }
}

TEST(ServicesCalls, DelayedReplyFromAnotherThread) {
  ServiceRig rig(1);
  std::promise<services::Reply> kept;
  auto s = std::make_unique<Service>("later");
  s->expose("ask", Access::any(), [&](Request& r) {
    kept.set_value(r.defer_reply());
    return Payload::copy_of("ignored: the reply was deferred");
  });
  s->expose("echo", Access::any(), [](Request& r) { return r.args(); });
  rig.add(std::move(s));
  auto answer = services::call_async(rig.self, "later", "ask");
  services::Reply reply = kept.get_future().get();
  // The worker is free while the reply waits: another call goes through.
  EXPECT_EQ(services::call_text(rig.self, "later", "echo", "meanwhile"), "meanwhile");
  EXPECT_NE(answer.wait_for(0s), std::future_status::ready);
  std::thread replier([reply] { EXPECT_TRUE(reply.send(Payload::copy_of("from another thread"))); });
  replier.join();
  EXPECT_EQ(answer.get().text(), "from another thread");
  EXPECT_TRUE(reply.sent());
  EXPECT_FALSE(reply.send(Payload::copy_of("twice")));  // answered once only
}

TEST(ServicesCalls, DelayedCallErrorAndDroppedReply) {
  ServiceRig rig(1);
  std::promise<services::Reply> kept;
  auto s = std::make_unique<Service>("later");
  s->expose("fail", Access::any(), [&](Request& r) {
    kept.set_value(r.defer_reply());
    return Payload();
  });
  s->expose("drop", Access::any(), [](Request& r) {
    std::thread([reply = r.defer_reply()] {}).join();  // the last copy dies unanswered
    return Payload();
  });
  rig.add(std::move(s));
  auto failing = services::call_async(rig.self, "later", "fail");
  std::thread([reply = kept.get_future().get()] { reply.fail("Custom", "went wrong"); }).join();
  try {
    failing.get();
    ADD_FAILURE() << "no exception";
  } catch (const CallError& e) {
    EXPECT_EQ(e.type(), "Custom");
    EXPECT_EQ(e.message(), "went wrong");
  }
  std::string r = dead_reason([&] { services::call(rig.self, "later", "drop"); });
  EXPECT_TRUE(contains(r, services::reason::kNoReply)) << r;
}

// Back-to-back calls, each sent as soon as the previous one completed, on
// fresh rigs (the shape of bench_services' call section): requests and the
// workers' replies go through the outbox and wake the broker while it may be
// clearing an earlier wake-up. A lost wake-up (the store/load race that
// Broker::wake() fences against) leaves a record in the outbox with the
// broker asleep, and with no other traffic to wake it that call never
// completes. Before the fix bench_services hung so within a few thousand
// calls. It is a race: this finds it often, not always. Each call gets 10 s,
// so a stranded one fails the test instead of hanging it.
TEST(ServicesCalls, BackToBackCallsNeverStrandARequestInTheOutbox) {
  int stranded = 0;
  for (int round = 0; round < 60 && stranded == 0; ++round) {
    ServiceRig rig(1 + round % 2);
    rig.add(sample_service());
    std::thread caller([&] {
      for (int i = 0; i < 400 && stranded == 0; ++i) {
        const std::string text = std::to_string(round) + ":" + std::to_string(i);
        auto f = services::call_async(rig.self, "sample", "echo", Payload::copy_of(text));
        if (f.wait_for(10s) != std::future_status::ready || f.get().text() != text) ++stranded;
      }
    });
    caller.join();
  }
  EXPECT_EQ(stranded, 0) << "a call never completed: its request or reply was left in the outbox";
}

TEST(ServicesCalls, DuplicateServiceOrMethodIsRefused) {
  ServiceRig rig(1);
  rig.add(sample_service());
  EXPECT_THROW(rig.add(sample_service()), Error);
  Service s("x");
  s.expose("m", Access::any(), [](Request&) { return Payload(); });
  EXPECT_THROW(s.expose("m", Access::any(), [](Request&) { return Payload(); }), Error);
  EXPECT_THROW(Service(std::string(300, 'n')), Error);
}

// A method exposed on_receiver runs on the thread that receives the call (for
// a local call, the caller's own), not on a worker; a serialized service
// keeps its one-at-a-time rule and ignores the flag.
TEST(ServicesCalls, AnOnReceiverMethodRunsOnTheReceivingThread) {
  auto thread_text = [](Request&) {
    std::ostringstream os;
    os << std::this_thread::get_id();
    return Payload::copy_of(os.str());
  };
  ServiceRig rig(2);
  auto quick = std::make_unique<Service>("quick");
  quick->expose("here", Access::any(), thread_text, services::Encoding::kRaw, /*on_receiver=*/true);
  quick->expose("pooled", Access::any(), thread_text);
  rig.add(std::move(quick));
  auto serial = std::make_unique<Service>("serial", services::RunMode::kSerialized);
  serial->expose("here", Access::any(), thread_text, services::Encoding::kRaw, /*on_receiver=*/true);
  rig.add(std::move(serial));
  std::ostringstream me;
  me << std::this_thread::get_id();
  EXPECT_EQ(services::call_text(rig.self, "quick", "here"), me.str());
  EXPECT_NE(services::call_text(rig.self, "quick", "pooled"), me.str());
  EXPECT_NE(services::call_text(rig.self, "serial", "here"), me.str());
}

}  // namespace test_services_calls
}  // namespace spindle
