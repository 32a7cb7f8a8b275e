// UnixAddress: where spindle-router listens and where its clients connect.
//
// An address is a filesystem path, or a Linux abstract-namespace name written
// "@name" (no file, no stale-file cleanup; access is checked by SO_PEERCRED
// alone). The default is router.sock inside a per-user directory of mode 0700
// ($XDG_RUNTIME_DIR/spindle, else /tmp/spindle-<uid>): the directory is
// created, or verified to be ours and private, before anything binds in it,
// so there is no window in which another user can reach the socket.
//
// Thread safety: plain values and free functions; any thread.
#pragma once

#include <sys/socket.h>
#include <sys/un.h>

#include <chrono>
#include <string>
#include <string_view>

namespace spindle {

struct UnixAddress {
  std::string name;       // a path, or the abstract name without its '@'
  bool abstract = false;

  // "@name" is abstract; anything else is a path. Throws Error if empty.
  static UnixAddress parse(std::string_view text);
  std::string to_string() const { return abstract ? "@" + name : name; }
  // Fills `out`; throws Error if the name does not fit in sun_path.
  socklen_t to_sockaddr(sockaddr_un& out) const;
};

// The per-user default, e.g. /run/user/1000/spindle/router.sock. Pure: creates nothing.
UnixAddress default_router_address();
// Creates `dir` with mode 0700 if missing; throws Error unless it is then a
// real directory (not a symlink) owned by this euid with no group/other access.
void ensure_private_dir(const std::string& dir);
// Connects within `timeout` (a full backlog cannot hang the caller), then
// checks who listens: the peer must run as this euid or as root
// (SO_PEERCRED), and a path must lie in a directory that this user (or root)
// owns and nobody else may write to, so no other user can have put a socket
// of theirs there. Returns a CLOEXEC socket or throws Error naming the
// address and the reason.
int connect_unix(const UnixAddress& addr,
                 std::chrono::milliseconds timeout = std::chrono::milliseconds(10000));
// The directory check alone (throws Error).
void check_socket_dir(const std::string& socket_path);

}  // namespace spindle
