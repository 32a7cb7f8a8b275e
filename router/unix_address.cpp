// Address parsing and the private default directory. Every syscall's failure
// is reported with the address and errno text; nothing here logs, the caller
// decides what a failure means (spindle-router exits with a usage or setup
// error code, a client throws).
#include "router/unix_address.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <algorithm>

#include <fmt/format.h>

#include "broker/errors.h"
#include "broker/fd_registry.h"

namespace spindle {

UnixAddress UnixAddress::parse(std::string_view text) {
  if (text.empty() || text == "@") throw Error("empty UNIX socket address");
  UnixAddress a;
  if (text.front() == '@') {
    a.abstract = true;
    a.name = std::string(text.substr(1));
  } else {
    a.name = std::string(text);
  }
  return a;
}

socklen_t UnixAddress::to_sockaddr(sockaddr_un& out) const {
  std::memset(&out, 0, sizeof out);
  out.sun_family = AF_UNIX;
  // A path needs its NUL; an abstract name is preceded by one instead.
  const std::size_t room = sizeof(out.sun_path) - 1;
  if (name.size() > room)
    throw Error(fmt::format("UNIX socket address '{}' is too long ({} bytes, at most {})",
                            to_string(), name.size(), room));
  if (abstract) {
    std::memcpy(out.sun_path + 1, name.data(), name.size());
    return static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  }
  std::memcpy(out.sun_path, name.data(), name.size());
  return static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + name.size() + 1);
}

UnixAddress default_router_address() {
  const char* xdg = std::getenv("XDG_RUNTIME_DIR");
  struct stat st {};
  std::string base = (xdg && *xdg && ::stat(xdg, &st) == 0 && S_ISDIR(st.st_mode))
                         ? fmt::format("{}/spindle", xdg)
                         : fmt::format("/tmp/spindle-{}", ::geteuid());
  return UnixAddress{base + "/router.sock", false};
}

void ensure_private_dir(const std::string& dir) {
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST)
    throw Error(fmt::format("cannot create directory {}: {}", dir, errno_text(errno)));
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0)
    throw Error(fmt::format("cannot inspect {}: {}", dir, errno_text(errno)));
  if (!S_ISDIR(st.st_mode))
    throw Error(fmt::format("{} is not a directory (a symlink or file is refused)", dir));
  if (st.st_uid != ::geteuid())
    throw Error(fmt::format("{} belongs to uid {}, not to this user (uid {})", dir, st.st_uid,
                            ::geteuid()));
  if ((st.st_mode & 077) != 0)
    throw Error(fmt::format("{} has mode {:04o}: other users could reach the socket (want 0700)",
                            dir, st.st_mode & 07777));
}

void check_socket_dir(const std::string& socket_path) {
  auto slash = socket_path.rfind('/');
  std::string dir = slash == std::string::npos ? "." : slash == 0 ? "/" : socket_path.substr(0, slash);
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0)
    throw Error(fmt::format("cannot inspect {}: {}", dir, errno_text(errno)));
  if (st.st_uid != ::geteuid() && st.st_uid != 0)
    throw Error(fmt::format("refusing {}: its directory {} belongs to uid {}, not to this user "
                            "(uid {}) or root", socket_path, dir, st.st_uid, ::geteuid()));
  if ((st.st_mode & 022) != 0)
    throw Error(fmt::format("refusing {}: its directory {} has mode {:04o}, so another user could "
                            "have put a socket there (use a directory only you can write to)",
                            socket_path, dir, st.st_mode & 07777));
}

int connect_unix(const UnixAddress& addr, std::chrono::milliseconds timeout) {
  if (!addr.abstract) check_socket_dir(addr.name);
  sockaddr_un sa{};
  socklen_t len = addr.to_sockaddr(sa);
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  fd_registry::note(fd);
  if (fd < 0) throw Error(fmt::format("socket(AF_UNIX): {}", errno_text(errno)));
  auto fail = [&](const std::string& why) {
    ::close(fd);
    throw Error(fmt::format("cannot connect to {}: {}", addr.to_string(), why));
  };
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  int rc;
  do {
    rc = ::connect(fd, reinterpret_cast<const sockaddr*>(&sa), len);
  } while (rc != 0 && errno == EINTR);
  if (rc != 0 && errno != EAGAIN && errno != EINPROGRESS) fail(errno_text(errno));
  // A UNIX connect returns EAGAIN while the listener's backlog is full:
  // retry until it is accepted or the time is up.
  while (rc != 0) {
    auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0)
      fail(fmt::format("no answer within {} ms (the router's backlog is full or it is stuck)",
                       timeout.count()));
    pollfd p{fd, POLLOUT, 0};
    int n = ::poll(&p, 1, static_cast<int>(std::min<long>(left.count(), 20)));
    if (n < 0 && errno != EINTR) fail(fmt::format("poll: {}", errno_text(errno)));
    rc = ::connect(fd, reinterpret_cast<const sockaddr*>(&sa), len);
    if (rc != 0 && errno == EISCONN) rc = 0;
    if (rc != 0 && errno != EAGAIN && errno != EINPROGRESS && errno != EALREADY && errno != EINTR)
      fail(errno_text(errno));
  }
  ucred cr{};
  socklen_t crlen = sizeof cr;
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &crlen) != 0)
    fail(fmt::format("SO_PEERCRED: {}", errno_text(errno)));
  if (cr.uid != ::geteuid() && cr.uid != 0)
    fail(fmt::format("the process listening there (pid {}) runs as uid {}, not as this user "
                     "(uid {}) or root: refusing to talk to it", cr.pid, cr.uid, ::geteuid()));
  // Hand the fd back blocking, as a plain connect() would: raw users (tests,
  // tools) write to it directly, and a Stream sets its own mode.
  int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0)
    fail(fmt::format("fcntl: {}", errno_text(errno)));
  return fd;
}

}  // namespace spindle
