// The public logging seam (<spindle/log.h>) over the library's spdlog
// logger (broker/log.h) and its stderr sink, where the handler plugs in
// behind the bounded queue (broker/log_sink.h).
#include "spindle/log.h"

#include <memory>
#include <utility>

#include "broker/log.h"
#include "broker/log_sink.h"

namespace spindle {

void set_log_handler(LogHandler handler) {
  install_log_handler(handler ? std::make_shared<const LogHandler>(std::move(handler)) : nullptr);
}

void reset_log_handler() { install_log_handler(nullptr); }

void set_log_level(LogLevel level) {
  static_assert(static_cast<int>(LogLevel::off) == spdlog::level::off);
  log().set_level(static_cast<spdlog::level::level_enum>(level));
}

LogLevel log_level() { return static_cast<LogLevel>(log().level()); }

}  // namespace spindle
