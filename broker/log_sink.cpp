// The non-blocking stderr sink (see log_sink.h). The queue is a deque of
// formatted lines under one mutex held only to push or to swap the queue out;
// the writer thread sleeps on a condition variable between batches.
#include "broker/log_sink.h"

#include <pthread.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
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
    formatter_->format(msg, buf);
    if (queued_bytes_ + buf.size() > kMaxQueuedBytes) {
      ++dropped_;
      total_dropped_.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    queued_bytes_ += buf.size();
    queue_.emplace_back(buf.data(), buf.size());
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
  void hold_for_fork() {
    if (::getpid() != owner_) return;
    std::unique_lock lk(mu_);
    drained_.wait(lk, [&] { return !started_ || running_; });
    lk.release();  // unlocked by release_after_fork
  }
  void release_after_fork(pid_t forker) {
    if (forker == owner_) mu_.unlock();
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
      // not wait for a writer that does not exist.
      for (const std::string& line : queue_) write_fully(line.data(), line.size());
      queue_.clear();
      queued_bytes_ = 0;
    }
  }
  void run() {
    std::deque<std::string> batch;
    std::unique_lock lk(mu_);
    running_ = true;
    for (;;) {
      idle_ = true;
      drained_.notify_all();
      cv_.wait(lk, [&] { return !queue_.empty() || dropped_ != 0; });
      idle_ = false;
      batch.swap(queue_);
      queued_bytes_ = 0;
      const std::uint64_t dropped = std::exchange(dropped_, 0);
      std::string note;
      if (dropped) note = fmt::format("spindle: dropped {} log line(s): stderr is not keeping up\n", dropped);
      writing_ = true;
      // Outside the lock this thread only calls write(2): it allocates and
      // frees under mu_, so a fork (which holds mu_, see hold_for_fork) never
      // copies an allocator lock this thread held into the child.
      lk.unlock();
      for (const std::string& line : batch) write_fully(line.data(), line.size());
      write_fully(note.data(), note.size());
      lk.lock();
      batch.clear();
      writing_ = false;
    }
  }

  const pid_t owner_;
  std::mutex mu_;
  std::condition_variable cv_, drained_;
  std::unique_ptr<spdlog::formatter> formatter_;
  std::deque<std::string> queue_;
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

std::uint64_t stderr_lines_dropped() {
  AsyncStderrSink* s = g_sink.load(std::memory_order_acquire);
  return s && s->owner() == ::getpid() ? s->total_dropped() : 0;
}

}  // namespace spindle
