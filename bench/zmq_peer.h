// The peer for bench_router: ZeroMQ's own broker, zmq_proxy between a
// ROUTER frontend and a DEALER backend on a thread of this process, over
// ipc:// (UNIX sockets, as spindle-router uses). Only built when libzmq is
// found (SPINDLE_BENCH_HAVE_ZMQ).
//
//   zmq_rtt         a REQ client -> ROUTER | proxy | DEALER -> a REP worker that
//                   sends the message back: two hops each way, as a routed call.
//   zmq_throughput  N DEALER clients send one-way to N DEALER workers through
//                   the proxy. zmq_proxy's DEALER backend hands messages to the
//                   workers round-robin (it cannot address a partner), so the
//                   figure is N senders -> N receivers, not N fixed pairs.
//
// Clients, proxy and workers each have their own zmq context (one I/O
// thread each), standing in for three processes. Every message is checked:
// its size, and (rtt) its bytes; a message lost or short fails the run.
//
// Thread safety: each function runs on the caller's thread and joins every
// thread it starts; each zmq socket is used by one thread at a time.
#pragma once

#include <zmq.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <future>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace spindle::bench {

inline constexpr const char* kErrZmqShort = "zmq: a message of the wrong size arrived";
inline constexpr const char* kErrZmqEcho = "zmq: the echo came back wrong";
inline constexpr const char* kErrZmqTimeout = "zmq: not every message arrived within 120 s";

[[noreturn]] inline void zmq_fail(const std::string& what) {
  throw std::runtime_error(what + ": " + zmq_strerror(zmq_errno()));
}

inline void* zmq_socket_of(void* ctx, int type) {
  void* s = zmq_socket(ctx, type);
  if (!s) zmq_fail("zmq_socket");
  int zero = 0;
  if (zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof zero) != 0) zmq_fail("ZMQ_LINGER");
  return s;
}

// zmq_proxy(ROUTER frontend, DEALER backend) on its own thread until destroyed.
class ZmqProxy {
 public:
  explicit ZmqProxy(const std::string& dir)
      : front_("ipc://" + dir + "/zmq-front"), back_("ipc://" + dir + "/zmq-back") {
    ctx_ = zmq_ctx_new();
    if (!ctx_) zmq_fail("zmq_ctx_new");
    std::promise<void> bound;
    auto ready = bound.get_future();
    thread_ = std::thread([this, &bound] {
      void* f = zmq_socket_of(ctx_, ZMQ_ROUTER);
      void* b = zmq_socket_of(ctx_, ZMQ_DEALER);
      if (zmq_bind(f, front_.c_str()) != 0 || zmq_bind(b, back_.c_str()) != 0) {
        bound.set_exception(std::make_exception_ptr(std::runtime_error(
            std::string("zmq_bind: ") + zmq_strerror(zmq_errno()))));
      } else {
        bound.set_value();
        zmq_proxy(f, b, nullptr);  // returns (ETERM) once the context is shut down
      }
      zmq_close(f);
      zmq_close(b);
    });
    try {
      ready.get();
    } catch (...) {
      thread_.join();
      zmq_ctx_term(ctx_);
      throw;
    }
  }
  ~ZmqProxy() {
    zmq_ctx_shutdown(ctx_);
    thread_.join();
    zmq_ctx_term(ctx_);
  }
  ZmqProxy(const ZmqProxy&) = delete;
  ZmqProxy& operator=(const ZmqProxy&) = delete;
  const std::string& frontend() const { return front_; }
  const std::string& backend() const { return back_; }

 private:
  std::string front_, back_;
  void* ctx_ = nullptr;
  std::thread thread_;
};

// A context whose sockets are closed, then the context terminated, at scope end.
class ZmqContext {
 public:
  ZmqContext() : ctx_(zmq_ctx_new()) {
    if (!ctx_) zmq_fail("zmq_ctx_new");
  }
  ~ZmqContext() {
    for (void* s : sockets_) zmq_close(s);
    zmq_ctx_term(ctx_);
  }
  ZmqContext(const ZmqContext&) = delete;
  ZmqContext& operator=(const ZmqContext&) = delete;
  void* connect(int type, const std::string& endpoint) {
    void* s = zmq_socket_of(ctx_, type);
    sockets_.push_back(s);
    if (zmq_connect(s, endpoint.c_str()) != 0) zmq_fail("zmq_connect " + endpoint);
    return s;
  }
  void shutdown() { zmq_ctx_shutdown(ctx_); }

 private:
  void* ctx_;
  std::vector<void*> sockets_;
};

