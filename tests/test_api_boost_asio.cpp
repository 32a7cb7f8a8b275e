// <spindle/boost_asio.h> as a Boost.Asio user meets it, against a forked
// child: callbacks on an io_context's executor, use_future, use_awaitable in
// a co_spawn'ed coroutine, a lazy token (nothing sent before it is
// launched), remote exceptions as CallError, cancellation where Boost has
// it, and async_find through a real spindle-router. Its own translation
// unit: <spindle/asio.h> and <spindle/boost_asio.h> cannot meet in one.
#include <chrono>
#include <future>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include <boost/asio/bind_executor.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/use_future.hpp>
#include <boost/asio/version.hpp>
#if BOOST_ASIO_VERSION >= 101900
#include <boost/asio/bind_cancellation_slot.hpp>
#include <boost/asio/cancellation_signal.hpp>
#endif
#include <gtest/gtest.h>

#include <spindle/boost_asio.h>
#include <spindle/spindle.h>

// Not router_fixture.h: it reaches the internals, hence standalone Asio,
// which cannot share a translation unit with Boost.Asio 1.74 (both define
// the same global asio_execution_* names).
#include "tests/process_util.h"

#ifdef SPINDLE_ASIO_H_INCLUDED
#error "this test is the Boost.Asio flavour's: <spindle/asio.h> must not be reached"
#endif

namespace net = boost::asio;

// A lazy completion token, as boost::asio::deferred (Boost 1.80) is: the
// initiating function only stores the initiation; calling the result with a
// handler starts the operation. Boost 1.74 has no deferred of its own.
struct Lazy {};

template <class Sig>
struct boost::asio::async_result<Lazy, Sig> {
  template <class Initiation, class... Args>
  static auto initiate(Initiation init, Lazy, Args... args) {
    return [init = std::move(init), args = std::make_tuple(std::move(args)...)](auto handler) mutable {
      std::apply([&](auto&... a) { std::move(init)(std::move(handler), std::move(a)...); }, args);
    };
  }
};

namespace test_api_boost_asio {

using namespace std::chrono_literals;

inline constexpr spindle::method<long(long)> square{"square"};
inline constexpr spindle::method<long()> count{"count"};
inline constexpr spindle::method<void(long)> nap{"nap"};
inline constexpr spindle::method<long(std::string)> fail{"fail"};

int child_main(spindle::ChildEnv& env) {
  long calls = 0;
  env.expose(square, [](long n) { return n * n; });
  env.expose(count, [&calls] { return ++calls; });
  env.expose(nap, [](long ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); });
  env.expose(fail, [](std::string why) -> long { throw std::invalid_argument(why); });
  return env.serve();
}

class BoostAsio : public ::testing::Test {
 protected:
  spindle::Runtime rt;
  spindle::Child child = rt.fork_child(child_main, {.name = "boost-child"});
};

TEST_F(BoostAsio, ACallbackRunsOnItsIoContextsThread) {
  net::io_context ioc{1};
  std::thread::id ran_on;
  long got = 0;
  child.async_call(square, 5, net::bind_executor(ioc, [&](std::exception_ptr e, long r) {
                     EXPECT_FALSE(e);
                     got = r;
                     ran_on = std::this_thread::get_id();
                   }));
  ioc.run();  // returns only once the call completed: the work guard held it
  EXPECT_EQ(got, 25);
  EXPECT_EQ(ran_on, std::this_thread::get_id());
}

TEST_F(BoostAsio, AsyncShutdownCompletesOnceTheChildrenWereToldAndTheBrokerFinished) {
  net::io_context ioc{1};
  bool done = false;
  rt.async_shutdown(net::bind_executor(ioc, [&](std::exception_ptr e) {
    EXPECT_FALSE(e);
    done = true;
  }));
  ioc.run();  // the work guard holds it until the shutdown has finished
  EXPECT_TRUE(done);
  auto status = child.wait_exit(10s);  // SHUTDOWN reached it: it ends on its own
  ASSERT_TRUE(status.has_value());
  EXPECT_EQ(*status, 0);
}

TEST_F(BoostAsio, UseFutureAndUseAwaitable) {
  std::future<long> f = child.async_call(square, 8, net::use_future);
  ASSERT_EQ(f.wait_for(20s), std::future_status::ready);
  EXPECT_EQ(f.get(), 64);

  net::io_context ioc{1};
  long awaited = 0;
  net::co_spawn(
      ioc,
      [&]() -> net::awaitable<void> {
        awaited = co_await child.async_call(square, 9, net::use_awaitable);
        awaited += co_await child.async_call(square, 2, net::use_awaitable);
      },
      net::detached);
  ioc.run();
  EXPECT_EQ(awaited, 85);
}

