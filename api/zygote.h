// Zygote: forks child contexts from a small process started early, so that
// the cost of a child does not depend on the size or the threads of the
// process that asks for it.
//
//   int worker(spindle::ChildEnv& env, std::string_view shard) { ...; return env.serve(); }
//
//   int main() {
//     auto zygote = spindle::Zygote::start();  // first: the process is still small
//     ... the process grows: a large table, a thread pool ...
//     spindle::Runtime rt;
//     spindle::Child c = zygote->fork_child(rt, worker, "shard-3");
//     c.call(...);
//   }
//
// Role: Runtime::fork_child() copies the calling process. A parent that
// holds a large heap, or runs a busy pool, pays for that at every fork (page
// tables to copy, pages to copy on write, threads to park). Zygote::start(),
// called early in main (before the heap grows and before threads exist),
// forks a helper process, the zygote, while the process is small;
// fork_child() asks it to fork the child. The child is created with
// CLONE_PARENT, so it is this process's child, not the zygote's: a Child
// like any other (watched, reaped, stopped by ~Child, its exit status ours).
//
// What the child runs is a plain function, not a closure: the child is a
// copy of the process as it was when the zygote started, so objects made
// later do not exist there. The function gets the argument bytes (at most
// kMaxArg); anything larger travels over the link once the child is up (a
// typed call, an fd argument). It must be in code loaded before start() (a
// function of a library dlopen()ed later is refused with a clear error).
//
// The zygote holds no fd of the parent but its own socket and stdin, stdout
// and stderr. It exits when its socket closes (the Zygote is destroyed, or
// the parent dies).
//
// Thread safety: start() on any thread, preferably before any other exists;
// fork_child() from any thread except the runtime's broker thread (calls are
// serialised). Ownership: a Zygote owns the zygote process (ended and reaped
// by the destructor) and its socket. The children are the runtime's and
// outlive the Zygote.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <memory>
#include <mutex>
#include <string_view>

#include <spindle/child.h>
#include <spindle/context.h>
#include <spindle/runtime.h>

namespace spindle {

using ZygoteMain = int (*)(ChildEnv& env, std::string_view arg);

class Zygote {
 public:
  static constexpr std::size_t kMaxArg = 64 * 1024;

  // Forks the zygote. Throws Error if it cannot (fork, socketpair, or a
  // kernel without PR_GET_TID_ADDRESS, which the zygote needs to give each
  // child a correct thread id).
  static std::unique_ptr<Zygote> start();

  ~Zygote();
  Zygote(const Zygote&) = delete;
  Zygote& operator=(const Zygote&) = delete;

  // Forks a child context of `rt` running main(env, arg), linked to it like
  // a Runtime::fork_child() child (opts.fds and opts.transport do not apply:
  // the zygote holds none of this process's fds, and the link is a socket
  // pair). Throws Error when the zygote is gone or refuses (the reason says
  // why), std::system_error when the fork fails.
  Child fork_child(Runtime& rt, ZygoteMain main, std::string_view arg = {}, ChildOptions opts = {});
  // Internal: the same on a bare router, for the project's own tests.
  Context fork_child(Router& parent, ZygoteMain main, std::string_view arg = {},
                     ChildOptions opts = {});

  pid_t pid() const { return pid_; }

 private:
  Zygote(pid_t pid, int socket) : pid_(pid), socket_(socket) {}

  const pid_t pid_;
  const int socket_;
  std::mutex mu_;        // one request and its reply at a time
  bool broken_ = false;  // a request went unanswered: no more (under mu_)
};

}  // namespace spindle
