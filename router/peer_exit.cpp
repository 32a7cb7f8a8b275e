// A peer process's exit, learned from its pidfd, ends its link even when no
// EOF comes.
//
// A link's EOF comes when the last copy of the other end closes, and a
// process that forked holds copies in its forks: a multiprocessing worker,
// a daemon, any os.fork() of a Python program keeps the fds of Spindle
// objects it abandons. So a child killed with -9 left its parent's calls
// waiting for their timeout, and a parent killed with -9 left its children
// running, as long as such a fork lived. Both ends of a local link know the
// other's process, and each watches it: the parent its children (the
// broker reaps them, router/child.cpp), a child its parent (here). When the
// process has gone, what it wrote before is read and delivered, and the link
// then ends with the reason (Stream::peer_exited).
#include "router/router.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <asio/posix/stream_descriptor.hpp>

#include "broker/errors.h"
#include "broker/fd_registry.h"
#include "broker/log.h"

namespace spindle {

void Router::child_exited(std::uint32_t id, const std::string& how) {
  auto it = routes_.find(id);
  if (it == routes_.end()) return;  // its link has closed already: the usual case
  Link& l = *it->second;
  if (l.role != StreamRole::kChild || l.remote_id != id) return;
  l.stream->peer_exited("the child process ended: " + how);
}

void Router::parent_exited() {
  if (parent_) parent_->stream->peer_exited("the parent process ended");
}

// Only a parent that is this process's parent is watched: the pid a peer
// gives in its handshake may be another host's (ssh) or another pid
// namespace's (a router reached through a mounted socket), where the same
// number names some other process here.
void Router::watch_parent_process(pid_t pid) {
  if (pid <= 0 || pid != ::getppid()) return;
  const int fd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));  // O_CLOEXEC always
  if (fd < 0) {
    log().debug("pidfd_open of the parent pid={}: {}", pid, errno_text(errno));
    return;
  }
  fd_registry::note(fd);
  // Reparented between the two looks: the parent had gone already, and fd
  // may name a process that took its pid.
  if (::getppid() != pid) {
    ::close(fd);
    return parent_exited();
  }
  std::error_code ignored;
  if (parent_watch_) parent_watch_->close(ignored);
  parent_watch_ = std::make_shared<asio::posix::stream_descriptor>(broker_.io(), fd);
  parent_watch_->async_wait(asio::posix::descriptor_base::wait_read,
                            [watch = parent_watch_, link = link_](const std::error_code& ec) {
                              if (ec == asio::error::operation_aborted || !link->alive()) return;
                              link->router.load(std::memory_order_relaxed)->parent_exited();
                            });
}

}  // namespace spindle