TEST_F(BoostAsio, ALazyTokenSendsNothingBeforeItIsLaunched) {
  auto op = child.async_call(count, Lazy{});
  EXPECT_EQ(child.call(count), 1);  // the lazy call has not run
  std::promise<long> later;
  op([&](std::exception_ptr e, long n) {
    if (e) later.set_exception(e);
    else later.set_value(n);
  });
  auto f = later.get_future();
  ASSERT_EQ(f.wait_for(20s), std::future_status::ready);
  EXPECT_EQ(f.get(), 2);
}

TEST_F(BoostAsio, ARemoteExceptionArrivesAsCallErrorInEveryForm) {
  auto expect_call_error = [](std::exception_ptr e) {
    ASSERT_TRUE(e);
    try {
      std::rethrow_exception(e);
    } catch (const spindle::CallError& err) {
      EXPECT_EQ(err.type(), "std::invalid_argument");
      EXPECT_NE(std::string(err.what()).find("no good"), std::string::npos) << err.what();
    }
  };
  std::future<long> f = child.async_call(fail, "no good", net::use_future);
  ASSERT_EQ(f.wait_for(20s), std::future_status::ready);
  try {
    f.get();
    ADD_FAILURE() << "no exception";
  } catch (...) {
    expect_call_error(std::current_exception());
  }

  net::io_context ioc{1};
  std::exception_ptr called_back, awaited;
  child.async_call(fail, "no good", net::bind_executor(ioc, [&](std::exception_ptr e, long) { called_back = e; }));
  net::co_spawn(
      ioc,
      [&]() -> net::awaitable<void> {
        try {
          co_await child.async_call(fail, std::string("no good"), net::use_awaitable);
        } catch (...) {
          awaited = std::current_exception();
        }
      },
      net::detached);
  ioc.run();
  expect_call_error(called_back);
  expect_call_error(awaited);
}

TEST_F(BoostAsio, CancellationCompletesWithOperationAborted) {
#if BOOST_ASIO_VERSION >= 101900
  net::io_context ioc{1};
  net::cancellation_signal cancel;
  std::exception_ptr seen;
  bool done = false;
  auto t0 = std::chrono::steady_clock::now();
  child.async_call(nap, 1500L, net::bind_cancellation_slot(cancel.slot(), net::bind_executor(ioc, [&](std::exception_ptr e) {
                                                             seen = e;
                                                             done = true;
                                                           })));
  net::post(ioc, [&] { cancel.emit(net::cancellation_type::terminal); });
  ioc.run();
  ASSERT_TRUE(done);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 1000ms);
  try {
    std::rethrow_exception(seen);
  } catch (const boost::system::system_error& e) {
    EXPECT_EQ(e.code(), net::error::operation_aborted);
  }
#else
  // Boost.Asio before 1.77 has no per-operation cancellation: nothing can
  // bind a slot to a handler. The shared implementation's cancellation path
  // is exercised by the standalone Asio flavour (test_api.cpp).
  GTEST_SKIP() << "Boost.Asio " << BOOST_ASIO_VERSION / 100000 << "." << BOOST_ASIO_VERSION / 100 % 1000
               << " has no cancellation slots (Boost 1.77 and later)";
#endif
}

class BoostAsioFind : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(router.wait_ready()); }
  std::string socket() const { return dir.path() + "/router.sock"; }

  spindle::testutil::TempDir dir;
  spindle::testutil::RouterProcess router{SPINDLE_ROUTER_BINARY, socket()};
};

TEST_F(BoostAsioFind, AsyncFindWithBoostTokens) {
  spindle::Connection worker = spindle::Connection::open(socket(), {.name = "boost-worker"});
  worker.ready();  // it serves nothing: what waits for it need not wait at close
  spindle::Connection client = spindle::Connection::open(socket());
  std::future<std::vector<spindle::Context>> f = client.async_find("boost-*", net::use_future);
  ASSERT_EQ(f.wait_for(20s), std::future_status::ready);
  std::vector<spindle::Context> found = f.get();
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].name(), "boost-worker");
  EXPECT_EQ(found[0].id(), worker.id());

  net::io_context ioc{1};
  std::size_t awaited = 99;
  net::co_spawn(
      ioc, [&]() -> net::awaitable<void> { awaited = (co_await client.async_find("nobody*", net::use_awaitable)).size(); },
      net::detached);
  ioc.run();
  EXPECT_EQ(awaited, 0u);
}

}  // namespace test_api_boost_asio
