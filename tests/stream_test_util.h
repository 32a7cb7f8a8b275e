// Shared helpers for the broker / stream tests (test_broker.cpp,
// test_stream.cpp): running code on the broker thread and waiting for it,
// a StreamListener that records events, and a blocking "far end" that writes
// and reads frames on a plain fd with a bounded wait.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <exception>
#include <fstream>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "broker/broker.h"
#include "spindle/frame.h"
#include "spindle/message.h"
#include "stream/parser.h"
#include "stream/rx_buffer.h"
#include "stream/stream.h"

namespace spindle::testutil {

using namespace std::chrono_literals;

// Failure guard for every wait in these tests (never a correctness sleep).
inline constexpr auto kGuard = std::chrono::seconds(20);

// Runs fn on the broker thread and waits (bounded) for its result. An
// exception thrown by fn is rethrown here.
template <class F>
auto run_on(Broker& broker, F&& fn) -> std::invoke_result_t<F&> {
  using R = std::invoke_result_t<F&>;
  auto prom = std::make_shared<std::promise<R>>();
  auto fut = prom->get_future();
  broker.defer([prom, &fn]() {
    try {
      if constexpr (std::is_void_v<R>) {
        fn();
        prom->set_value();
      } else {
        prom->set_value(fn());
      }
    } catch (...) {
      prom->set_exception(std::current_exception());
    }
  });
  if (fut.wait_for(kGuard) != std::future_status::ready) {
    ADD_FAILURE() << "run_on: broker did not run the function within the guard time";
    std::fprintf(stderr, "run_on: broker thread stuck; aborting test process\n");
    std::_Exit(2);
  }
  return fut.get();
}

// The kernel thread id of the calling thread: lead tests check on which
// thread the loop's work really ran.
inline pid_t gettid_now() { return static_cast<pid_t>(::syscall(SYS_gettid)); }

// Until a thread other than the own one has begun to lead `b`'s loop
// (lead_until counts it as it takes the loop), or `limit` passes.
inline void wait_for_a_lead(Broker& b, std::uint64_t leads_before,
                            std::chrono::milliseconds limit = kGuard) {
  const auto give_up = std::chrono::steady_clock::now() + limit;
  while (b.stats().caller_leads == leads_before && std::chrono::steady_clock::now() < give_up)
    std::this_thread::sleep_for(1ms);
}

// voluntary_ctxt_switches of one thread of this process: each sleep (on a
// futex, in epoll_wait) is one; a yield or a preemption is not.
inline long voluntary_switches(pid_t tid) {
  std::ifstream in("/proc/self/task/" + std::to_string(tid) + "/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("voluntary_ctxt_switches:", 0) == 0) return std::stol(line.substr(24));
  return -1;
}

// A lead_until predicate: the std::atomic<bool> it points to is set.
inline bool flag_set(const void* p) { return static_cast<const std::atomic<bool>*>(p)->load(); }

// Leads `b`'s loop until `done` or `deadline`, after making the own thread
// step aside as it does once it has woken a caller that slept on a reply
// (a sleeper settled on the loop). lead_until is retried while the own
// thread is still on its way out of the loop (it steps aside just after the
// handler that settled the sleeper), and the whole is retried if it took
// the loop back first (a slow machine: a linger passed unused).
// `before_lead` runs on this thread after each hand-over, before the lead.
template <class BeforeLead>
Broker::Lead lead_after_step_aside(Broker& b, const std::atomic<bool>& done,
                                   std::chrono::steady_clock::time_point deadline, BeforeLead before_lead) {
  const auto give_up = std::chrono::steady_clock::now() + kGuard;
  while (true) {
    b.add_sleeper();
    run_on(b, [&] { b.settle_sleeper(); });
    before_lead();
    for (int i = 0; i < 1000; ++i) {
      Broker::Lead how = b.lead_until(&flag_set, &done, deadline);
      if (how != Broker::Lead::kBusy || std::chrono::steady_clock::now() > give_up) return how;
      std::this_thread::yield();
    }
  }
}

inline Broker::Lead lead_after_step_aside(Broker& b, const std::atomic<bool>& done,
                                          std::chrono::steady_clock::time_point deadline) {
  return lead_after_step_aside(b, done, deadline, [] {});
}

// A round trip through the broker's queue: everything posted before has run.
inline void settle(Broker& broker) {
  run_on(broker, [] {});
}

// Joins the broker on a helper thread, failing (and exiting) if it hangs.
inline void join_bounded(Broker& broker, std::chrono::seconds limit = kGuard) {
  std::promise<void> done;
  auto fut = done.get_future();
  std::thread t([&] {
    broker.join();
    done.set_value();
  });
  if (fut.wait_for(limit) != std::future_status::ready) {
    std::fprintf(stderr, "join_bounded: Broker::join() did not return; aborting\n");
    std::_Exit(3);
  }
  t.join();
}

// Records every listener callback. Callbacks arrive on the broker thread; the
// test thread reads under the mutex or waits on the condition variable.
class Recorder : public StreamListener {
 public:
  void on_stream_open(Stream& s) override {
    std::lock_guard lk(mu);
    ++opened;
    peer_at_open = s.peer();
    cv.notify_all();
  }
  void on_stream_message(Stream&, Message&& m) override {
    std::lock_guard lk(mu);
    messages.push_back(std::move(m));
    if (on_message) on_message(messages.back());
    cv.notify_all();
  }
  void on_stream_batch_end(Stream&) override {
    std::lock_guard lk(mu);
    ++batch_ends;
  }
  void on_stream_invalid(Stream&, const ParseResult& r) override {
    std::lock_guard lk(mu);
    ++invalid;
    invalid_error = r.error;
    cv.notify_all();
  }
  void on_stream_closed(Stream& s, const std::string& why, Unsent left) override {
    std::lock_guard lk(mu);
    ++closed;
    reason = why;
    unsent.clear();
    for (const Header& h : left.wanting_reply) unsent.push_back(Message{h, {}});
    for (const Header& h : left.other_headers) unsent.push_back(Message{h, {}});
    for (auto& m : left.originals) unsent.push_back(std::move(*m));
    state_at_close = s.state();
    if (on_closed) on_closed();
    cv.notify_all();
  }

  template <class Pred>
  bool wait(Pred pred, std::chrono::milliseconds limit = kGuard) {
    std::unique_lock lk(mu);
    return cv.wait_for(lk, limit, [&] { return pred(); });
  }
  bool wait_messages(std::size_t n) {
    return wait([&] { return messages.size() >= n; });
  }
  bool wait_closed() {
    return wait([&] { return closed > 0; });
  }
  std::size_t message_count() {
    std::lock_guard lk(mu);
    return messages.size();
  }
  int closed_count() {
    std::lock_guard lk(mu);
    return closed;
  }
  std::string close_reason() {
    std::lock_guard lk(mu);
    return reason;
  }

  std::mutex mu;
  std::condition_variable cv;
  int opened = 0;
  int batch_ends = 0;
  int invalid = 0;
  int closed = 0;
  std::string invalid_error;
  std::string reason;
  std::vector<Message> messages;
  std::vector<Message> unsent;
  PeerInfo peer_at_open;
  StreamState state_at_close = StreamState::kOpen;
  // Optional hooks, called under mu on the broker thread.
  std::function<void(const Message&)> on_message;
  std::function<void()> on_closed;
};

// --- fds -------------------------------------------------------------------

struct FdPair {
  int a = -1, b = -1;
};

inline FdPair make_socketpair() {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
    ADD_FAILURE() << "socketpair: " << std::strerror(errno);
    return {};
  }
  return {sv[0], sv[1]};
}

// {read end, write end}
inline FdPair make_pipe() {
  int p[2];
  if (::pipe2(p, O_CLOEXEC) != 0) {
    ADD_FAILURE() << "pipe2: " << std::strerror(errno);
    return {};
  }
  return {p[0], p[1]};
}

inline void close_fd(int& fd) {
  if (fd >= 0) ::close(fd);
  fd = -1;
}

inline bool is_socket(int fd) {
  struct stat st {};
  return ::fstat(fd, &st) == 0 && S_ISSOCK(st.st_mode);
}

// Blocking write of everything (MSG_NOSIGNAL on sockets, so the test thread
// never takes a SIGPIPE itself). Returns false on error.
inline bool write_all(int fd, const std::uint8_t* p, std::size_t n) {
  const bool sock = is_socket(fd);
  while (n > 0) {
    pollfd pfd{fd, POLLOUT, 0};
    int pr = ::poll(&pfd, 1, static_cast<int>(std::chrono::milliseconds(kGuard).count()));
    if (pr == 0) {
      ADD_FAILURE() << "write_all: fd " << fd << " not writable within the guard time";
      return false;
    }
    if (pr < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    ssize_t w = sock ? ::send(fd, p, n, MSG_NOSIGNAL) : ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return false;
    }
    p += w;
    n -= static_cast<std::size_t>(w);
  }
  return true;
}
inline bool write_all(int fd, const std::vector<std::uint8_t>& v) {
  return write_all(fd, v.data(), v.size());
}

// Reads up to n bytes with a bounded wait. Returns bytes read, 0 on EOF, -1
// on error (errno set); fails the test on timeout (and returns -1).
inline ssize_t read_some(int fd, std::uint8_t* p, std::size_t n) {
  while (true) {
    pollfd pfd{fd, POLLIN, 0};
    int pr = ::poll(&pfd, 1, static_cast<int>(std::chrono::milliseconds(kGuard).count()));
    if (pr == 0) {
      ADD_FAILURE() << "read_some: fd " << fd << " not readable within the guard time";
      errno = ETIMEDOUT;
      return -1;
    }
    if (pr < 0) {
      if (errno == EINTR) continue;
      return -1;
    }
    ssize_t r = ::read(fd, p, n);
    if (r < 0 && errno == EINTR) continue;
    return r;
  }
}

inline bool read_exact(int fd, std::uint8_t* p, std::size_t n) {
  while (n > 0) {
    ssize_t r = read_some(fd, p, n);
    if (r <= 0) return false;
    p += r;
    n -= static_cast<std::size_t>(r);
  }
  return true;
}

// Encodes one frame the way a peer puts it on the wire.
inline std::vector<std::uint8_t> frame_bytes(const Header& h_in, const std::uint8_t* body,
                                             std::size_t len) {
  Header h = h_in;
  h.length = static_cast<std::uint32_t>(len);
  HeaderBytes hb = encode_header(h);
  std::vector<std::uint8_t> v(hb.begin(), hb.end());
  v.insert(v.end(), body, body + len);
  return v;
}
inline std::vector<std::uint8_t> frame_bytes(std::uint32_t handle, const std::string& body,
                                             std::uint16_t enc = kEncRaw) {
  Header h;
  h.enc = enc;
  h.dst_id = 1;
  h.src_id = 2;
  h.handle = handle;
  return frame_bytes(h, reinterpret_cast<const std::uint8_t*>(body.data()), body.size());
}

inline Message make_msg(std::uint32_t handle, const std::string& body) {
  Message m = Message::make(1, handle, Payload::copy_of(body));
  m.header.src_id = 2;
  return m;
}

// Deterministic bytes for large-message checks.
inline std::vector<std::uint8_t> pattern(std::size_t n, std::uint32_t seed) {
  std::vector<std::uint8_t> v(n);
  std::uint32_t x = seed * 2654435761u + 1;
  for (std::size_t i = 0; i < n; ++i) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    v[i] = static_cast<std::uint8_t>(x);
  }
  return v;
}

