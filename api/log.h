// <spindle/log.h>: where Spindle's own log records go.
//
//   spindle::set_log_handler([](const spindle::LogRecord& r) { ... });
//   spindle::reset_log_handler();                 // back to stderr
//
// Role: the library's one logging seam, free of spdlog (<spindle/spdlog.h>
// adapts it to an spdlog logger). By default Spindle writes its records to
// stderr; with a handler installed, every record of this process goes to
// the handler instead (nothing to stderr: give your logger a console sink
// if you want both). That includes the lines its children forward to it
// (FORWARD_LOG): a child's records travel to its parent and reach the
// parent's handler, tagged "[ctx=<id> ... name=...]".
//
// Threads: the handler never runs on the broker thread, nor on the thread
// that logged. Records go through the stderr sink's bounded queue (1 MiB)
// and one log-writer thread per process calls the handler, one record at a
// time, in the order they were logged. A slow handler slows only that
// thread: when the queue is full, records are dropped and counted, and the
// handler then gets a warning record saying how many ("dropped N log
// line(s)"). The handler may log through Spindle or install another handler;
// an exception it throws is reported on stderr and otherwise ignored.
// A fork() waits for a handler call in progress to return, so that a child
// never inherits the handler's locks held: keep it short (a call into an
// spdlog logger is), and never wait in it for Spindle (a blocking call, a
// receive): the thread that forks may be the broker thread. A forked child does not call its parent's handler
// (its records go to the parent); set_log_handler() in a child applies only
// where the child's records are not forwarded (spawn_child'ed programs, and
// processes that are not children).
//
// Text: what a peer sent is already escaped ({:?}) and bounded before it is
// logged; the handler gets it as it is.
//
// Thread safety: all functions on any thread. When reset_log_handler() or
// set_log_handler() returns, the handler it replaced is not running and is
// never called again (unless called from inside that handler, which is
// allowed). Records logged while the handler changes go to either.
// Ownership: Spindle keeps a copy of the handler until it is replaced.
#pragma once

#include <chrono>
#include <functional>
#include <string_view>

namespace spindle {

enum class LogLevel { trace, debug, info, warn, error, critical, off };

struct LogRecord {
  LogLevel level = LogLevel::info;
  std::string_view logger;  // the context that logged: "ctx=<id>" or "ctx=<id>(name)"
  std::string_view text;    // the message, without time, level or logger name
  std::chrono::system_clock::time_point time;  // when it was logged
};
// The views in a LogRecord are valid during the handler's call only.
using LogHandler = std::function<void(const LogRecord&)>;

// Sends this process's Spindle records to `handler` instead of stderr. An
// empty handler is the same as reset_log_handler().
void set_log_handler(LogHandler handler);
// Back to the default: stderr.
void reset_log_handler();
// The least severe level Spindle logs (default: info, or SPINDLE_LOG_LEVEL).
// Records below it are never made, whatever the handler's own level.
void set_log_level(LogLevel level);
LogLevel log_level();

}  // namespace spindle
