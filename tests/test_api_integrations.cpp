// The opt-in integrations as a user meets them (the Boost.Asio flavour is in
// test_api_boost_asio.cpp: one flavour per translation unit):
//  - Connection::async_find with Asio completion tokens, against a real
//    spindle-router and named clients;
//  - <spindle/log.h> and <spindle/spdlog.h>: Spindle's records (its own, and
//    a child's forwarded to it) reach a user's spdlog logger, on the log
//    writer thread, behind the bounded queue; reset goes back to stderr.
#include <fcntl.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <condition_variable>
#include <future>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <asio/bind_executor.hpp>
#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/experimental/deferred.hpp>
#include <asio/io_context.hpp>
#include <asio/use_awaitable.hpp>
#include <asio/use_future.hpp>
#include <gtest/gtest.h>
#include <spdlog/sinks/base_sink.h>
#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/sinks/ringbuffer_sink.h>
#include <spdlog/spdlog.h>

#include <spindle/asio.h>
#include <spindle/spdlog.h>
#include <spindle/spindle.h>

#include "broker/broker.h"
#include "broker/log.h"
#include "tests/named_worker.h"
#include "tests/router_fixture.h"

namespace spindle {
namespace test_api_integrations {

using namespace testutil;
using namespace std::chrono_literals;

// --- async_find with completion tokens ---

class AsyncFind : public RouterFixture {
 protected:
  void SetUp() override { start(); }
};

std::vector<std::string> names_of(const std::vector<Context>& found) {
  std::vector<std::string> out;
  for (const Context& c : found) out.push_back(c.name());
  return out;
}

TEST_F(AsyncFind, EveryCompletionTokenFindsTheNamedClients) {
  Worker a(socket(), "upper-1"), b(socket(), "upper-2"), other(socket(), "lower-1");
  Connection client = Connection::open(socket());
  const std::vector<std::string> uppers{"upper-1", "upper-2"};

  // A coroutine finds the workers and calls one of them.
  asio::io_context ioc{1};
  std::vector<std::string> awaited;
  std::string answer;
  asio::co_spawn(
      ioc,
      [&]() -> asio::awaitable<void> {
        std::vector<Context> found = co_await client.async_find("upper-*", asio::use_awaitable);
        awaited = names_of(found);
        answer = co_await found.at(1).async_call(upper, std::string("hi"), asio::use_awaitable);
      },
      asio::detached);
  ioc.run();  // the work guard keeps run() going until both complete
  EXPECT_EQ(awaited, uppers);
  EXPECT_EQ(answer, "upper-2:HI");

  // A callback runs on its io_context's thread.
  ioc.restart();
  std::thread::id ran_on;
  std::vector<std::string> called_back;
  client.async_find("lower-?", asio::bind_executor(ioc, [&](std::exception_ptr e, std::vector<Context> found) {
                      EXPECT_FALSE(e);
                      called_back = names_of(found);
                      ran_on = std::this_thread::get_id();
                    }));
  ioc.run();
  EXPECT_EQ(called_back, std::vector<std::string>{"lower-1"});
  EXPECT_EQ(ran_on, std::this_thread::get_id());

  std::future<std::vector<Context>> f = client.async_find("*-1", asio::use_future);
  ASSERT_EQ(f.wait_for(20s), std::future_status::ready);
  EXPECT_EQ(names_of(f.get()), (std::vector<std::string>{"lower-1", "upper-1"}));

  // Deferred: nothing runs before it is launched.
  auto op = client.async_find("upper-2", asio::experimental::deferred);
  std::promise<std::vector<std::string>> later;
  std::move(op)([&](std::exception_ptr e, std::vector<Context> found) {
    if (e) later.set_exception(e);
    else later.set_value(names_of(found));
  });
  auto lf = later.get_future();
  ASSERT_EQ(lf.wait_for(20s), std::future_status::ready);
  EXPECT_EQ(lf.get(), std::vector<std::string>{"upper-2"});

  // The future overload is still there.
  EXPECT_EQ(client.async_find("upper-?").get().size(), 2u);
}

TEST_F(AsyncFind, AConnectionThatIsNotConnectedCompletesWithAnErrorInsteadOfThrowing) {
  Connection unconnected;
  std::future<std::vector<Context>> f;
  ASSERT_NO_THROW(f = unconnected.async_find("x*", asio::use_future));
  ASSERT_EQ(f.wait_for(20s), std::future_status::ready);
  try {
    f.get();
    ADD_FAILURE() << "found peers without a router";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("not connected"), std::string::npos) << e.what();
  }
}

// --- logging into a user's spdlog logger ---

// An spdlog sink that lets a test wait for a line holding some text, and
// notes on which threads it was called.
class WaitableSink final : public spdlog::sinks::base_sink<std::mutex> {
 public:
  // True once a line holding `needle` arrived (within `limit`).
  bool wait_for(const std::string& needle, std::chrono::milliseconds limit) {
    std::unique_lock lk(mu_);
    return cv_.wait_for(lk, limit, [&] { return has_locked(needle); });
  }
  bool has(const std::string& needle) {
    std::lock_guard lk(mu_);
    return has_locked(needle);
  }
  std::vector<std::thread::id> threads() {
    std::lock_guard lk(mu_);
    return threads_;
  }
  // From now on, notes whether each line arrives on `b`'s thread (null: stop).
  void watch(Broker* b) {
    std::lock_guard lk(mutex_);  // base_sink's, held around sink_it_
    broker_ = b;
  }
  std::vector<bool> on_broker() {
    std::lock_guard lk(mutex_);
    return on_broker_;
  }

