// Hosted mode (<spindle/hosted.h>): a Runtime on the application's own
// io_context, with no broker thread of its own. Real children, real sockets:
// calls from a coroutine on the application's loop, from other threads
// through it, async_shutdown letting run() return, the single-thread rule
// (a second thread running the loop, a blocking call on it), and a runtime
// dropped without a shutdown, inside one of the loop's handlers.
#include <dirent.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <future>
#include <optional>
#include <string>
#include <thread>

#include <asio/bind_executor.hpp>
#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/io_context.hpp>
#include <asio/post.hpp>
#include <asio/use_awaitable.hpp>
#include <gtest/gtest.h>

#include <spindle/asio.h>
#include <spindle/hosted.h>
#include <spindle/spindle.h>

namespace test_hosted {

using namespace std::chrono_literals;

inline constexpr spindle::method<long(long)> square{"square"};
inline constexpr spindle::method<void(long)> nap{"nap"};

int child_main(spindle::ChildEnv& env) {
  env.expose(square, [](long n) { return n * n; });
  env.expose(nap, [](long ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); });
  return env.serve();
}

int thread_count() {
  int n = 0;
  DIR* d = ::opendir("/proc/self/task");
  if (!d) return -1;
  while (dirent* e = ::readdir(d))
    if (e->d_name[0] != '.') ++n;
  ::closedir(d);
  return n;
}

// Rethrows a coroutine's exception out of ioc.run().
void rethrow(std::exception_ptr e) {
  if (e) std::rethrow_exception(e);
}

TEST(Hosted, ACoroutineOnTheApplicationsLoopCallsAChildAndShutsDown) {
  asio::io_context ioc;
  const int threads_before = thread_count();
  spindle::Runtime rt = spindle::hosted_runtime(ioc);
  EXPECT_TRUE(rt.hosted());
  spindle::Child child = rt.fork_child(child_main);
  EXPECT_EQ(thread_count(), threads_before) << "a hosted runtime runs no thread of its own";

  long by_coroutine = 0, by_callback = 0;
  bool shut_down = false;
  asio::co_spawn(ioc, [&]() -> asio::awaitable<void> {
    by_coroutine = co_await child.async_call(square, 7L, asio::use_awaitable);
    co_await rt.async_shutdown(asio::use_awaitable);
    shut_down = true;
  }, rethrow);
  child.async_call(square, 5L, asio::bind_executor(ioc, [&](std::exception_ptr e, long r) {
    EXPECT_FALSE(e);
    by_callback = r;
  }));
  ioc.run();  // returns: after the shutdown nothing of Spindle's is pending
  EXPECT_EQ(by_coroutine, 49);
  EXPECT_EQ(by_callback, 25);
  EXPECT_TRUE(shut_down);
  // The child was told SHUTDOWN and its link closed: it exits on its own.
  auto status = child.wait_exit(10s);
  ASSERT_TRUE(status.has_value());
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << *status;
}

TEST(Hosted, OtherThreadsCallThroughTheLoop) {
  asio::io_context ioc;
  spindle::Runtime rt = spindle::hosted_runtime(ioc);
  spindle::Child child = rt.fork_child(child_main);
  std::future<long> answer;
  std::thread caller([&] {
    // A Context is usable from any thread: its send is handed to the loop.
    answer = std::async(std::launch::deferred, [&] { return child.call(square, 9L); });
    long r = answer.get();
    asio::post(ioc, [&rt, r] {
      EXPECT_EQ(r, 81);
      rt.start_shutdown([] {});
    });
  });
  ioc.run();
  caller.join();
}

TEST(Hosted, ABlockingCallOnTheLoopThreadThrows) {
  asio::io_context ioc;
  spindle::Runtime rt = spindle::hosted_runtime(ioc);
  spindle::Child child = rt.fork_child(child_main);
  try {
    child.call(square, 2L);
    FAIL() << "a blocking call on the loop thread returned";
  } catch (const spindle::Error& e) {
    EXPECT_NE(std::string(e.what()).find("would block the broker thread"), std::string::npos)
        << e.what();
  }
  rt.start_shutdown([] {});
  ioc.run();
}

TEST(Hosted, ASecondThreadRunningTheLoopIsRefused) {
  asio::io_context ioc;
  spindle::Runtime rt = spindle::hosted_runtime(ioc);
  spindle::Child child = rt.fork_child(child_main);
  // The child's greeting arrives on the link: the stream's handler runs on
  // whichever thread runs the loop, here not the runtime's.
  std::string refused;
  std::thread other([&] {
    try {
      ioc.run();
    } catch (const spindle::Error& e) {
      refused = e.what();
    }
  });
  other.join();
  EXPECT_NE(refused.find("run by a second thread"), std::string::npos) << refused;
  // Dropped on its own loop thread without a shutdown: it stops at once.
}

TEST(Hosted, DroppedInsideAHandlerItFailsPendingCallsAndLetsTheLoopEnd) {
  asio::io_context ioc;
  std::optional<spindle::Runtime> rt;
  rt.emplace(spindle::hosted_runtime(ioc));
  // Its ~Child, at the end, waits only briefly for a child still napping.
  spindle::Child child = rt->fork_child(child_main, {.grace = 200ms});
  std::string why;
  bool completed = false;
  asio::co_spawn(ioc, [&]() -> asio::awaitable<void> {
    EXPECT_EQ(co_await child.async_call(square, 3L, asio::use_awaitable), 9);  // it serves
    child.async_call(nap, 60000L, asio::bind_executor(ioc, [&](std::exception_ptr e) {
      completed = true;
      try {
        if (e) std::rethrow_exception(e);
      } catch (const std::exception& x) {
        why = x.what();
      }
    }));
    rt.reset();  // the call is pending; the runtime is dropped on the loop thread
  }, rethrow);
  auto start = std::chrono::steady_clock::now();
  ioc.run();
  EXPECT_LT(std::chrono::steady_clock::now() - start, 30s) << "the loop waited for the call's deadline";
  EXPECT_TRUE(completed);
  // Force-closed at once: the callee's link went with the runtime.
  EXPECT_NE(why.find("shutdown"), std::string::npos) << why;
  EXPECT_THROW(child.call_async(square, 2L), spindle::ShutdownError);
}

TEST(Hosted, AnAsioOfAnotherBuildIsRefused) {
  asio::io_context ioc;
  EXPECT_THROW(spindle::Runtime(spindle::detail::HostedLoop{&ioc, ASIO_VERSION + 1, sizeof ioc}, {}),
               spindle::Error);
}

}  // namespace test_hosted