inline std::vector<std::uint8_t> payload_bytes(const Payload& p) {
  std::vector<std::uint8_t> v(p.size());
  if (!v.empty()) p.copy_to(v.data());
  return v;
}

// The far end of a stream, driven by the test thread with blocking reads: a
// FrameParser decodes what the stream wrote.
class FrameReader {
 public:
  explicit FrameReader(int fd) : fd_(fd), parser_(rx_) {}

  // The next frame; nullopt at a clean EOF (eof() true) or on error/invalid.
  std::optional<Message> next() {
    while (true) {
      Message m;
      ParseResult r = parser_.next(m);
      if (r.status == ParseStatus::kComplete) return m;
      if (r.status == ParseStatus::kInvalid) {
        ADD_FAILURE() << "FrameReader: invalid frame: " << r.error;
        return std::nullopt;
      }
      auto target = parser_.read_target();
      ssize_t n = read_some(fd_, target.data(), target.size());
      if (n == 0) {
        eof_ = true;
        partial_at_eof_ = parser_.buffered();
        return std::nullopt;
      }
      if (n < 0) {
        error_ = errno;
        return std::nullopt;
      }
      parser_.commit(static_cast<std::size_t>(n));
    }
  }
  bool eof() const { return eof_; }
  int error() const { return error_; }
  std::size_t partial_at_eof() const { return partial_at_eof_; }

