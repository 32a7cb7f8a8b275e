// Between fork() and the child's own Broker, the child runs on the one thread
// that called fork(). It must not touch anything another parent thread could
// have been holding: the parent's broker, router and logger stay untouched in
// the child's memory (and leak with it), and the child ends with _exit() so no
// inherited static destructor runs either.
#include "router/child.h"

#include <fcntl.h>
#include <pthread.h>
#include <spawn.h>
#include <sys/syscall.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#include <linux/close_range.h>

#include <cerrno>
#include <condition_variable>
#include <mutex>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <future>
#include <system_error>

#include <asio/posix/stream_descriptor.hpp>
#include <fmt/format.h>

#include "broker/errors.h"
#include "broker/fd_registry.h"
#include "broker/fork_park.h"
#include "broker/log.h"
#include "router/child_internal.h"
#include "router/log_forward.h"

extern char** environ;

namespace spindle {
namespace {

[[noreturn]] void throw_errno(const char* what) {
  throw std::system_error(errno, std::generic_category(), what);
}

// fork() with every broker's loop parked on a gate (broker/fork_park.h), so
// that none holds a lock at the moment of the fork: not malloc's, not a
// sanitizer allocator's (GCC 12's ASan does not reset its allocator locks in
// the child: a child hung creating its broker thread), not spdlog's, not
// ours. The thread calling this is the one that forks, so it holds none
// either. Spindle's own other threads are held by pthread_atfork handlers:
// the log writer (broker/log_sink.h) and the service pools
// (services/fork.h). Other application threads are the application's to
// quiesce.
pid_t fork_quiesced(Broker& broker) {
  fork_park::Parked parked = fork_park::park_all(&broker);
  pid_t pid = ::fork();
  if (pid == 0) parked.abandon();  // the child: nothing waits on the gates here
  return pid;  // the parent: `parked` lets the brokers go on
}

// In the child, glibc hands a new thread the cached stack of a parent thread
// that did not survive the fork, so its pthread_t equals that thread's. That
// is harmless, except to ThreadSanitizer, whose copied registry still lists
// the old thread and aborts ("dup thread with used id"). Under TSan only, the
// child's threads ask for a stack size no cached stack satisfies.
void avoid_inherited_thread_stacks() {
#if defined(__SANITIZE_THREAD__)
  pthread_attr_t attr;
  if (pthread_getattr_default_np(&attr) != 0) return;
  std::size_t size = 0;
  if (pthread_attr_getstacksize(&attr, &size) == 0 && pthread_attr_setstacksize(&attr, size * 5) == 0)
    pthread_setattr_default_np(&attr);
  pthread_attr_destroy(&attr);
#endif
}

}  // namespace

namespace detail {

int run_child(int read_fd, int write_fd, RouterOptions opts, const ChildMain& main, bool close_when_drained) {
  int rc = 1;
  {
    Broker broker(Broker::options_for(opts));
    Router router(broker, opts);
    router.hold_unknown_handles(true);  // until main has registered its handlers
    try {
      router.attach_parent(read_fd, write_fd, close_when_drained);
    } catch (const std::exception& e) {
      log().error("child cannot start: {}", e.what());
      // No main will declare ready(): the router must not wait out the
      // shutdown grace for it before this process can exit.
      router.hold_unknown_handles(false);
      return 1;
    }
    set_log_sinks({std::make_shared<ForwardLogSink>(router)});
    ChildEnv env(router, broker);
    try {
      rc = main(env);
    } catch (const std::exception& e) {
      log().error("child main threw: {}", e.what());
      rc = 1;
    }
    env.ready();
    broker.shutdown();
    broker.join();
    set_log_sinks({});  // the forwarding sink borrows the router
  }
  return rc;
}

void take_stdio_link(int& read_fd, int& write_fd) {
  read_fd = ::fcntl(STDIN_FILENO, F_DUPFD_CLOEXEC, 3);
  write_fd = ::fcntl(STDOUT_FILENO, F_DUPFD_CLOEXEC, 3);
  if (read_fd < 0 || write_fd < 0) throw_errno("fcntl(F_DUPFD_CLOEXEC)");
  int devnull = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (devnull < 0) throw_errno("open /dev/null");
  if (::dup2(devnull, STDIN_FILENO) < 0 || ::dup2(STDERR_FILENO, STDOUT_FILENO) < 0) throw_errno("dup2");
  ::close(devnull);
}

void close_other_fds(int keep) {
  int rc = 0;
  if (keep > 3) rc = ::close_range(3, static_cast<unsigned>(keep - 1), 0);
  if (rc == 0) rc = ::close_range(static_cast<unsigned>(keep + 1), ~0u, 0);
  if (rc != 0) {
    // Kernels before 5.9: close one by one.
    long max = ::sysconf(_SC_OPEN_MAX);
    for (long fd = 3; fd < (max > 0 ? max : 65536); ++fd)
      if (fd != keep) ::close(static_cast<int>(fd));
  }
}

Context adopt_child(Router& parent, int read_fd, int write_fd, std::uint32_t id,
                    const std::string& name, pid_t pid, std::function<void(Stream&)> on_adopted) {
  // Via syscall(): Debian 12's <sys/pidfd.h> lacks C linkage for C++ callers.
  int pidfd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
  if (pidfd < 0) {
    int err = errno;
    ::close(read_fd);
    if (write_fd != read_fd) ::close(write_fd);
    errno = err;
    throw_errno("pidfd_open");
  }
  return adopt_child(parent, read_fd, write_fd, id, name, std::make_shared<ChildProcess>(pid, pidfd),
                     std::move(on_adopted));
}

Context adopt_child(Router& parent, int read_fd, int write_fd, std::uint32_t id,
                    const std::string& name, std::shared_ptr<ChildProcess> proc,
                    std::function<void(Stream&)> on_adopted) {
  const pid_t pid = proc->pid();
  // Wait until the child is routed: a message sent right after we return
  // could otherwise be routed by an outbox drain queued earlier, before the
  // stream exists, and get "no route".
  auto adopted = std::make_shared<std::promise<void>>();
  auto routed = adopted->get_future();
  parent.broker().defer([&parent, read_fd, write_fd, id, name, pid, adopted,
                         on_adopted = std::move(on_adopted)] {
    try {
      auto s = parent.add_child_stream(read_fd, write_fd, id, name);
      if (s && on_adopted) on_adopted(*s);
    } catch (const std::exception& e) {
      // The child sees its link close (or its handshake time out) and exits;
      // it is still reaped (below, or by the broker's end).
      log().error("cannot adopt child ctx={} ({}) pid={}: {}", id, name, pid, e.what());
    }
    adopted->set_value();
  });
  // The broker reaps it when it exits, or at its own end: no zombies.
  parent.broker().watch_child(proc, [id, name, pid, link = parent.link()](int status) {
    const std::string how = describe_wait_status(status);
    log().info("child ctx={} ({}) pid={} {}", id, name, pid, how);
    // On the loop, where the router, if alive, outlives this handler.
    if (link->alive()) link->router.load(std::memory_order_relaxed)->child_exited(id, how);
  });
  routed.wait();
  return Context(parent, id, name, std::move(proc));
}

void apply_fd_policy(const FdPolicy& fds, int link) {
  switch (fds.kind()) {
    case FdPolicy::Kind::kInheritAll:
      return;
    case FdPolicy::Kind::kCloseSpindle:
      fd_registry::close_noted(link);
      return;
    case FdPolicy::Kind::kCloseAllExcept: {
      // Close the gaps between the kept fds (ascending) and the link.
      unsigned from = 3;
      auto close_below = [&](int fd) {
        if (fd < 3 || static_cast<unsigned>(fd) < from) return;
        if (static_cast<unsigned>(fd) > from && ::close_range(from, static_cast<unsigned>(fd) - 1, 0) != 0)
          for (unsigned f = from; f < static_cast<unsigned>(fd); ++f) ::close(static_cast<int>(f));
        from = static_cast<unsigned>(fd) + 1;
      };
      bool link_done = false;
      for (int k : fds.kept()) {
        if (!link_done && link < k) {
          close_below(link);
          link_done = true;
        }
        close_below(k);
      }
      if (!link_done) close_below(link);
      if (::close_range(from, ~0u, 0) != 0) {
        long max = ::sysconf(_SC_OPEN_MAX);
        for (long f = from; f < (max > 0 ? max : 65536); ++f) ::close(static_cast<int>(f));
      }
      fd_registry::reset_to(link);
      return;
    }
  }
}

void run_forked_child(int link, std::uint32_t id, RouterOptions opts, const ChildMain& main,
                      const FdPolicy& fds) {
  avoid_inherited_thread_stacks();
  apply_fd_policy(fds, link);
  reset_logging_after_fork(id, opts.name);
  int rc = 1;
  try {
    rc = detail::run_child(link, link, std::move(opts), main);
  } catch (const std::exception& e) {
    log().error("child failed: {}", e.what());
  }
  std::fflush(nullptr);
  ::_exit(rc);
}

std::string child_name(std::uint32_t id, const ChildOptions& opts) {
  return opts.name.empty() ? fmt::format("child-{}", id) : opts.name;
}

}  // namespace detail

using detail::adopt_child;
using detail::child_name;

Context fork_child(Router& parent, ChildMain main, ChildOptions opts) {
  std::uint32_t id = parent.allocate_id();
  std::string name = child_name(id, opts);
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0) throw_errno("socketpair");
  fd_registry::note(sv[0]);
  std::fflush(nullptr);  // don't let the child flush the parent's buffered stdio twice
  pid_t pid;
  try {
    pid = fork_quiesced(parent.broker());
  } catch (...) {  // the broker has shut down: no new children
    ::close(sv[0]);
    ::close(sv[1]);
    throw;
  }
  if (pid < 0) {
    int err = errno;
    ::close(sv[0]);
    ::close(sv[1]);
    errno = err;
    throw_errno("fork");
  }
  if (pid == 0) {
    RouterOptions ro = opts.router;
    ro.name = name;
    detail::run_forked_child(sv[1], id, std::move(ro), main, opts.fds);
  }
  ::close(sv[1]);
  return adopt_child(parent, sv[0], sv[0], id, name, pid);
}

