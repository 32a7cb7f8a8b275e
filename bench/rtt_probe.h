// Honest round trips through a spindle-router while a bench loads it
// (bench_load --hostile): two clients, A calling B's echo handler back to
// back. RttProbe runs them in the bench's own process; IsolatedRttProbe runs
// an RttProbe in a child process, in a session of its own.
//
// Why both: with the kernel's autogroup scheduling, every thread of a
// session shares one group's CPU share. The bench's session holds the 256
// load clients' broker threads, so a probe there waits behind them for the
// CPU, as a client built into the load generator would. A client process of
// its own (a service, a worker) gets its own share: what it sees is the
// router's treatment of an honest peer, which is what issue #11's p99 target
// is about. The bench prints both.
//
// Thread safety: each probe is driven by one thread. IsolatedRttProbe::fork_early()
// must run before the process starts any thread. Ownership: a probe owns its
// clients, and their thread or child process (PipedChild).
#pragma once

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <fmt/chrono.h>
#include <fmt/format.h>

#include "bench/piped_child.h"
#include "broker/errors.h"
#include "broker/log.h"
#include "router/connect.h"
#include "tests/router_probe.h"

namespace spindle::bench {

inline constexpr std::uint32_t kRttEcho = 2400;
inline constexpr std::size_t kRttSize = 64;

// A wall-clock time as the router's log writes it (UTC, milliseconds).
inline std::string utc(std::chrono::system_clock::time_point t) {
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(t.time_since_epoch()).count();
  return fmt::format("{:%H:%M:%S}.{:03}", std::chrono::floor<std::chrono::seconds>(t), ms % 1000);
}

// What an RttProbe measured.
struct RttSummary {
  std::vector<double> ms;      // every round trip, in ms
  std::uint64_t failures = 0;  // errors, timeouts, wrong bytes
  std::string first_error;
  std::string worst_at;        // when the slowest was sent, to find it in the router's log

  double max_ms() const { return ms.empty() ? 0 : *std::max_element(ms.begin(), ms.end()); }
};

// Two extra honest clients: A calls B's echo handler back to back, from its
// own thread, until stop(); every round trip is recorded, every failure
// (error, timeout, wrong bytes) counted.
class RttProbe {
 public:
  explicit RttProbe(const std::string& socket) : socket_(socket) {
    b_.router().add_handler(
        [this, &r = b_.router()](Message&& m) {
          echoed_.fetch_add(1, std::memory_order_relaxed);
          r.reply(m, std::move(m.data));
        },
        {}, kRttEcho);
    b_.connect(UnixAddress::parse(socket));
    a_.connect(UnixAddress::parse(socket));
    thread_ = std::thread([this] { loop(); });
  }
  ~RttProbe() { stop(); }
  void stop() {
    stop_.store(true);
    if (thread_.joinable()) thread_.join();
  }
  // After stop().
  RttSummary summary() const { return {ms_, failures_, first_error_, worst_at_}; }

 private:
  // The router's own stats lines and the probe clients' (each on a line of
  // its own, indented), or why they could not be had.
  std::string router_view() const {
    std::string out;
    try {
      const std::string s = testutil::router_stats_text(socket_);
      std::size_t at = 0;
      while (at < s.size()) {
        std::size_t nl = std::min(s.find('\n', at), s.size());
        std::string_view line(s.data() + at, nl - at);
        if (line.find("rtt-") != std::string_view::npos || line.starts_with("router"))
          out += fmt::format("\n    {}", line);
        at = nl + 1;
      }
    } catch (const std::exception& e) {
      out += fmt::format("\n    stats: {}", e.what());
    }
    return out;
  }

