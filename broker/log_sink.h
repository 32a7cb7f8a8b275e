// StderrSink: the default log sink. It never blocks the thread that logs.
//
// A log call formats the line and appends it to a bounded in-memory queue
// (1 MiB); one writer thread per process writes the queue to stderr. When the
// queue is full the line is dropped and counted, and the writer reports the
// count in a line of its own ("dropped N log lines: stderr is not keeping
// up"), so a slow or blocked stderr (a full pipe, a stopped terminal) costs
// the broker thread nothing and loses nothing silently. Nothing is written
// under the queue's lock.
//
// Fork: the writer thread does not exist in a forked child. A child that logs
// before it calls reset_logging_after_fork() (which builds a new sink) writes
// its lines directly; the process id tells which case applies.
// At exit, an atexit hook gives the writer up to one second to drain.
//
// Thread safety: any thread. Ownership: the sink of each process lives until
// exit (its writer thread is detached); the shared_ptr handed out does not own it.
#pragma once

#include <spdlog/sinks/sink.h>

#include <cstdint>
#include <memory>

namespace spindle {

// This process's stderr sink (made once per process id).
std::shared_ptr<spdlog::sinks::sink> stderr_sink();

// How many lines the stderr sink of this process has dropped so far.
std::uint64_t stderr_lines_dropped();

}  // namespace spindle
