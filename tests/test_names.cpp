// Finding peers by name through a real spindle-router: clients register
// names as they connect (Connection::open), others find them with a glob and
// call their typed functions; names are unique, validated, and go with their
// client.
#include <algorithm>
#include <cctype>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include <spindle/connection.h>
#include <spindle/spindle.h>

#include "tests/named_worker.h"
#include "tests/router_fixture.h"
#include "tests/router_test_util.h"

namespace spindle {
namespace test_names {

using namespace testutil;
using namespace std::chrono_literals;

class Names : public RouterFixture {
 protected:
  void SetUp() override { start(); }
};

TEST_F(Names, ClientsFindWorkersByNameAndCallThem) {
  Worker a(socket(), "upper-1"), b(socket(), "upper-2"), other(socket(), "lower-1");
  Connection client = Connection::open(socket());
  std::vector<Context> found = client.find("upper-*");
  ASSERT_EQ(found.size(), 2u);
  EXPECT_EQ(found[0].name(), "upper-1");
  EXPECT_EQ(found[0].id(), a.conn.id());
  EXPECT_EQ(found[1].name(), "upper-2");
  EXPECT_EQ(found[0].call(upper, "hi"), "upper-1:HI");
  EXPECT_EQ(found[1].call(upper, "yo"), "upper-2:YO");
  EXPECT_EQ(client.async_find("lower-?").get().size(), 1u);
  EXPECT_TRUE(client.find("nobody*").empty());
}

TEST_F(Names, NamesAreUniqueAndValidated) {
  Worker a(socket(), "solo");
  try {
    Connection::open(socket(), {.name = "solo"});
    ADD_FAILURE() << "a second client took a living client's name";
  } catch (const CallError& e) {
    EXPECT_NE(std::string(e.what()).find("solo is taken"), std::string::npos) << e.what();
  }
  EXPECT_THROW(Connection::open(socket(), {.name = "bad name\n"}), CallError);
  EXPECT_THROW(Connection::open(socket(), {.name = std::string(65, 'x')}), CallError);
  Connection c = Connection::open(socket(), {.name = "first"});
  EXPECT_THROW(c.register_name("second"), CallError);
  EXPECT_EQ(c.find("first").size(), 1u);
  // A megabyte pattern is refused before it is decoded (which would first
  // join its slices into a copy).
  try {
    c.find(std::string(1 << 20, '*'));
    ADD_FAILURE() << "a 1 MiB pattern was taken";
  } catch (const CallError& e) {
    EXPECT_NE(std::string(e.what()).find("a name or pattern is at most 64"), std::string::npos) << e.what();
  }
}

// A named client holds what others send it until ready(). With nothing held
// and no link left, its close has nothing to wait for: it must not sit out
// the shutdown grace and force-close. Before the fix it did, so each refused
// open above took the whole grace (5 s).
TEST_F(Names, ANamedClientThatNeverSaidReadyClosesWithoutWaitingForTheGrace) {
  ScopedLogCapture capture;
  Connection c = Connection::open(socket(), {.name = "never-ready"});
  c.close();
  std::string line;
  spdlog::level::level_enum level;
  EXPECT_FALSE(capture.sink().wait_for_line("grace period over", 0ms, &line, &level)) << line;
}

TEST_F(Names, ANameGoesWithItsClient) {
  Connection client = Connection::open(socket());
  {
    Worker w(socket(), "short-lived");
    EXPECT_EQ(client.find("short-lived").size(), 1u);
  }
  EXPECT_TRUE(eventually([&] { return client.find("short-lived").empty(); }, 10s));
  Worker again(socket(), "short-lived");  // the name is free again
  EXPECT_EQ(client.find("short-lived").at(0).call(upper, "x"), "short-lived:X");
}

// A worker that exposed its functions and said ready() before it serves:
// a call that arrives in between waits for serve() instead of being refused
// (before, it was answered "invalid handle: 110"; python.test_router's worker
// does exactly this, and failed once in CI).
TEST_F(Names, ACallBetweenReadyAndServeWaitsForServe) {
  Connection worker = Connection::open(socket(), {.name = "late-server"});
  worker.expose(upper, [](std::string s) { return "late:" + s; }, Allow::kAnyone);
  worker.ready();
  Connection client = Connection::open(socket());
  std::vector<Context> found = client.find("late-server");
  ASSERT_EQ(found.size(), 1u);
  auto answer = std::async(std::launch::async, [&] { return found[0].call(upper, "x"); });
  // The call reaches the worker and waits there.
  EXPECT_EQ(answer.wait_for(300ms), std::future_status::timeout);
  std::thread serving([&] { worker.serve(); });
  EXPECT_EQ(answer.get(), "late:x");
  worker.close();
  serving.join();
}

}  // namespace test_names
}  // namespace spindle
