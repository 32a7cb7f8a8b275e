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
// Fork: the writer thread does not exist in a forked child, and it is held
// out of malloc/free (which it calls only under the queue's lock) during the
// fork, so that it leaves no allocator lock held in the child. A child that logs
// before it calls reset_logging_after_fork() (which builds a new sink) writes
// its lines directly; the process id tells which case applies.
// At exit, an atexit hook gives the writer up to one second to drain.
//
// A log handler (<spindle/log.h>) plugs in behind the same queue: while one
// is installed, log() queues the record's parts (level, time, logger name,
// text) instead of a formatted line, and the writer thread hands them to the
// handler one at a time, under a delivery lock of its own that the fork
// guard takes as well (before the queue's), so a fork waits for a handler
// call in progress and the child inherits none of the handler's locks held.
// A record whose handler was removed before its turn is formatted and
// written to stderr. Dropped-line notes go to the handler as warnings.
//
// Thread safety: any thread. Ownership: the sink of each process lives until
// exit (its writer thread is detached); the shared_ptr handed out does not own it.
#pragma once

#include <spdlog/sinks/sink.h>

#include <cstdint>
#include <memory>

#include "spindle/log.h"

namespace spindle {

// This process's stderr sink (made once per process id).
std::shared_ptr<spdlog::sinks::sink> stderr_sink();

// Installs (once) the pthread_atfork handlers that keep the sink's writer
// thread out of the allocator while the process forks. stderr_sink() calls it;
// the services' fork guard calls it before installing its own, so that the
// pools are quiesced before the sink is held (prepare handlers run in reverse
// order of installation), and a worker that is logging can finish.
void install_log_fork_guard();

// How many lines the stderr sink of this process has dropped so far.
std::uint64_t stderr_lines_dropped();

// Installs `handler` (null: none, back to stderr) on this process's sink.
// Returns once the handler it replaces is no longer running (at once when
// called from inside a handler).
void install_log_handler(std::shared_ptr<const LogHandler> handler);

}  // namespace spindle
