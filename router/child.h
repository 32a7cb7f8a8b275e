// Children: starting child contexts and running inside one.
//
// fork_child(): the parent makes a CLOEXEC socketpair and forks, with its
// broker thread parked for the instant of the fork (so that thread holds no
// lock the child could inherit locked). The child
// closes the parent's fds as ChildOptions::fds says (by default the ones
// Spindle opened: broker/fd_registry.h), replaces the logger it inherited
// (whose locks another parent thread may hold), builds a fresh Broker and
// Router, completes the handshake with its parent and runs the user's main.
// No parent thread exists in the child, and nothing of the parent's broker is
// touched there. When main returns, the child shuts down gracefully (its
// queued messages are flushed) and _exit()s with main's return value.
//
// spawn_child(): for parents that have threads and want a clean exec, the
// program is started with posix_spawn and handed its end of the link, either
// a socket on fd 3 or its stdin/stdout (a pipe pair). It holds no other fd of
// the parent's but stdin, stdout and stderr (closefrom in the spawn). The program calls
// run_spawned_child() from main().
//
// In both cases the parent holds a Context; the child's pid is watched with a
// pidfd, reaped by the broker, and its exit status logged. The child's log
// lines travel to the parent over FORWARD_LOG, tagged with its name.
//
// Thread safety: fork_child() and spawn_child() may be called from any thread
// except the broker's (they allocate an id, which may ask the root).
#pragma once

#include <string>
#include <vector>

#include "router/router.h"
#include "spindle/child.h"
#include "spindle/runtime.h"

namespace spindle {

Context fork_child(Router& parent, ChildMain main, ChildOptions opts = {});
Context spawn_child(Router& parent, const std::string& program,
                    const std::vector<std::string>& args, ChildOptions opts = {});

}  // namespace spindle