 private:
  int fd_;
  RxBuffer rx_;
  FrameParser parser_;
  bool eof_ = false;
  int error_ = 0;
  std::size_t partial_at_eof_ = 0;
};

// Voluntary + involuntary context switches of one thread of this process.
inline long long ctxt_switches(pid_t tid) {
  std::ifstream f("/proc/self/task/" + std::to_string(tid) + "/status");
  std::string line;
  long long total = 0;
  int found = 0;
  while (std::getline(f, line)) {
    if (line.rfind("voluntary_ctxt_switches:", 0) == 0 ||
        line.rfind("nonvoluntary_ctxt_switches:", 0) == 0) {
      std::istringstream is(line.substr(line.find(':') + 1));
      long long v = 0;
      is >> v;
      total += v;
      ++found;
    }
  }
  return found == 2 ? total : -1;
}

// The scheduler state letter ('R', 'S', ...) of one thread of this process.
inline char thread_state(pid_t tid) {
  std::ifstream f("/proc/self/task/" + std::to_string(tid) + "/stat");
  std::string s;
  std::getline(f, s);
  auto rp = s.rfind(')');
  if (rp == std::string::npos || rp + 2 >= s.size()) return '?';
  return s[rp + 2];
}

// Waits (bounded) until a thread is asleep in the kernel ('S'): a way to know
// that a waiter has really blocked, without guessing with a sleep.
inline bool wait_until_sleeping(pid_t tid, std::chrono::milliseconds limit = kGuard) {
  auto end = std::chrono::steady_clock::now() + limit;
  int consecutive = 0;
  while (std::chrono::steady_clock::now() < end) {
    if (thread_state(tid) == 'S') {
      if (++consecutive >= 3) return true;
    } else {
      consecutive = 0;
    }
    std::this_thread::yield();
  }
  return false;
}

