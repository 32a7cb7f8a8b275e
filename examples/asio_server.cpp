// asio_server: Spindle hosted inside a program that already runs its own
// Asio loop.
//
// A line-based TCP server on 127.0.0.1 (an ephemeral port) answers each
// number it reads with its square, computed by a forked child. Spindle runs
// on the server's own io_context (spindle::hosted_runtime): there is one
// thread, the server's, and no broker thread beside it. Each connection is a
// coroutine on that loop, which awaits the child with
// `co_await child.async_call(square, n, asio::use_awaitable)`. To be
// self-checking, the example then connects to itself, sends three numbers,
// checks the three answers, shuts Spindle down (`co_await
// rt.async_shutdown(...)`), closes its acceptor, and run() returns: exit 0.
#include <cstdio>
#include <string>

#include <optional>

#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/io_context.hpp>
#include <asio/ip/tcp.hpp>
#include <asio/read_until.hpp>
#include <asio/streambuf.hpp>
#include <asio/use_awaitable.hpp>
#include <asio/write.hpp>

#include <spindle/asio.h>
#include <spindle/spindle.h>

namespace {

using asio::ip::tcp;

inline constexpr spindle::method<long(long)> square{"square"};

int child_main(spindle::ChildEnv& env) {
  env.expose(square, [](long n) { return n * n; });
  return env.serve();
}

// One connection: a number per line in, its square per line out.
asio::awaitable<void> serve_connection(tcp::socket socket, spindle::Context child) {
  asio::streambuf in;
  try {
    for (;;) {
      std::size_t n = co_await asio::async_read_until(socket, in, '\n', asio::use_awaitable);
      std::string line(asio::buffers_begin(in.data()), asio::buffers_begin(in.data()) + n);
      in.consume(n);
      std::string out;
      try {
        long r = co_await child.async_call(square, std::stol(line), asio::use_awaitable);
        out = std::to_string(r) + "\n";
      } catch (const std::exception& e) {
        out = std::string("error: ") + e.what() + "\n";
      }
      co_await asio::async_write(socket, asio::buffer(out), asio::use_awaitable);
    }
  } catch (const std::system_error&) {
    // the client hung up
  }
}

asio::awaitable<void> accept_loop(tcp::acceptor& acceptor, spindle::Context child) {
  for (;;) {
    tcp::socket s = co_await acceptor.async_accept(asio::use_awaitable);
    asio::co_spawn(acceptor.get_executor(), serve_connection(std::move(s), child), asio::detached);
  }
}

// The self-check: three numbers through the server, then an orderly end.
asio::awaitable<void> client(tcp::acceptor& acceptor, int& failures, spindle::Runtime& rt) {
  tcp::socket s(acceptor.get_executor());
  tcp::endpoint at = acceptor.local_endpoint();
  co_await s.async_connect(at, asio::use_awaitable);
  asio::streambuf in;
  for (long n : {3L, 12L, 40000L}) {
    std::string req = std::to_string(n) + "\n";
    co_await asio::async_write(s, asio::buffer(req), asio::use_awaitable);
    std::size_t k = co_await asio::async_read_until(s, in, '\n', asio::use_awaitable);
    std::string line(asio::buffers_begin(in.data()), asio::buffers_begin(in.data()) + k - 1);
    in.consume(k);
    std::printf("client: %ld -> %s\n", n, line.c_str());
    if (line != std::to_string(n * n)) ++failures;
  }
  co_await rt.async_shutdown(asio::use_awaitable);  // the child is told, and exits
  acceptor.close();  // the last work on the loop: run() returns
}

}  // namespace

int main() {
  asio::io_context ioc{1};
  // Made on the thread that runs ioc below: that thread is Spindle's loop.
  spindle::Runtime rt = spindle::hosted_runtime(ioc);
  spindle::Child child = rt.fork_child(child_main, {.name = "squarer"});

  tcp::acceptor acceptor(ioc, tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0));
  std::printf("serving on %s:%u\n", acceptor.local_endpoint().address().to_string().c_str(),
              acceptor.local_endpoint().port());
  int failures = 0;
  asio::co_spawn(ioc, accept_loop(acceptor, child), asio::detached);
  asio::co_spawn(ioc, client(acceptor, failures, rt), asio::detached);
  ioc.run();
  std::optional<int> status = child.wait_exit();
  std::printf("child exited: %s\n", status && *status == 0 ? "cleanly" : "not cleanly");
  return failures == 0 && status && *status == 0 ? 0 : 1;
}
