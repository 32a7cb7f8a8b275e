// Zygote: forks child contexts from a small process started early, so that
// the cost of a child does not depend on the size or the threads of the
// process that asks for it.
//
// Role: fork_child() copies the calling process. A parent that holds a large
// heap, or runs a busy pool, pays for that at every fork: page tables to copy,
// pages to copy on write, a broker to park, pools to quiesce. Zygote::start(),
// called early in main (before the heap grows and before threads exist),
// forks a helper process, the zygote, while the process is still small. Later,
// Zygote::fork_child() asks the zygote to fork the child. The child is created
// with CLONE_PARENT, so it is this process's child, not the zygote's: it is
// watched, reaped and killed exactly like a fork_child() child, and its exit
// status is ours to read.
//
//   int worker(spindle::ChildEnv& env, std::string_view arg) { ...; env.serve(); return 0; }
//
//   int main() {
//     auto zygote = spindle::Zygote::start();   // first: the process is small
//     spindle::Broker broker;
//     spindle::Router router(broker);
//     spindle::Context c = zygote->fork_child(router, worker, "shard-3");
//
// What the child runs is a plain function, not a closure: the child is a copy
// of the process as it was when the zygote started, so objects made later do
// not exist there. The function gets the argument bytes (at most kMaxArg);
// anything larger travels over the link once the child is up. The function
// must be in code loaded before start() (the zygote checks: a function of a
// library dlopen()ed later is refused with a clear error).
//
// The zygote holds no fd of the parent but its own socket and stdin, stdout
// and stderr: it closes the rest when it starts. It exits when its socket
// closes (the Zygote is destroyed, or the parent dies).
//
// Thread safety: start() on any thread, preferably before any other exists;
// fork_child() from any thread except the parent router's broker thread
// (calls are serialised). Ownership: a Zygote owns the zygote process (ended
// and reaped by the destructor) and its socket. The children are the
// parent's: they outlive the Zygote.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <memory>
#include <mutex>
#include <string_view>

#include "router/child.h"

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

  // Forks a child context running main(env, arg), linked to `parent` like a
  // fork_child() child (opts.transport is ignored: the link is a socket
  // pair). Throws Error when the zygote is gone or refuses (the reason says
  // why), std::system_error when the fork fails.
  Context fork_child(Router& parent, ZygoteMain main, std::string_view arg = {},
                     ChildOptions opts = {});

  pid_t pid() const { return pid_; }

 private:
  Zygote(pid_t pid, int socket) : pid_(pid), socket_(socket) {}

  const pid_t pid_;
  const int socket_;
  std::mutex mu_;       // one request and its reply at a time
  bool broken_ = false;  // a request went unanswered: no more (under mu_)
};

}  // namespace spindle
