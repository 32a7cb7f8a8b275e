// parent_child: a parent forks 4 children, calls each, and prints the results.
//
// Each child exposes two typed functions: `square` and `whoami`. The parent
// calls both on every child concurrently (futures), once more from a
// coroutine on its own io_context, shows that a remote exception arrives as
// CallError with the remote type, and ends the children: each Child sends
// SHUTDOWN when it goes, waits for the exit and reaps it.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <future>
#include <stdexcept>
#include <string>
#include <vector>

#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/io_context.hpp>
#include <asio/use_awaitable.hpp>

#include <spindle/asio.h>
#include <spindle/spindle.h>

namespace {

struct WhoAmI {
  std::uint32_t context = 0;
  int pid = 0;
  std::uint32_t parent = 0;
  MSGPACK_DEFINE_MAP(context, pid, parent)
};

inline constexpr spindle::method<long(long)> square{"square"};
inline constexpr spindle::method<WhoAmI()> whoami{"whoami"};
inline constexpr spindle::method<long(std::string)> parse{"parse"};

int child_main(spindle::ChildEnv& env) {
  env.expose(square, [](long n) { return n * n; });
  env.expose(whoami, [&env] {
    return WhoAmI{env.id(), static_cast<int>(::getpid()), env.parent().id()};
  });
  env.expose(parse, [](std::string s) { return std::stol(s); });  // throws on bad input
  return env.serve();
}

asio::awaitable<void> sum_of_squares(std::vector<spindle::Child>& children) {
  long sum = 0;
  for (auto& c : children) sum += co_await c.async_call(square, static_cast<long>(c.id()), asio::use_awaitable);
  std::printf("sum of the squares of the children's ids, from a coroutine: %ld\n", sum);
}

int run() {
  spindle::Runtime rt({.name = "parent"});
  std::vector<spindle::Child> children;
  for (int i = 0; i < 4; ++i) children.push_back(rt.fork_child(child_main, {.name = "worker-" + std::to_string(i)}));

  std::vector<std::future<long>> squares;
  for (std::size_t i = 0; i < children.size(); ++i) squares.push_back(children[i].call_async(square, 7 + i));
  for (std::size_t i = 0; i < children.size(); ++i) {
    WhoAmI w = children[i].call(whoami);
    std::printf("%-9s context %u pid %d parent %u  square(%zu) = %ld\n", children[i].name().c_str(), w.context,
                w.pid, w.parent, 7 + i, squares[i].get());
  }

  asio::io_context ioc{1};
  asio::co_spawn(ioc, sum_of_squares(children), asio::detached);
  ioc.run();

  try {
    children[0].call(parse, "not a number");
  } catch (const spindle::CallError& e) {
    std::printf("remote exception arrived as CallError: type %s, message %s\n", e.type().c_str(),
                e.message().c_str());
  }
  int failures = 0;
  for (auto& c : children) {
    int st = c.stop();  // SHUTDOWN, wait, reap (as ~Child would)
    bool clean = WIFEXITED(st) && WEXITSTATUS(st) == 0;
    std::printf("%s (pid %d): %s\n", c.name().c_str(), c.pid(), clean ? "exited cleanly" : "did not exit cleanly");
    if (!clean) ++failures;
  }
  return failures == 0 ? 0 : 1;
}

}  // namespace

int main() {
  try {
    return run();
  } catch (const std::exception& e) {  // a child that died or never came up
    std::fprintf(stderr, "parent_child: %s\n", e.what());
    return 1;
  }
}
