// The non-blocking stderr sink (see log_sink.h). The queue is a deque of
// entries (a formatted line, or a record's parts for the log handler) under
// one mutex held only to push or to swap the queue out; the writer thread
// sleeps on a condition variable between batches.
#include "broker/log_sink.h"

#include <pthread.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>

#include <fmt/format.h>
#include <spdlog/details/log_msg.h>
#include <spdlog/pattern_formatter.h>

#include "broker/errors.h"
#include "broker/log.h"

namespace spindle {
namespace {

constexpr std::size_t kMaxQueuedBytes = 1u << 20;

// Set on the writer thread while it calls the log handler: a handler that
// replaces the handler already holds the delivery lock.
thread_local bool t_delivering = false;

LogLevel public_level(spdlog::level::level_enum l) {
  switch (l) {
    case spdlog::level::trace: return LogLevel::trace;
    case spdlog::level::debug: return LogLevel::debug;
    case spdlog::level::info: return LogLevel::info;
    case spdlog::level::warn: return LogLevel::warn;
    case spdlog::level::err: return LogLevel::error;
    case spdlog::level::critical: return LogLevel::critical;
    default: return LogLevel::off;
  }
}

// One queued line: formatted for stderr (line), or, while a handler is
// installed, the record's parts (line empty) for the handler.
struct Entry {
  std::string line;
  spdlog::level::level_enum level = spdlog::level::info;
  spdlog::log_clock::time_point time;
  std::string logger, text;
};

void write_fully(const char* p, std::size_t left) {
  while (left > 0) {
    ssize_t n = ::write(STDERR_FILENO, p, left);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // nowhere to report a failure to log
    p += n;
    left -= static_cast<std::size_t>(n);
  }
}

class AsyncStderrSink final : public spdlog::sinks::sink {
 public:
  AsyncStderrSink() : owner_(::getpid()), formatter_(make_log_formatter()) {}

