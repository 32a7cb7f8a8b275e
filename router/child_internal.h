// The steps of starting a child context that fork_child(), spawn_child() and
// the zygote (router/zygote.h) share. Internal: not installed for users.
//
// Thread safety: run_forked_child() runs in the child's one thread, before
// any other exists; adopt_child() on any thread but the parent's broker
// thread.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>

#include "router/child.h"

namespace spindle::detail {

// Closes every fd >= 3 except `keep`.
void close_other_fds(int keep);

// Parent side: watches the child's pid (it must be this process's child),
// routes the link, hands out a Context. Takes the link's fds.
Context adopt_child(Router& parent, int read_fd, int write_fd, std::uint32_t id,
                    const std::string& name, pid_t pid);

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