  void loop() {
    Context to_b = a_.context(b_.id());
    std::string msg(kRttSize, '\0');
    for (std::size_t i = 0; !stop_.load(); ++i) {
      for (std::size_t k = 0; k < kRttSize; ++k) msg[k] = static_cast<char>(i * 7 + k);
      auto t0 = std::chrono::steady_clock::now();
      const auto wall = std::chrono::system_clock::now();
      try {
        // Long enough that a scheduler stall shows as a slow round trip;
        // a failure is a lost or refused call.
        std::string back = to_b.call(kRttEcho, msg, std::chrono::seconds(60));
        auto t1 = std::chrono::steady_clock::now();
        if (back != msg) throw Error("echo came back changed");
        ms_.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
        if (ms_.back() > worst_ms_) {
          worst_ms_ = ms_.back();
          worst_at_ = utc(wall);
        }
      } catch (const std::exception& e) {
        // Where it stopped: had the echo side answered this call (i + 1
        // requests) or not (i: the request never reached it)?
        if (failures_++ == 0) {
          first_error_ = fmt::format("{} (sent at {} UTC; the echo side had answered {} of {} requests)",
                                     e.what(), utc(wall), echoed_.load(), i + 1);
          first_error_ += router_view();
        }
      }
    }
  }
  Connection a_{RouterOptions{.name = "rtt-caller"}}, b_{RouterOptions{.name = "rtt-echo"}};
  std::string socket_;
  std::atomic<bool> stop_{false};
  std::atomic<std::uint64_t> echoed_{0};  // requests the echo handler answered
  std::vector<double> ms_;
  std::uint64_t failures_ = 0;
  std::string first_error_;
  double worst_ms_ = -1;
  std::string worst_at_;
  std::thread thread_;
};

// An RttProbe in a child process, in a session of its own (see above).
class IsolatedRttProbe {
 public:
  // Forks the child, which waits for start(). Call before any thread exists.
  void fork_early() { child_.fork(run_child); }

  // The child connects its two clients to `socket` and starts calling.
  void start(const std::string& socket) { child_.send(socket + "\n"); }

  // Ends the round trips; what the child measured, or an Error.
  RttSummary stop() {
    if (!child_.forked()) throw Error("the isolated rtt probe was not started");
    const std::string bytes = child_.finish();  // EOF: the child stops and writes its summary
    std::string_view in(bytes);
    if (in.empty()) throw Error("the isolated rtt probe ended without its figures");
    const char status = in.front();
    in.remove_prefix(1);
    if (status != kFigures) throw Error("the isolated rtt probe failed: " + std::string(in));
    RttSummary s;
    std::uint64_t n = 0;
    if (!take(in, n) || in.size() < n * sizeof(double))
      throw Error("the isolated rtt probe's figures are cut short");
    s.ms.resize(n);
    std::memcpy(s.ms.data(), in.data(), n * sizeof(double));
    in.remove_prefix(n * sizeof(double));
    if (!take(in, s.failures) || !take(in, s.first_error) || !take(in, s.worst_at))
      throw Error("the isolated rtt probe's figures are cut short");
    return s;
  }

 private:
  // The child's output starts with one of these; an error's text follows.
  static constexpr char kFigures = 'F', kFailed = 'E';

  static bool take(std::string_view& in, std::uint64_t& v) {
    if (in.size() < sizeof v) return false;
    std::memcpy(&v, in.data(), sizeof v);
    in.remove_prefix(sizeof v);
    return true;
  }
  static bool take(std::string_view& in, std::string& s) {
    std::uint64_t n = 0;
    if (!take(in, n) || in.size() < n) return false;
    s.assign(in.data(), n);
    in.remove_prefix(n);
    return true;
  }
  static void put(std::string& out, std::uint64_t v) { out.append(reinterpret_cast<const char*>(&v), sizeof v); }
  static void put(std::string& out, const std::string& s) {
    put(out, static_cast<std::uint64_t>(s.size()));
    out += s;
  }

  [[noreturn]] static void run_child(int ctl, int out) {
    ::setsid();
    int rc = 0;
    std::string reply(1, kFigures);
    try {
      std::string socket;
      for (char c; ::read(ctl, &c, 1) == 1 && c != '\n';) socket += c;
      if (socket.empty()) ::_exit(0);  // the bench ended before start()
      log().set_level(spdlog::level::warn);  // as the bench's own clients
      RttSummary s;
      {
        RttProbe probe(socket);
        for (char c;;) {  // until EOF: the bench's stop()
          ssize_t n = ::read(ctl, &c, 1);
          if (n < 0 && errno == EINTR) continue;
          if (n <= 0) break;
        }
        probe.stop();
        s = probe.summary();
      }
      put(reply, s.ms.size());
      reply.append(reinterpret_cast<const char*>(s.ms.data()), s.ms.size() * sizeof(double));
      put(reply, s.failures);
      put(reply, s.first_error);
      put(reply, s.worst_at);
    } catch (const std::exception& e) {
      reply = std::string(1, kFailed) + e.what();
      rc = 1;
    }
    try {
      PipedChild::write_all(out, reply);
    } catch (...) {
      rc = 1;
    }
    ::_exit(rc);
  }

  PipedChild child_;
};

}  // namespace spindle::bench
