// The forks-scaling scenario, shared by tests/test_forks_scaling.cpp and
// bench/forks.cpp: N freshly forked workers, released together, each connect
// to a real spindle-router, make K calls to its ping service, send one call
// to a sibling and answer one, then exit.
//
// Workers learn their sibling through a coordinator (this process, itself a
// client): each says hello, and once all N have, each is told the id of the
// next. Workers are forked before this process starts any thread, and report
// through their exit status and one line each on a shared pipe (a line is
// shorter than PIPE_BUF, so lines never interleave).
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "broker/errors.h"
#include "broker/log.h"
#include "broker/process.h"
#include "router/connect.h"
#include "router/control.h"
#include "services/builtin.h"
#include "services/client.h"
#include "tests/process_util.h"

namespace spindle::scaling {

struct Options {
  std::string socket;
  int workers = 16;
  int calls = 4;           // K: ping calls per worker
  int silent = 0;          // raw connections that never say a word
  bool burst = true;       // false: one worker at a time
  std::chrono::seconds guard{180};  // hang guard for the whole run
};

struct Result {
  int failures = 0;
  std::vector<std::string> errors;   // one line per failed worker
  double wall_ms = 0;                // release to last exit
  double slowest_ms = 0;             // the slowest worker, release to done
  double raw_fork_exit_ms = 0;       // fork()+_exit()+waitpid of N, same machine, same run
  int silent_dropped = 0;            // silent connections the router closed
};

// run(o) runs one scenario against the router at o.socket. It must be called
// while this process has no other threads (workers are forked first).

namespace detail {

using Clock = std::chrono::steady_clock;
constexpr std::uint32_t kHello = 2100;    // worker -> coordinator: "my index"
constexpr std::uint32_t kSibling = 2101;  // anyone -> a worker or the coordinator

struct Release {
  std::uint32_t coordinator = 0;
  std::int64_t released_ns = 0;  // steady_clock (CLOCK_MONOTONIC): system-wide
};

inline std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

inline void report(int fd, const std::string& line) {
  std::string l = line.substr(0, 200) + "\n";
  ssize_t r = ::write(fd, l.data(), l.size());
  (void)r;  // nothing better to do in a dying worker
}

// The worker's whole life after fork(). Never returns.
[[noreturn]] inline void worker(int index, const Options& o, int release_fd, int report_fd) {
  Release rel;
  if (::read(release_fd, &rel, sizeof rel) != static_cast<ssize_t>(sizeof rel)) ::_exit(3);
  std::string stage = "connect";
  try {
    log().set_level(spdlog::level::warn);
    std::mutex mu;
    std::condition_variable cv;
    int received = 0;
    RouterOptions ro;
    ro.name = fmt::format("worker-{}", index);
    Connection conn(ro);
    Router& r = conn.router();
    r.add_handler(
        [&](Message&& m) {
          r.reply(m, Payload::copy_of("ack:" + m.text()));
          std::lock_guard lk(mu);
          ++received;
          cv.notify_all();
        },
        {}, kSibling);
    conn.connect(UnixAddress::parse(o.socket));
    stage = "ping";
    for (int k = 0; k < o.calls; ++k) {
      std::string text = fmt::format("w{}-{}", index, k);
      std::string back = services::call_text(conn.router_context(), services::kPingService,
                                             services::kPingMethod, text, std::chrono::seconds(60));
      if (back != text) throw Error(fmt::format("ping answered '{}' to '{}'", back, text));
    }
    stage = "hello";
    Context coordinator = conn.context(rel.coordinator, "coordinator");
    auto sibling_id = parse_context_id(coordinator.call(kHello, std::to_string(index), std::chrono::seconds(120)));
    if (!sibling_id) throw Error("the coordinator's answer is not a context id");
    stage = "sibling";
    std::string msg = fmt::format("from {}", index);
    std::string ack = conn.context(*sibling_id).call(kSibling, msg, std::chrono::seconds(60));
    if (ack != "ack:" + msg) throw Error(fmt::format("sibling answered '{}'", ack));
    stage = "receive";
    {
      std::unique_lock lk(mu);
      if (!cv.wait_for(lk, std::chrono::seconds(60), [&] { return received > 0; }))
        throw Error("no sibling message arrived");
    }
    conn.close();
    report(report_fd, fmt::format("ok {} {}", index, (now_ns() - rel.released_ns) / 1000));
    ::_exit(0);
  } catch (const std::exception& e) {
    report(report_fd, fmt::format("fail {} {}: {}", index, stage, e.what()));
    ::_exit(1);
  }
}

// The coordinator's side: hellos are answered with each worker's sibling.
class Coordinator {
 public:
  explicit Coordinator(const Options& o) : o_(o), conn_(coordinator_options()) {
    Router& r = conn_.router();
    r.add_handler([&r](Message&& m) { r.reply(m, Payload::copy_of("ack:" + m.text())); }, {}, kSibling);
    r.add_handler([this](Message&& m) { on_hello(std::move(m)); }, {}, kHello);
    conn_.connect(UnixAddress::parse(o.socket));
  }
  // The broker thread runs on_hello(): stop it before hellos_ goes away.
  ~Coordinator() { conn_.close(); }
  std::uint32_t id() const { return conn_.id(); }
  Connection& connection() { return conn_; }

