// ForwardLogSink: an spdlog sink that sends a child's log lines to its parent
// as FORWARD_LOG messages ("name\0levelno\0message", Python logging levels),
// the way Mitogen children do. If the line cannot be sent (no parent, broker
// stopped, queue full) it is written to stderr instead, never dropped.
//
// It derives from spdlog::sinks::sink, not base_sink: sending may log (the
// router reporting on this very message), and base_sink would hold its mutex
// across that and deadlock. Here the send runs with no lock held; a log line
// raised from inside a send goes to stderr.
//
// Thread safety: any thread. Ownership: borrows the Router; remove the sink
// before the Router is destroyed.
#pragma once

#include <memory>
#include <mutex>

#include <spdlog/sinks/sink.h>

#include "router/router.h"

namespace spindle {

int python_levelno(spdlog::level::level_enum level);

class ForwardLogSink final : public spdlog::sinks::sink {
 public:
  explicit ForwardLogSink(Router& router);
  void log(const spdlog::details::log_msg& msg) override;
  void flush() override {}
  void set_pattern(const std::string& pattern) override;
  void set_formatter(std::unique_ptr<spdlog::formatter> f) override;

 private:
  void write_stderr(const spdlog::details::log_msg& msg, const std::string& note);

  Router& router_;
  std::mutex fmt_mu_;  // guards formatter_ (stderr fallback only)
  std::unique_ptr<spdlog::formatter> formatter_;
};

}  // namespace spindle