 protected:
  void sink_it_(const spdlog::details::log_msg& msg) override {
    spdlog::memory_buf_t buf;
    formatter_->format(msg, buf);
    if (broker_) on_broker_.push_back(broker_->on_broker_thread());
    std::lock_guard lk(mu_);
    lines_.emplace_back(buf.data(), buf.size());
    threads_.push_back(std::this_thread::get_id());
    cv_.notify_all();
  }
  void flush_() override {}

 private:
  bool has_locked(const std::string& needle) const {
    return std::any_of(lines_.begin(), lines_.end(),
                       [&](const std::string& l) { return l.find(needle) != std::string::npos; });
  }
  std::mutex mu_;  // ours, besides base_sink's: wait_for() reads while sink_it_ writes
  std::condition_variable cv_;
  std::vector<std::string> lines_;
  std::vector<std::thread::id> threads_;
  Broker* broker_ = nullptr;     // under base_sink's mutex_
  std::vector<bool> on_broker_;  // likewise
};

// Leaves the process's log handler as it found it (stderr), whatever fails.
struct LogHandlerReset {
  ~LogHandlerReset() { reset_log_handler(); }
};

int logging_child(ChildEnv& env) {
  log().warn("child line {}", "forwarded-to-the-parent");
  return env.serve();
}

TEST(LogToSpdlog, SpindleRecordsAndAChildsForwardedLinesReachTheUsersLogger) {
  std::ostringstream out;
  auto waiter = std::make_shared<WaitableSink>();
  auto ring = std::make_shared<spdlog::sinks::ringbuffer_sink_mt>(64);
  auto user = std::make_shared<spdlog::logger>(
      "user", spdlog::sinks_init_list{std::make_shared<spdlog::sinks::ostream_sink_mt>(out), ring, waiter});
  user->set_pattern("%n [%l] %v");
  LogHandlerReset restore;  // after what the handler writes to: it goes first
  log_to(user);

  Runtime rt;
  waiter->watch(&rt.broker());
  struct Unwatch {
    WaitableSink* sink;
    ~Unwatch() { sink->watch(nullptr); }  // before the runtime goes
  } unwatch{waiter.get()};
  log().warn("parent line {}", "straight-from-spindle");
  ASSERT_TRUE(waiter->wait_for("straight-from-spindle", 20s));
  Child child = rt.fork_child(logging_child, {.name = "chatty"});
  ASSERT_TRUE(waiter->wait_for("forwarded-to-the-parent", 20s));
  reset_log_handler();  // once it returns, nothing writes to `out` any more

  // Through the user's logger: its name, pattern, level and every sink.
  EXPECT_NE(out.str().find("user [warning] ctx="), std::string::npos) << out.str();
  EXPECT_NE(out.str().find("(chatty)"), std::string::npos) << out.str();
  auto kept = ring->last_formatted();
  EXPECT_TRUE(std::any_of(kept.begin(), kept.end(),
                          [](const std::string& l) { return l.find("forwarded-to-the-parent") != std::string::npos; }));
  // On the log writer thread: neither the thread that logged nor the broker.
  for (std::thread::id t : waiter->threads()) EXPECT_NE(t, std::this_thread::get_id());
  for (bool b : waiter->on_broker()) EXPECT_FALSE(b) << "the handler ran on the broker thread";
  EXPECT_FALSE(waiter->on_broker().empty());
}

TEST(LogToSpdlog, TheUsersLevelFiltersAndSpindlesLevelDecidesWhatIsMade) {
  LogHandlerReset restore;
  const LogLevel before = log_level();
  auto waiter = std::make_shared<WaitableSink>();
  auto user = std::make_shared<spdlog::logger>("user", waiter);
  user->set_level(spdlog::level::warn);
  log_to(user);
  set_log_level(LogLevel::debug);
  log().info("info-below-the-users-level");
  log().debug("debug-made-since-spindle-logs-debug");
  log().error("error-passes-both");
  // Records arrive in order: once this one is in, the two above were seen.
  ASSERT_TRUE(waiter->wait_for("error-passes-both", 20s));
  user->set_level(spdlog::level::debug);
  log().debug("debug-now-passes-both");
  ASSERT_TRUE(waiter->wait_for("debug-now-passes-both", 20s));
  EXPECT_TRUE(waiter->has("error-passes-both"));
  EXPECT_FALSE(waiter->has("info-below-the-users-level"));
  EXPECT_FALSE(waiter->has("debug-made-since-spindle-logs-debug"));
  set_log_level(before);
}

// A handler that is not keeping up costs the logging thread nothing: records
// beyond the queue's bound are dropped, counted, and reported to it.
TEST(LogHandler, ASlowHandlerNeverBlocksTheLoggerAndHearsOfWhatWasDropped) {
  LogHandlerReset restore;
  std::promise<void> release, blocked;
  std::shared_future<void> go = release.get_future().share();
  std::promise<std::string> note;
  std::mutex mu;
  bool first = true, noted = false;
  set_log_handler([&](const LogRecord& r) {
    std::unique_lock lk(mu);
    if (std::exchange(first, false)) {
      blocked.set_value();
      lk.unlock();
      go.wait();  // the handler is stuck: the queue fills
      return;
    }
    if (!noted && r.text.find("dropped") != std::string_view::npos) {
      noted = true;
      note.set_value(std::string(r.text));
    }
  });
  log().warn("the first record blocks the handler");
  ASSERT_EQ(blocked.get_future().wait_for(20s), std::future_status::ready);
  const std::string big(1000, 'x');
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 3000; ++i) log().warn("record {} {}", i, big);  // 3 MB into a 1 MiB queue
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s) << "logging waited for the handler";
  release.set_value();
  auto f = note.get_future();
  ASSERT_EQ(f.wait_for(20s), std::future_status::ready);
  EXPECT_NE(f.get().find("the log handler is not keeping up"), std::string::npos);
}