// Owns a broker's streams for one test: creates them on the broker thread and
// closes/releases them there before the broker goes away. Declare the
// Recorders before the harness so they outlive it.
class StreamHarness {
 public:
  StreamHarness() = default;
  explicit StreamHarness(Broker::Options o) : broker_(std::make_unique<Broker>(o)) {}
  ~StreamHarness() { teardown(); }

  Broker& broker() { return *broker_; }

  // The harness keeps the only owning reference; the raw pointer is for use
  // on the broker thread (inside on()) while the harness lives.
  Stream* make(int rfd, int wfd, StreamListener* l, StreamOptions opts = {},
               std::unique_ptr<Handshake> hs = nullptr, bool start = true) {
    auto holder = std::make_shared<std::unique_ptr<Handshake>>(std::move(hs));
    auto s = run_on(*broker_, [&] {
      auto st = Stream::create(*broker_, rfd, wfd, opts, std::move(*holder), l);
      if (start) st->start();
      return st;
    });
    streams_.push_back(s);
    return s.get();
  }

  template <class F>
  auto on(F&& fn) {
    return run_on(*broker_, std::forward<F>(fn));
  }

  // Closes every stream on the broker thread, then shuts the broker down.
  void teardown() {
    if (!broker_) return;
    if (broker_->state() != Broker::State::kStopped) {
      bool ok = false;
      auto prom = std::make_shared<std::promise<void>>();
      auto fut = prom->get_future();
      ok = broker_->try_defer([this, prom] {
        for (auto& s : streams_)
          if (s) s->close("test teardown");
        streams_.clear();
        prom->set_value();
      });
      if (ok) fut.wait_for(kGuard);
    }
    broker_->shutdown(std::chrono::milliseconds(2000));
    join_bounded(*broker_);
    streams_.clear();
    broker_.reset();
  }

 private:
  std::unique_ptr<Broker> broker_ = std::make_unique<Broker>();
  std::vector<std::shared_ptr<Stream>> streams_;
};

}  // namespace spindle::testutil
