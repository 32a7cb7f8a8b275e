// The steps of starting a child context that fork_child(), spawn_child() and
// the zygote (router/zygote.h) share. Internal: not installed for users.
//
// Thread safety: run_child() runs in the child's one thread, before any other
// exists; adopt_child() on any thread but the parent's broker thread.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>

#include "router/child.h"

namespace spindle::detail {

// Closes every fd >= 3 except `keep`.
void close_other_fds(int keep);

// The child's life after its process exists: builds its Broker and Router,
// completes the handshake with the parent over the link, runs `main`, shuts
// down gracefully. Returns the process's exit code.
int run_child(int read_fd, int write_fd, RouterOptions opts, const ChildMain& main);

// Parent side: watches the child's pid (it must be this process's child),
// routes the link, hands out a Context. Takes the link's fds.
Context adopt_child(Router& parent, int read_fd, int write_fd, std::uint32_t id,
                    const std::string& name, pid_t pid);

// In the child, glibc hands a new thread the cached stack of a parent thread
// that did not survive the fork, so its pthread_t equals that thread's. That
// is harmless, except to ThreadSanitizer, whose copied registry still lists
// the old thread and aborts ("dup thread with used id"). Under TSan only, the
// child's threads ask for a stack size no cached stack satisfies.
void avoid_inherited_thread_stacks();

}  // namespace spindle::detail