// Reads what reaches fd 2 while `fn` runs and until `needle` shows up.
bool stderr_shows(const std::string& needle, const std::function<void()>& fn) {
  int p[2];
  if (::pipe2(p, O_CLOEXEC) != 0) return false;
  int saved = ::dup(STDERR_FILENO);
  ::dup2(p[1], STDERR_FILENO);
  fn();
  std::string seen;
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  while (seen.find(needle) == std::string::npos && std::chrono::steady_clock::now() < deadline) {
    pollfd pfd{p[0], POLLIN, 0};
    if (::poll(&pfd, 1, 100) <= 0) continue;
    char buf[4096];
    ssize_t n = ::read(p[0], buf, sizeof buf);
    if (n > 0) seen.append(buf, static_cast<std::size_t>(n));
  }
  ::dup2(saved, STDERR_FILENO);
  ::close(saved);
  ::close(p[0]);
  ::close(p[1]);
  return seen.find(needle) != std::string::npos;
}

TEST(LogHandler, ResetGoesBackToStderrAndTheOldHandlerIsNeverCalledAgain) {
  LogHandlerReset restore;
  std::atomic<int> calls_after_reset{0};
  std::atomic<bool> reset_done{false};
  std::promise<void> first;
  std::atomic<bool> got_first{false};
  set_log_handler([&](const LogRecord& r) {
    if (reset_done.load()) calls_after_reset++;
    if (r.text.find("to-the-handler") != std::string_view::npos && !got_first.exchange(true)) first.set_value();
  });
  log().warn("to-the-handler");
  ASSERT_EQ(first.get_future().wait_for(20s), std::future_status::ready);
  reset_log_handler();
  reset_done = true;
  EXPECT_TRUE(stderr_shows("back-on-stderr", [] { log().warn("back-on-stderr"); }));
  EXPECT_EQ(calls_after_reset.load(), 0);
}

}  // namespace test_api_integrations
}  // namespace spindle
