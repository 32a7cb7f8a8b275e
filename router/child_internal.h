// The steps of starting a child context that fork_child(), spawn_child() and
// the zygote (router/zygote.h) share. Internal: not installed for users.
//
// Thread safety: run_forked_child() runs in the child's one thread, before
// any other exists; adopt_child() on any thread but the parent's broker
// thread.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "broker/process.h"
#include "router/child.h"

namespace spindle::detail {

// Closes every fd >= 3 except `keep`.
void close_other_fds(int keep);

// Parent side: watches the child's pid (it must be this process's child),
// routes the link, hands out a Context. Takes the link's fds.
// `on_adopted`, if set, runs on the broker thread with the new stream, before
// anything can close it (ssh sessions hang their stderr reader on it).
Context adopt_child(Router& parent, int read_fd, int write_fd, std::uint32_t id,
                    const std::string& name, pid_t pid,
                    std::function<void(Stream&)> on_adopted = {});
// The same for a process already watched with a pidfd.
Context adopt_child(Router& parent, int read_fd, int write_fd, std::uint32_t id,
                    const std::string& name, std::shared_ptr<ChildProcess> proc,
                    std::function<void(Stream&)> on_adopted = {});

// The child's life once its process exists: builds its Broker and Router,
// completes the handshake with the parent over the link, runs `main`, shuts
// down gracefully. Returns the process's exit code.
// `close_when_drained`: see StreamOptions (an agent behind ssh sets it).
int run_child(int read_fd, int write_fd, RouterOptions opts, const ChildMain& main,
              bool close_when_drained = false);

// A child whose link is its stdin and stdout: moves them to fresh CLOEXEC
// fds, points stdin at /dev/null and stdout at stderr (a stray printf cannot
// corrupt the frame stream). Throws std::system_error.
void take_stdio_link(int& read_fd, int& write_fd);

// A forked child's life: closes the parent's fds as `fds` says, replaces the logger it
// inherited, runs the child over `link` (run_child) and _exit()s with its
// code. `opts.name` is the child's name.
[[noreturn]] void run_forked_child(int link, std::uint32_t id, RouterOptions opts, const ChildMain& main,
                                   const FdPolicy& fds);

// In a forked child: closes the parent's fds as `fds` says, never `link`
// nor stdio. Allocates nothing.
void apply_fd_policy(const FdPolicy& fds, int link);

// The child's name: opts.name, or "child-<id>".
std::string child_name(std::uint32_t id, const ChildOptions& opts);

}  // namespace spindle::detail
