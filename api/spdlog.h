// <spindle/spdlog.h>: Spindle's log records into your spdlog logger (opt-in).
//
//   auto logger = spdlog::stdout_color_mt("app");
//   spindle::log_to(logger);        // every Spindle record of this process
//   ...
//   spindle::reset_log_handler();   // back to stderr (<spindle/log.h>)
//
// Role: an inline adapter over the spdlog-free seam of <spindle/log.h>; the
// library itself is not rebuilt against your spdlog, so any spdlog with
// logger::log(time_point, source_loc, level, string_view) works. Each record
// becomes one call of that function on `logger`, with Spindle's level and
// time, and its text prefixed by the context that logged it:
//   "ctx=0 connected to ..."   or   "ctx=3(worker) ...".
// Your logger's own level and sinks apply on top of Spindle's level
// (spindle::set_log_level, default info): a record must pass both.
//
// Threads: as <spindle/log.h>: records arrive on Spindle's log-writer
// thread, never the broker thread, so use a thread-safe logger (the *_mt
// sinks, or an async logger). Ownership: Spindle holds `logger` (a
// shared_ptr) until the handler is replaced or reset.
// Requires spdlog (find_package(spindle COMPONENTS spdlog) gives the
// spindle::spdlog target).
#pragma once

#include <memory>
#include <string>
#include <utility>

#include <spdlog/logger.h>

#include <spindle/log.h>

namespace spindle {

inline spdlog::level::level_enum to_spdlog_level(LogLevel level) {
  switch (level) {
    case LogLevel::trace: return spdlog::level::trace;
    case LogLevel::debug: return spdlog::level::debug;
    case LogLevel::info: return spdlog::level::info;
    case LogLevel::warn: return spdlog::level::warn;
    case LogLevel::error: return spdlog::level::err;
    case LogLevel::critical: return spdlog::level::critical;
    case LogLevel::off: break;
  }
  return spdlog::level::off;
}

// Routes Spindle's records into `logger`; a null logger resets to stderr.
inline void log_to(std::shared_ptr<spdlog::logger> logger) {
  if (!logger) return reset_log_handler();
  set_log_handler([logger = std::move(logger)](const LogRecord& r) {
    const auto level = to_spdlog_level(r.level);
    if (!logger->should_log(level)) return;  // spare the formatting below
    std::string line;
    line.reserve(r.logger.size() + 1 + r.text.size());
    line.append(r.logger).append(" ").append(r.text);
    logger->log(r.time, spdlog::source_loc{}, level, spdlog::string_view_t(line.data(), line.size()));
  });
}

}  // namespace spindle
