#include "router/log_forward.h"

#include <unistd.h>

#include <string>

#include <spdlog/pattern_formatter.h>

#include "broker/errors.h"
#include "broker/log.h"

namespace spindle {
namespace {
thread_local bool t_in_forward = false;

void write_all(const char* p, std::size_t left) {
  while (left > 0) {
    ssize_t n = ::write(STDERR_FILENO, p, left);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // nowhere left to report to
    p += n;
    left -= static_cast<std::size_t>(n);
  }
}
}  // namespace

int python_levelno(spdlog::level::level_enum level) {
  switch (level) {
    case spdlog::level::trace: return 5;
    case spdlog::level::debug: return 10;
    case spdlog::level::info: return 20;
    case spdlog::level::warn: return 30;
    case spdlog::level::err: return 40;
    default: return 50;
  }
}

ForwardLogSink::ForwardLogSink(Router& router)
    : router_(router), formatter_(make_log_formatter()) {}

void ForwardLogSink::set_pattern(const std::string& pattern) {
  std::lock_guard lk(fmt_mu_);
  formatter_ = std::make_unique<spdlog::pattern_formatter>(pattern);
}

void ForwardLogSink::set_formatter(std::unique_ptr<spdlog::formatter> f) {
  std::lock_guard lk(fmt_mu_);
  formatter_ = std::move(f);
}

void ForwardLogSink::write_stderr(const spdlog::details::log_msg& msg, const std::string& note) {
  std::lock_guard lk(fmt_mu_);
  spdlog::memory_buf_t buf;
  formatter_->format(msg, buf);
  write_all(buf.data(), buf.size());
  write_all(note.data(), note.size());
}

void ForwardLogSink::log(const spdlog::details::log_msg& msg) {
  auto parent = router_.parent_id();
  if (t_in_forward || !parent || !router_.parent_connected()) return write_stderr(msg, {});
  std::string body(msg.logger_name.data(), msg.logger_name.size());
  body.push_back('\0');
  body += std::to_string(python_levelno(msg.level));
  body.push_back('\0');
  body.append(msg.payload.data(), msg.payload.size());
  t_in_forward = true;
  std::string note;
  try {
    router_.send(Message::make(*parent, kHandleForwardLog, Payload::copy_of(body), kEncMitogen),
                 std::chrono::milliseconds(100));
  } catch (const std::exception& e) {
    note = std::string("[log line not forwarded to the parent: ") + e.what() + "]\n";
  }
  t_in_forward = false;
  if (!note.empty()) write_stderr(msg, note);
}

}  // namespace spindle
