// Address parsing and the private default directory. Every syscall's failure
// is reported with the address and errno text; nothing here logs, the caller
// decides what a failure means (spindle-router exits with a usage or setup
// error code, a client throws).
#include "router/unix_address.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdlib>
#include <cstring>

#include <fmt/format.h>

#include "broker/errors.h"

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

int connect_unix(const UnixAddress& addr) {
  sockaddr_un sa{};
  socklen_t len = addr.to_sockaddr(sa);
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throw Error(fmt::format("socket(AF_UNIX): {}", errno_text(errno)));
  int rc = ::connect(fd, reinterpret_cast<const sockaddr*>(&sa), len);
  // A signal can interrupt a connect waiting on a full backlog; the retry
  // then finds the connection already made (EISCONN) or still on its way.
  while (rc != 0 && (errno == EINTR || errno == EALREADY)) {
    rc = ::connect(fd, reinterpret_cast<const sockaddr*>(&sa), len);
    if (rc != 0 && errno == EISCONN) rc = 0;
  }
  if (rc != 0) {
    int e = errno;
    ::close(fd);
    throw Error(fmt::format("cannot connect to {}: {}", addr.to_string(), errno_text(e)));
  }
  return fd;
}

}  // namespace spindle
