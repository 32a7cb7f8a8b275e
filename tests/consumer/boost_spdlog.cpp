// The other two integration headers, as an installed Spindle gives them
// (find_package(spindle COMPONENTS boost_asio spdlog)): a Boost.Asio
// coroutine and use_future call a forked child, and a record from the child
// reaches the program's spdlog logger. Exit 0 when all hold.
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <utility>  // before Boost 1.74's awaitable.hpp, which uses std::exchange without it

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/use_future.hpp>
#include <spdlog/sinks/base_sink.h>
#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/spdlog.h>

#include <spindle/boost_asio.h>
#include <spindle/spdlog.h>
#include <spindle/spindle.h>

inline constexpr spindle::method<long(long)> square{"square"};

namespace {
int failures = 0;
void expect(bool ok, const char* what) {
  std::printf("%s %s\n", ok ? "ok  " : "FAIL", what);
  if (!ok) ++failures;
}

int child_main(spindle::ChildEnv& env) {
  env.expose(square, [](long n) { return n * n; });
  return env.serve();
}

boost::asio::awaitable<void> coroutine(spindle::Child& c) {
  expect(co_await c.async_call(square, 9, boost::asio::use_awaitable) == 81, "boost use_awaitable");
}

// An spdlog sink that lets main() wait for a line (the log writer thread
// writes it).
class Waiting final : public spdlog::sinks::base_sink<std::mutex> {
 public:
  bool wait_for(const std::string& needle) {
    std::unique_lock lk(mu_);
    return cv_.wait_for(lk, std::chrono::seconds(20), [&] { return text_.find(needle) != std::string::npos; });
  }

 protected:
  void sink_it_(const spdlog::details::log_msg& msg) override {
    std::lock_guard lk(mu_);
    text_.append(msg.payload.data(), msg.payload.size()).push_back('\n');
    cv_.notify_all();
  }
  void flush_() override {}

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::string text_;
};
}  // namespace

int main() {
  std::ostringstream out;
  auto waiting = std::make_shared<Waiting>();
  auto logger = std::make_shared<spdlog::logger>(
      "app", spdlog::sinks_init_list{std::make_shared<spdlog::sinks::ostream_sink_mt>(out), waiting});
  spindle::log_to(logger);
  {
    spindle::Runtime rt;
    spindle::Child child = rt.fork_child(child_main, {.name = "boost-child"});
    expect(child.async_call(square, 3, boost::asio::use_future).get() == 9, "boost use_future");
    boost::asio::io_context ioc{1};
    boost::asio::co_spawn(ioc, coroutine(child), boost::asio::detached);
    ioc.run();
    expect(waiting->wait_for("connected"), "spdlog: a Spindle record reached the logger");
  }
  spindle::reset_log_handler();  // returns once the handler is done with `out`
  expect(out.str().find("ctx=") != std::string::npos, "spdlog: records carry the context that logged");
  return failures == 0 ? 0 : 1;
}
