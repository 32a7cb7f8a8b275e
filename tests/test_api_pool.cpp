// serve(spindle::Pool{...}): exposed functions run concurrently on worker
// threads of their own while serve() waits for SHUTDOWN; serve() without a
// pool keeps running them one at a time on main's thread.
//
// The proof of concurrency is a rendezvous: two calls that each wait for the
// other can only both succeed if they run at the same time.
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <future>
#include <mutex>
#include <string>

#include <gtest/gtest.h>

#include <spindle/spindle.h>

namespace test_api_pool {

using namespace std::chrono_literals;

inline constexpr spindle::method<bool(long)> meet{"meet"};  // waits up to `ms` for a second caller
inline constexpr spindle::method<long()> tid{"tid"};
inline constexpr spindle::method<void(long)> nap{"nap"};

// Each call waits for the other; both return true if they met.
struct Rendezvous {
  std::mutex mu;
  std::condition_variable cv;
  int arrived = 0;
  bool wait(std::chrono::milliseconds limit) {
    std::unique_lock lk(mu);
    ++arrived;
    cv.notify_all();
    return cv.wait_for(lk, limit, [&] { return arrived >= 2; });
  }
};

void expose_all(spindle::ChildEnv& env, Rendezvous& r) {
  env.expose(meet, [&r](long ms) { return r.wait(std::chrono::milliseconds(ms)); });
  env.expose(tid, [] { return static_cast<long>(::gettid()); });
  env.expose(nap, [](long ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); });
}

int pooled_main(spindle::ChildEnv& env) {
  Rendezvous r;
  expose_all(env, r);
  return env.serve(spindle::Pool{.threads = 4});
}

int serial_main(spindle::ChildEnv& env) {
  Rendezvous r;
  expose_all(env, r);
  return env.serve();
}

TEST(ApiPool, TwoCallsThatWaitForEachOtherBothComplete) {
  spindle::Runtime rt;
  spindle::Child c = rt.fork_child(pooled_main, {.name = "pooled"});
  auto a = c.call_async(meet, 20'000L);
  auto b = c.call_async(meet, 20'000L);
  EXPECT_TRUE(a.get());
  EXPECT_TRUE(b.get());
  EXPECT_EQ(c.stop(), 0) << "serve(Pool) returns 0 at SHUTDOWN";
}

// The control: without a pool the first call runs alone and gives up.
TEST(ApiPool, WithoutAPoolTheSameCallsRunOneAtATime) {
  spindle::Runtime rt;
  spindle::Child c = rt.fork_child(serial_main, {.name = "serial"});
  auto a = c.call_async(meet, 500L);
  auto b = c.call_async(meet, 500L);
  EXPECT_FALSE(a.get()) << "the first call met the second: they ran at once";
  EXPECT_TRUE(b.get());  // the second finds the first's arrival
  EXPECT_EQ(c.stop(), 0);
}

TEST(ApiPool, FunctionsRunOnWorkerThreadsNotOnMain) {
  spindle::Runtime rt;
  spindle::Child c = rt.fork_child(pooled_main, {.name = "pooled"});
  // On main's thread gettid() == pid; a pool worker is another thread.
  for (int i = 0; i < 4; ++i) EXPECT_NE(c.call(tid), c.pid());
  EXPECT_EQ(c.stop(), 0);
}

TEST(ApiPool, CallsInFlightAtShutdownFinishFirst) {
  spindle::Runtime rt;
  spindle::Child c = rt.fork_child(pooled_main, {.name = "pooled"});
  auto slow = c.call_async(nap, 300L);
  c.call(tid);  // the nap has begun (or queued) before SHUTDOWN is sent
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(c.stop(), 0);
  EXPECT_NO_THROW(slow.get()) << "a call in flight was dropped at SHUTDOWN";
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
}

int bad_pool_main(spindle::ChildEnv& env) {
  env.expose(tid, [] { return 0L; });
  try {
    env.serve(spindle::Pool{.threads = 0});
  } catch (const spindle::Error& e) {
    return std::string(e.what()).find("threads must be 1..1024") != std::string::npos ? 3 : 4;
  }
  return 5;
}

TEST(ApiPool, APoolOfNoThreadsIsAClearError) {
  spindle::Runtime rt;
  spindle::Child c = rt.fork_child(bad_pool_main, {.name = "bad-pool"});
  auto st = c.wait_exit(30s);
  ASSERT_TRUE(st.has_value());
  ASSERT_TRUE(WIFEXITED(*st));
  EXPECT_EQ(WEXITSTATUS(*st), 3);
}

}  // namespace test_api_pool