 private:
  static RouterOptions coordinator_options() {
    RouterOptions ro;
    ro.name = "coordinator";
    return ro;
  }
  // Broker thread.
  void on_hello(Message&& m) {
    Router& r = conn_.router();
    if (!o_.burst) {  // the coordinator is the sibling, and sends the worker its one message
      r.reply(m, Payload::copy_of(std::to_string(id())));
      r.route(Message::make(m.header.src_id, kSibling, Payload::copy_of("from coordinator")));
      return;
    }
    auto index = parse_context_id(m.text());
    if (!index || *index >= static_cast<std::uint32_t>(o_.workers)) return r.reply(m, Payload::copy_of("bad index"));
    if (hellos_.empty()) hellos_.resize(static_cast<std::size_t>(o_.workers));
    hellos_[*index] = std::move(m);
    if (++arrived_ < o_.workers) return;
    for (std::size_t i = 0; i < hellos_.size(); ++i) {
      std::uint32_t next = hellos_[(i + 1) % hellos_.size()].header.src_id;
      r.reply(hellos_[i], Payload::copy_of(std::to_string(next)));
    }
  }

  const Options& o_;
  Connection conn_;
  std::vector<Message> hellos_;  // broker thread
  int arrived_ = 0;
};

inline double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// N × fork() + _exit() + waitpid(); with `thread`, each child first starts
// and joins one thread that does nothing (what a thread of its own costs a
// freshly forked process, before it sends a byte: bench_forks prints it).
inline double raw_fork_exit_ms(int n, bool thread = false) {
  auto t0 = Clock::now();
  std::vector<pid_t> pids;
  for (int i = 0; i < n; ++i) {
    pid_t p = ::fork();
    if (p == 0) {
      if (thread) std::thread([] {}).join();
      ::_exit(0);
    }
    if (p > 0) pids.push_back(p);
  }
  for (pid_t p : pids) ::waitpid(p, nullptr, 0);
  return ms_since(t0);
}

}  // namespace detail

inline Result run(const Options& o) {
  using namespace detail;
  Result res;
  res.raw_fork_exit_ms = raw_fork_exit_ms(o.workers);
  int release[2], reports[2];
  if (::pipe2(release, O_CLOEXEC) != 0 || ::pipe2(reports, O_CLOEXEC) != 0)
    throw Error(fmt::format("pipe2: {}", errno_text(errno)));
  // Every failure line must fit, or failing workers would block on a full pipe.
  ::fcntl(reports[0], F_SETPIPE_SZ, 1 << 20);
  std::vector<pid_t> pids;
  for (int i = 0; i < o.workers; ++i) {
    pid_t p = ::fork();
    if (p < 0) throw Error(fmt::format("fork: {}", errno_text(errno)));
    if (p == 0) {
      ::close(release[1]);
      ::close(reports[0]);
      worker(i, o, release[0], reports[1]);
    }
    pids.push_back(p);
  }
  ::close(release[0]);
  ::close(reports[1]);
  std::vector<int> silent;
  for (int i = 0; i < o.silent; ++i) silent.push_back(connect_unix(UnixAddress::parse(o.socket)));

  // Hang guard: kills the workers if the run outlives it.
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::thread watchdog([&] {
    std::unique_lock lk(mu);
    if (!cv.wait_for(lk, o.guard, [&] { return done; }))
      for (pid_t p : pids) ::kill(p, SIGKILL);
  });
  std::vector<pid_t> workers = pids;
  std::sort(workers.begin(), workers.end());
  {
    Coordinator coord(o);
    auto t0 = Clock::now();
    auto release_one = [&] {
      Release rel{coord.id(), now_ns()};
      if (::write(release[1], &rel, sizeof rel) != static_cast<ssize_t>(sizeof rel))
        throw Error("cannot release a worker");
    };
    int released = 0;
    if (o.burst)
      for (; released < o.workers; ++released) release_one();
    // Reaps any child, as a worker released one at a time may be any of
    // them, but counts only workers: the caller's other children (the
    // spindle-router, a zygote) are not workers, and one that exits during
    // the run is an error of the run, named, not a worker's exit.
    for (int reaped = 0; reaped < o.workers;) {
      if (!o.burst && reaped == released) {
        release_one();
        ++released;
      }
      int st = 0;
      pid_t p = ::waitpid(-1, &st, 0);
      if (p < 0) {
        if (errno == EINTR) continue;
        res.errors.push_back(fmt::format("waitpid: {}", errno_text(errno)));  // ECHILD: none left
        break;
      }
      if (!std::binary_search(workers.begin(), workers.end(), p)) {
        res.errors.push_back(fmt::format("pid {}, not a worker, exited during the run: {}", p,
                                         describe_wait_status(st)));
        continue;
      }
      ++reaped;
      if (!(WIFEXITED(st) && WEXITSTATUS(st) == 0)) ++res.failures;
    }
    res.wall_ms = ms_since(t0);
  }
  {
    std::lock_guard lk(mu);
    done = true;
  }
  cv.notify_all();
  watchdog.join();
  ::close(release[1]);
  std::string lines;
  char buf[65536];
  for (ssize_t n; (n = ::read(reports[0], buf, sizeof buf)) > 0;) lines.append(buf, static_cast<std::size_t>(n));
  ::close(reports[0]);
  std::size_t pos = 0;
  for (std::size_t nl; (nl = lines.find('\n', pos)) != std::string::npos; pos = nl + 1) {
    std::string line = lines.substr(pos, nl - pos);
    if (line.rfind("ok ", 0) == 0) {
      double us = std::strtod(line.substr(line.rfind(' ') + 1).c_str(), nullptr);
      res.slowest_ms = std::max(res.slowest_ms, us / 1000.0);
    } else {
      res.errors.push_back(line);
    }
  }
  for (int fd : silent) {
    if (testutil::closed_by_peer(fd, std::chrono::seconds(60))) ++res.silent_dropped;
    ::close(fd);
  }
  return res;
}

}  // namespace spindle::scaling
