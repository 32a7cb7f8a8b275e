// Logging: one spdlog logger for the whole process, named after the context.
//
// Every line carries "ctx=<id>" (the logger name) and the pid; stream-level
// lines add "stream=<name>". The logger is deliberately kept out of spdlog's
// global registry: after fork() the child replaces it wholesale (new sinks, new
// mutexes) instead of touching a registry whose lock another parent thread may
// have held at the moment of the fork.
//
// Thread safety: log() may be called from any thread. set_log_context() and
// set_log_sinks() are for start-up and for a freshly forked child, before any
// other thread exists.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <spdlog/logger.h>

namespace spindle {

spdlog::logger& log();

// Renames the logger to "ctx=<id>" (plus the context's name, if any).
void set_log_context(std::uint32_t context_id, const std::string& name = {});
// Replaces the sinks (e.g. with a FORWARD_LOG sink in a child). An empty list
// restores the default stderr sink.
void set_log_sinks(std::vector<spdlog::sink_ptr> sinks);
// In a freshly forked child: builds a new logger and new sinks, touching
// nothing of the inherited logger but its level.
void reset_logging_after_fork(std::uint32_t context_id, const std::string& name,
                              std::vector<spdlog::sink_ptr> sinks = {});
// Sets the level from SPINDLE_LOG_LEVEL (trace..off) if present, else `fallback`.
// The formatter every Spindle sink should use (lock-free UTC timestamps).
std::unique_ptr<spdlog::formatter> make_log_formatter();
void set_log_level_from_env(spdlog::level::level_enum fallback = spdlog::level::info);

}  // namespace spindle