  void log(const spdlog::details::log_msg& msg) override {
    spdlog::memory_buf_t buf;
    if (::getpid() != owner_) {
      // A forked child that has not reset its logging: no writer thread here,
      // and mu_ may have been held by the parent's writer at the fork, so it
      // is not taken (the child has one thread until it resets its logging).
      formatter_->format(msg, buf);
      write_fully(buf.data(), buf.size());
      return;
    }
    std::unique_lock lk(mu_);
    const bool to_handler = has_handler_.load(std::memory_order_acquire);
    std::size_t size = msg.logger_name.size() + msg.payload.size();
    if (!to_handler) {
      formatter_->format(msg, buf);
      size = buf.size();
    }
    if (queued_bytes_ + size > kMaxQueuedBytes) {
      ++dropped_;
      total_dropped_.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    queued_bytes_ += size;
    Entry& e = queue_.emplace_back();
    if (to_handler) {
      e.level = msg.level;
      e.time = msg.time;
      e.logger.assign(msg.logger_name.data(), msg.logger_name.size());
      e.text.assign(msg.payload.data(), msg.payload.size());
    } else {
      e.line.assign(buf.data(), buf.size());
    }
    if (!started_) start_locked();
    if (idle_) cv_.notify_one();
  }
  void flush() override {}  // the writer drains continuously; see drain() for exit
  void set_pattern(const std::string& pattern) override {
    std::lock_guard lk(mu_);
    auto f = std::make_unique<spdlog::pattern_formatter>();
    f->set_pattern(pattern);
    formatter_ = std::move(f);
  }
  void set_formatter(std::unique_ptr<spdlog::formatter> f) override {
    std::lock_guard lk(mu_);
    formatter_ = std::move(f);
  }

  // Waits (at most `limit`) until everything queued so far is written.
  void drain(std::chrono::milliseconds limit) {
    std::unique_lock lk(mu_);
    if (!started_ || ::getpid() != owner_) return;
    drained_.wait_for(lk, limit, [&] { return queue_.empty() && !writing_; });
  }
  // pthread_atfork: the parent's writer must not be inside malloc or free
  // when the process forks. GCC 12's ASan does not reset its allocator locks
  // in the child, so a child forked while the writer thread was starting hung
  // in its first allocation. Holding mu_ across the fork keeps the writer out
  // of the allocator (once running, it only allocates under mu_).
  // A writer thread that is still starting (inside the sanitizer's or
  // glibc's thread set-up, which allocates) is waited for too.
  // A handler call in progress is waited for first (the delivery lock is
  // always taken before mu_), so the child inherits none of its locks held.
  void hold_for_fork() {
    if (::getpid() != owner_) return;
    deliver_mu_.lock();
    std::unique_lock lk(mu_);
    drained_.wait(lk, [&] { return !started_ || running_; });
    lk.release();  // unlocked by release_after_fork
  }
  void release_after_fork(pid_t forker) {
    if (forker != owner_) return;
    mu_.unlock();
    deliver_mu_.unlock();
  }
  // Replaces the handler; returns once the one replaced is not running.
  void set_handler(std::shared_ptr<const LogHandler> h) {
    std::unique_lock dl(deliver_mu_, std::defer_lock);
    if (!t_delivering) dl.lock();  // else this thread holds it, inside a handler
    has_handler_.store(h != nullptr, std::memory_order_release);
    std::shared_ptr<const LogHandler> old = std::exchange(handler_, std::move(h));
    // `old` is destroyed under the delivery lock too (it may free memory: see
    // hold_for_fork), unless it is the handler running on this thread, which
    // its caller still holds.
  }
  pid_t owner() const { return owner_; }
  std::uint64_t total_dropped() const { return total_dropped_.load(std::memory_order_relaxed); }

 private:
  void start_locked() {
    try {
      std::thread([this] { run(); }).detach();  // the sink is never freed
      started_ = true;
    } catch (const std::system_error&) {
      // No thread to be had (EAGAIN): write what is queued in place, and
      // try again with the next line. started_ stays false, so a fork does
      // not wait for a writer that does not exist. Records for the handler
      // go to stderr too: the handler never runs on the thread that logs.
      for (Entry& e : queue_) {
        if (e.line.empty()) format_locked(e);
        write_fully(e.line.data(), e.line.size());
      }
      queue_.clear();
      queued_bytes_ = 0;
    }
  }
  void run() {
    std::deque<Entry> batch;
    std::unique_lock lk(mu_);
    running_ = true;
    for (;;) {
      idle_ = true;
      drained_.notify_all();
      cv_.wait(lk, [&] { return !queue_.empty() || dropped_ != 0; });
      idle_ = false;
      batch.swap(queue_);
      queued_bytes_ = 0;
      if (const std::uint64_t dropped = std::exchange(dropped_, 0)) {
        Entry& note = batch.emplace_back();
        if (has_handler_.load(std::memory_order_acquire)) {
          note.level = spdlog::level::warn;
          note.time = spdlog::log_clock::now();
          note.logger = "spindle";
          note.text = fmt::format("dropped {} log line(s): the log handler is not keeping up", dropped);
        } else {
          note.line = fmt::format("spindle: dropped {} log line(s): stderr is not keeping up\n", dropped);
        }
      }
      writing_ = true;
      // Outside mu_ this thread only calls write(2), and the log handler
      // under deliver_mu_: it allocates and frees under one of the two, so a
      // fork (which holds both, see hold_for_fork) never copies an allocator
      // lock this thread held into the child.
      lk.unlock();
      for (Entry& e : batch) {
        if (e.line.empty()) deliver(e);
        write_fully(e.line.data(), e.line.size());
      }
      lk.lock();
      batch.clear();
      writing_ = false;
    }
  }
  // A record's parts as the line stderr would have had (under mu_).
  void format_locked(Entry& e) {
    spdlog::details::log_msg msg(e.time, spdlog::source_loc{}, e.logger, e.level, e.text);
    spdlog::memory_buf_t buf;
    formatter_->format(msg, buf);
    e.line.assign(buf.data(), buf.size());
  }
  // Hands one record to the handler. If the handler is gone since the record
  // was queued, formats it into e.line (under mu_) for stderr instead.
  void deliver(Entry& e) {
    char failed[256];
    failed[0] = '\0';
    {
      std::lock_guard dl(deliver_mu_);
      if (std::shared_ptr<const LogHandler> h = handler_) {
        LogRecord r{public_level(e.level), e.logger, e.text,
                    std::chrono::time_point_cast<std::chrono::system_clock::duration>(e.time)};
        t_delivering = true;
        try {
          (*h)(r);
        } catch (const std::exception& x) {
          std::snprintf(failed, sizeof failed, "spindle: the log handler threw (a record is lost): %s\n", x.what());
        } catch (...) {
          std::snprintf(failed, sizeof failed, "spindle: the log handler threw (a record is lost)\n");
        }
        t_delivering = false;
      } else {
        std::lock_guard lk(mu_);
        format_locked(e);
      }
    }
    write_fully(failed, std::strlen(failed));
  }

  const pid_t owner_;
  std::mutex mu_;
  std::condition_variable cv_, drained_;
  std::unique_ptr<spdlog::formatter> formatter_;
  std::deque<Entry> queue_;
  // The handler, under deliver_mu_ (taken before mu_ when both are held);
  // has_handler_ mirrors it for log(), which takes only mu_.
  std::mutex deliver_mu_;
  std::shared_ptr<const LogHandler> handler_;
  std::atomic<bool> has_handler_{false};
  std::size_t queued_bytes_ = 0;
  std::uint64_t dropped_ = 0;
  std::atomic<std::uint64_t> total_dropped_{0};
  bool started_ = false, running_ = false, idle_ = false, writing_ = false;
};

// The sink of the process that made it; never freed (a detached writer thread
// and leaked loggers use it until exit). An atomic, not a mutex: a child
// forked while another thread was here must not find a lock held forever.
std::atomic<AsyncStderrSink*> g_sink{nullptr};

// Which process the prepare handler ran in (the parent's pid, also seen by
// the child, whose getpid() differs) and the sink it held. Per thread: the
// three handlers of one fork run on the forking thread (the child's only
// one), and two threads may fork at once.
thread_local pid_t g_forker = 0;
thread_local AsyncStderrSink* g_held = nullptr;

void sink_prepare() {
  g_held = g_sink.load(std::memory_order_acquire);
  g_forker = ::getpid();
  if (g_held) g_held->hold_for_fork();
}
void sink_after_fork() {
  if (g_held) g_held->release_after_fork(g_forker);
  g_held = nullptr;
}

void drain_at_exit() {
  AsyncStderrSink* s = g_sink.load(std::memory_order_acquire);
  if (s && s->owner() == ::getpid()) s->drain(std::chrono::seconds(1));
}

}  // namespace

void install_log_fork_guard() {
  static const int rc = pthread_atfork(sink_prepare, sink_after_fork, sink_after_fork);
  if (rc != 0) {
    std::string line = fmt::format("spindle: pthread_atfork for the log sink failed: {}\n", errno_text(rc));
    write_fully(line.data(), line.size());
  }
}

std::shared_ptr<spdlog::sinks::sink> stderr_sink() {
  static std::once_flag hook;
  std::call_once(hook, [] {
    std::atexit(drain_at_exit);
    install_log_fork_guard();
  });
  AsyncStderrSink* s = g_sink.load(std::memory_order_acquire);
  while (!s || s->owner() != ::getpid()) {
    auto* mine = new AsyncStderrSink();
    if (g_sink.compare_exchange_strong(s, mine, std::memory_order_acq_rel)) {
      s = mine;
      break;
    }
    delete mine;  // another thread installed one first: s is now that one
  }
  return std::shared_ptr<spdlog::sinks::sink>(s, [](spdlog::sinks::sink*) {});
}

void install_log_handler(std::shared_ptr<const LogHandler> handler) {
  stderr_sink();  // this process's sink, made if needed
  g_sink.load(std::memory_order_acquire)->set_handler(std::move(handler));
}

std::uint64_t stderr_lines_dropped() {
  AsyncStderrSink* s = g_sink.load(std::memory_order_acquire);
  return s && s->owner() == ::getpid() ? s->total_dropped() : 0;
}

}  // namespace spindle
