// A program written against the installed headers only: of Spindle's, it
// includes <spindle/spindle.h> and <spindle/asio.h>, nothing else. It forks
// a child and calls it blocking, with a future, with use_awaitable and with
// deferred (nothing is sent before it is awaited), and checks that a remote
// exception arrives with its type in every form. Exit 0 when all hold.
#include <cstdio>
#include <exception>
#include <string>

#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/experimental/deferred.hpp>
#include <asio/io_context.hpp>
#include <asio/use_awaitable.hpp>

#include <spindle/asio.h>
#include <spindle/spindle.h>

inline constexpr spindle::method<long(long)> square{"square"};
inline constexpr spindle::method<long()> count{"count"};
inline constexpr spindle::method<long(std::string)> fail{"fail"};

namespace {
int failures = 0;
void expect(bool ok, const char* what) {
  std::printf("%s %s\n", ok ? "ok  " : "FAIL", what);
  if (!ok) ++failures;
}
bool is_domain_error(std::exception_ptr e) {
  try {
    if (e) std::rethrow_exception(e);
  } catch (const spindle::CallError& c) {
    return c.type() == "std::domain_error" && c.message() == "no";
  } catch (...) {
  }
  return false;
}

int child_main(spindle::ChildEnv& env) {
  long calls = 0;
  env.expose(square, [](long n) { return n * n; });
  env.expose(count, [&calls] { return ++calls; });
  env.expose(fail, [](std::string why) -> long { throw std::domain_error(why); });
  return env.serve();
}

asio::awaitable<void> coroutine(spindle::Child& c) {
  expect(co_await c.async_call(square, 9, asio::use_awaitable) == 81, "use_awaitable");
  try {
    co_await c.async_call(fail, "no", asio::use_awaitable);
    expect(false, "use_awaitable: CallError");
  } catch (...) {
    expect(is_domain_error(std::current_exception()), "use_awaitable: CallError type");
  }
}
}  // namespace

int main() {
  spindle::Runtime rt;
  spindle::Child child = rt.fork_child(child_main);
  expect(child.call(square, 7) == 49, "blocking");
  expect(child.call_async(square, 3).get() == 9, "future");
  try {
    child.call(fail, "no");
  } catch (...) {
    expect(is_domain_error(std::current_exception()), "blocking: CallError type");
  }
  auto f = child.call_async(fail, "no");
  try {
    f.get();
  } catch (...) {
    expect(is_domain_error(std::current_exception()), "future: CallError type");
  }

  asio::io_context ioc{1};
  asio::co_spawn(ioc, coroutine(child), asio::detached);
  ioc.run();

  auto later = child.async_call(count, asio::experimental::deferred);
  expect(child.call(count) == 1, "deferred: nothing sent before it is awaited");
  ioc.restart();
  asio::co_spawn(ioc, [&]() -> asio::awaitable<void> {
    expect(co_await std::move(later)(asio::use_awaitable) == 2, "deferred: sent when awaited");
    auto failing = child.async_call(fail, "no", asio::experimental::deferred);
    try {
      co_await std::move(failing)(asio::use_awaitable);
    } catch (...) {
      expect(is_domain_error(std::current_exception()), "deferred: CallError type");
    }
  }, asio::detached);
  ioc.run();
  return failures == 0 ? 0 : 1;
}