namespace {

// File actions for spawn_child: each fd of `opts.pass_fds` is dup2'd onto
// itself (which clears its CLOEXEC), and every other fd from `first` on is
// closed: those below the highest passed one one by one (the open ones
// without CLOEXEC: exec closes the others), the rest with closefrom.
// Throws Error, before anything is made, for a pass_fds list that cannot be.
void check_pass_fds(const ChildOptions& opts) {
  const int first = opts.transport == ChildTransport::kSocketPair ? 4 : 3;
  for (int fd : opts.pass_fds) {
    if (fd < first)
      throw Error(fmt::format("spawn_child: pass_fds holds {}; 0, 1 and 2 are always passed, and {} "
                              "carries the link",
                              fd, first - 1));
    if (::fcntl(fd, F_GETFD) < 0) throw Error(fmt::format("spawn_child: pass_fds holds {}, which is not open", fd));
  }
}

int add_spawn_fd_actions(posix_spawn_file_actions_t& fa, const ChildOptions& opts, int first) {
  std::vector<int> pass = opts.pass_fds;
  std::sort(pass.begin(), pass.end());
  pass.erase(std::unique(pass.begin(), pass.end()), pass.end());
  int rc = 0;
  for (int fd : pass)
    if (rc == 0) rc = posix_spawn_file_actions_adddup2(&fa, fd, fd);
  const int top = pass.empty() ? first - 1 : pass.back();
  for (int fd = first; fd < top && rc == 0; ++fd) {
    if (std::binary_search(pass.begin(), pass.end(), fd)) continue;
    int flags = ::fcntl(fd, F_GETFD);
    if (flags >= 0 && !(flags & FD_CLOEXEC)) rc = posix_spawn_file_actions_addclose(&fa, fd);
  }
  if (rc == 0) rc = posix_spawn_file_actions_addclosefrom_np(&fa, top + 1);
  return rc;
}

}  // namespace

