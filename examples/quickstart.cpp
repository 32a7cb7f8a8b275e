// quickstart: the program docs/GUIDE.md starts from, as issue 13 wrote it.
// A parent forks a child that exposes `square`, then calls it blocking,
// with a future, by name, and from a coroutine on its own io_context.
#include <cstdio>

#include <asio/co_spawn.hpp>
#include <asio/io_context.hpp>
#include <asio/use_awaitable.hpp>

#include <spindle/asio.h>
#include <spindle/spindle.h>

inline constexpr spindle::method<long(long)> square{"square"};

int child_main(spindle::ChildEnv& env) {
  env.expose(square, [](long n) { return n * n; });
  return env.serve();  // until the parent says SHUTDOWN
}

asio::awaitable<long> use(spindle::Child& c) {
  co_return co_await c.async_call(square, 9, asio::use_awaitable);
}

int main() {
  spindle::Runtime rt;  // its own broker thread
  spindle::Child child = rt.fork_child(child_main);
  long a = child.call(square, 7);              // 49, blocking
  long b = child.call_async(square, 3).get();  // 9, std::future<long>
  long c = child.call<long>("square", 5);      // 25, by name
  long d = 0;
  asio::io_context ioc{1};
  asio::co_spawn(ioc, use(child), [&d](std::exception_ptr, long r) { d = r; });
  ioc.run();
  std::printf("square(7) = %ld, square(3) = %ld, square(5) = %ld, square(9) = %ld\n", a, b, c, d);
  return a == 49 && b == 9 && c == 25 && d == 81 ? 0 : 1;
}  // ~Child: SHUTDOWN, grace, SIGKILL, reap
