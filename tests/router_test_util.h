// Helpers shared by the router and RPC tests (real forked children).
#pragma once

#include <sys/wait.h>

#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <typeinfo>
#include <vector>
#include <cstdint>
#include <string>
#include <string_view>

#include <gtest/gtest.h>
#include <spdlog/sinks/base_sink.h>

#include "broker/log.h"
#include "router/child.h"
#include "router/router.h"

namespace spindle::testutil {

inline bool contains(const std::string& hay, std::string_view needle) {
  return hay.find(needle) != std::string::npos;
}

// Runs `fn`, expecting it to throw E; returns what().
template <typename E, typename F>
inline std::string expect_throw(F&& fn) {
  try {
    fn();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected " << typeid(E).name() << ", got " << typeid(e).name() << ": "
                  << e.what();
    return {};
  }
  ADD_FAILURE() << "expected an exception, none was thrown";
  return {};
}

inline ChildOptions named(std::string name) {
  ChildOptions o;
  o.name = std::move(name);
  return o;
}

inline RouterOptions root_opts(std::string name = "root") {
  RouterOptions o;
  o.name = std::move(name);
  return o;
}

// Waits for a child and checks it exited with `code`.
inline void expect_exit_code(const Context& c, int code) {
  auto st = c.wait_exit(std::chrono::seconds(10));
  ASSERT_TRUE(st.has_value()) << c.name() << " did not exit";
  EXPECT_TRUE(WIFEXITED(*st) && WEXITSTATUS(*st) == code)
      << c.name() << ": " << describe_wait_status(*st) << ", expected exit status " << code;
}

// Handlers run on the broker thread and must not block. A test handler that
// needs a blocking call hands it to a thread of its own here; join_all()
// (also run by the destructor) waits for every one, including any started
// while it waits.
class OffBrokerThreads {
 public:
  ~OffBrokerThreads() { join_all(); }
  void run(std::function<void()> fn) {
    std::lock_guard lk(mu_);
    threads_.emplace_back(std::move(fn));
  }
  void join_all() {
    for (;;) {
      std::vector<std::thread> ws;
      {
        std::lock_guard lk(mu_);
        ws.swap(threads_);
      }
      if (ws.empty()) return;
      for (auto& t : ws) t.join();
    }
  }

 private:
  std::mutex mu_;
  std::vector<std::thread> threads_;
};

// Collects formatted log lines in memory (install with set_log_sinks({sink})).
class CaptureSink final : public spdlog::sinks::base_sink<std::mutex> {
 public:
  bool wait_for_line(std::string_view needle, std::chrono::milliseconds timeout, std::string* line,
                     spdlog::level::level_enum* level) {
    std::unique_lock lk(mu_);
    bool found = cv_.wait_for(lk, timeout, [&] {
      for (std::size_t i = 0; i < lines_.size(); ++i)
        if (lines_[i].find(needle) != std::string::npos) {
          *line = lines_[i];
          *level = levels_[i];
          return true;
        }
      return false;
    });
    return found;
  }
  // The lines captured so far that contain `needle`.
  std::vector<std::string> lines_with(std::string_view needle) {
    std::lock_guard lk(mu_);
    std::vector<std::string> out;
    for (const std::string& l : lines_)
      if (l.find(needle) != std::string::npos) out.push_back(l);
    return out;
  }

 protected:
  void sink_it_(const spdlog::details::log_msg& msg) override {
    spdlog::memory_buf_t buf;
    formatter_->format(msg, buf);
    {
      std::lock_guard lk(mu_);
      lines_.emplace_back(buf.data(), buf.size());
      levels_.push_back(msg.level);
    }
    cv_.notify_all();
  }
  void flush_() override {}

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::string> lines_;
  std::vector<spdlog::level::level_enum> levels_;
};

// Routes this process's log lines into a CaptureSink while it lives.
class ScopedLogCapture {
 public:
  ScopedLogCapture() { set_log_sinks({sink_}); }
  ~ScopedLogCapture() { set_log_sinks({}); }
  CaptureSink& sink() { return *sink_; }

 private:
  std::shared_ptr<CaptureSink> sink_ = std::make_shared<CaptureSink>();
};

}  // namespace spindle::testutil