Context spawn_child(Router& parent, const std::string& program,
                    const std::vector<std::string>& args, ChildOptions opts) {
  check_pass_fds(opts);
  std::uint32_t id = parent.allocate_id();
  std::string name = child_name(id, opts);

  int parent_read = -1, parent_write = -1, child_read = -1, child_write = -1;
  if (opts.transport == ChildTransport::kSocketPair) {
    int sv[2];
    if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0) throw_errno("socketpair");
    parent_read = parent_write = sv[0];
    child_read = child_write = sv[1];
  } else {
    int down[2], up[2];
    if (::pipe2(down, O_CLOEXEC) < 0) throw_errno("pipe2");
    if (::pipe2(up, O_CLOEXEC) < 0) {
      int err = errno;
      ::close(down[0]);
      ::close(down[1]);
      errno = err;
      throw_errno("pipe2");
    }
    parent_write = down[1];
    child_read = down[0];
    parent_read = up[0];
    child_write = up[1];
  }
  auto close_child_ends = [&] {
    ::close(child_read);
    if (child_write != child_read) ::close(child_write);
  };
  auto close_all = [&] {
    close_child_ends();
    ::close(parent_read);
    if (parent_write != parent_read) ::close(parent_write);
  };

  posix_spawn_file_actions_t fa;
  if (int e = posix_spawn_file_actions_init(&fa)) {
    close_all();
    throw std::system_error(e, std::generic_category(), "posix_spawn_file_actions_init");
  }
  std::vector<std::string> env_strings;
  for (char** e = environ; *e; ++e) {
    if (std::strncmp(*e, "SPINDLE_FD=", 11) != 0 && std::strncmp(*e, "SPINDLE_CONTEXT_NAME=", 21) != 0)
      env_strings.emplace_back(*e);
  }
  int rc = 0;
  if (opts.transport == ChildTransport::kSocketPair) {
    // dup2 onto fd 3 clears CLOEXEC there; if the socket already is fd 3,
    // dup2 would be a no-op that keeps CLOEXEC, so move it first.
    if (child_read == 3) {
      int moved = ::fcntl(child_read, F_DUPFD_CLOEXEC, 4);
      if (moved < 0) {
        int err = errno;
        posix_spawn_file_actions_destroy(&fa);
        close_all();
        errno = err;
        throw_errno("fcntl(F_DUPFD_CLOEXEC)");
      }
      ::close(child_read);
      child_read = child_write = moved;
    }
    rc = posix_spawn_file_actions_adddup2(&fa, child_read, 3);
    env_strings.emplace_back("SPINDLE_FD=3");
  } else {
    rc = posix_spawn_file_actions_adddup2(&fa, child_read, 0);
    if (rc == 0) rc = posix_spawn_file_actions_adddup2(&fa, child_write, 1);
    env_strings.emplace_back("SPINDLE_FD=stdio");
  }
  env_strings.emplace_back("SPINDLE_CONTEXT_NAME=" + name);
  // The program gets the link, stdio and pass_fds (at their numbers),
  // nothing else: an fd opened without O_CLOEXEC (ours or the
  // application's) would otherwise stay open in it, holding a socket or a
  // pipe end the parent means to close.
  if (rc == 0) rc = add_spawn_fd_actions(fa, opts, opts.transport == ChildTransport::kSocketPair ? 4 : 3);

  std::vector<char*> argv;
  argv.push_back(const_cast<char*>(program.c_str()));
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  std::vector<char*> envp;
  for (auto& e : env_strings) envp.push_back(e.data());
  envp.push_back(nullptr);

  pid_t pid = -1;
  if (rc == 0) rc = ::posix_spawn(&pid, program.c_str(), &fa, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) {
    close_all();
    throw std::system_error(rc, std::generic_category(), "posix_spawn " + program);
  }
  close_child_ends();
  fd_registry::note(parent_read);
  fd_registry::note(parent_write);
  return adopt_child(parent, parent_read, parent_write, id, name, pid);
}

int run_spawned_child(ChildMain main, RouterOptions opts) {
  const char* fdspec = std::getenv("SPINDLE_FD");
  if (!fdspec) {
    std::fprintf(stderr, "spindle: SPINDLE_FD is not set; this program must be started by spawn_child()\n");
    return 2;
  }
  if (const char* n = std::getenv("SPINDLE_CONTEXT_NAME")) opts.name = n;
  int read_fd, write_fd;
  if (std::strcmp(fdspec, "stdio") == 0) {
    detail::take_stdio_link(read_fd, write_fd);
  } else {
    char* end = nullptr;
    long fd = std::strtol(fdspec, &end, 10);
    if (!end || *end != '\0' || fd < 0 || fd > 65535) {
      std::fprintf(stderr, "spindle: bad SPINDLE_FD '%s'\n", fdspec);
      return 2;
    }
    read_fd = write_fd = static_cast<int>(fd);
    if (::fcntl(read_fd, F_SETFD, FD_CLOEXEC) < 0) throw_errno("fcntl(FD_CLOEXEC) on SPINDLE_FD");
  }
  return detail::run_child(read_fd, write_fd, opts, main);
}

}  // namespace spindle