// Round trips in us: REQ -> proxy -> REP (echo) -> proxy -> REQ.
inline std::vector<double> zmq_rtt(const ZmqProxy& proxy, std::size_t size, int warmup, int iters) {
  using Clock = std::chrono::steady_clock;
  ZmqContext clients, workers;
  void* req = clients.connect(ZMQ_REQ, proxy.frontend());
  void* rep = workers.connect(ZMQ_REP, proxy.backend());
  int timeout_ms = 10000;  // a lost echo fails the run instead of hanging it
  if (zmq_setsockopt(req, ZMQ_RCVTIMEO, &timeout_ms, sizeof timeout_ms) != 0) zmq_fail("ZMQ_RCVTIMEO");
  std::thread echo([rep] {
    zmq_msg_t m;
    zmq_msg_init(&m);
    // Until the context is shut down (ETERM).
    while (zmq_msg_recv(&m, rep, 0) >= 0)
      if (zmq_msg_send(&m, rep, 0) < 0) break;
    zmq_msg_close(&m);
  });
  std::vector<std::uint8_t> msg(size), back(size + 1);
  for (std::size_t i = 0; i < size; ++i) msg[i] = static_cast<std::uint8_t>(i * 7 + 1);
  std::vector<double> us;
  us.reserve(static_cast<std::size_t>(iters));
  std::exception_ptr error;
  try {
    for (int i = 0; i < warmup + iters; ++i) {
      auto t0 = Clock::now();
      if (zmq_send(req, msg.data(), size, 0) < 0) zmq_fail("zmq_send");
      int n = zmq_recv(req, back.data(), back.size(), 0);
      auto t1 = Clock::now();
      if (n < 0) zmq_fail("zmq_recv");
      if (static_cast<std::size_t>(n) != size || std::memcmp(back.data(), msg.data(), size) != 0)
        throw std::runtime_error(kErrZmqEcho);
      if (i >= warmup) us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    }
  } catch (...) {
    error = std::current_exception();
  }
  workers.shutdown();
  echo.join();
  if (error) std::rethrow_exception(error);
  return us;
}

// Messages per second: `clients` DEALERs send `per_client` messages each
// (from up to `threads` threads) through the proxy to `clients` DEALER
// workers, all drained by one thread with zmq_poll. Timed from the start
// until the last message has been received.
inline double zmq_throughput(const ZmqProxy& proxy, int clients, std::uint64_t per_client,
                             std::size_t size, int threads) {
  using Clock = std::chrono::steady_clock;
  ZmqContext senders_ctx, workers_ctx;
  std::vector<void*> senders, workers;
  for (int i = 0; i < clients; ++i) workers.push_back(workers_ctx.connect(ZMQ_DEALER, proxy.backend()));
  for (int i = 0; i < clients; ++i) senders.push_back(senders_ctx.connect(ZMQ_DEALER, proxy.frontend()));
  const std::uint64_t total = static_cast<std::uint64_t>(clients) * per_client;
  std::atomic<bool> failed{false};
  std::exception_ptr error;
  auto guard = [&](auto fn) {
    try {
      fn();
    } catch (...) {
      if (!failed.exchange(true)) {
        error = std::current_exception();
        senders_ctx.shutdown();  // a sender blocked at the high-water mark returns (ETERM)
        workers_ctx.shutdown();
      }
    }
  };
  Clock::time_point t1;
  const auto t0 = Clock::now();
  std::thread receiver([&] {
    guard([&] {
      std::vector<zmq_pollitem_t> items;
      for (void* w : workers) items.push_back({w, 0, ZMQ_POLLIN, 0});
      std::uint64_t got = 0;
      std::vector<std::uint8_t> buf(size + 64);
      const auto deadline = Clock::now() + std::chrono::seconds(120);
      while (got < total && !failed.load()) {
        if (Clock::now() > deadline) throw std::runtime_error(kErrZmqTimeout);
        if (zmq_poll(items.data(), static_cast<int>(items.size()), 200) < 0) zmq_fail("zmq_poll");
        for (auto& it : items) {
          if (!(it.revents & ZMQ_POLLIN)) continue;
          // Each message is [client identity, payload]: drain what is queued.
          for (;;) {
            int id = zmq_recv(it.socket, buf.data(), buf.size(), ZMQ_DONTWAIT);
            if (id < 0) {
              if (zmq_errno() == EAGAIN) break;
              zmq_fail("zmq_recv");
            }
            int n = zmq_recv(it.socket, buf.data(), buf.size(), 0);
            if (n < 0) zmq_fail("zmq_recv");
            if (static_cast<std::size_t>(n) != size) throw std::runtime_error(kErrZmqShort);
            ++got;
          }
        }
      }
      t1 = Clock::now();
    });
  });
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t)
    ts.emplace_back([&, t] {
      guard([&] {
        std::vector<std::uint8_t> msg(size, 0x5a);
        for (std::uint64_t k = 0; k < per_client && !failed.load(); ++k)
          for (int i = t; i < clients; i += threads)
            if (zmq_send(senders[static_cast<std::size_t>(i)], msg.data(), size, 0) < 0) zmq_fail("zmq_send");
      });
    });
  for (auto& t : ts) t.join();
  receiver.join();
  if (error) std::rethrow_exception(error);
  return static_cast<double>(total) / std::chrono::duration<double>(t1 - t0).count();
}

}  // namespace spindle::bench
