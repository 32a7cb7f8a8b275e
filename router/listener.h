// Listener: accepts clients on a UNIX socket and hands them to a Router.
//
// Role: the front door of spindle-router. It never blocks the broker: the
// listening socket is non-blocking, each readiness event accepts in a loop
// until EAGAIN (so a burst of freshly forked workers is taken in one turn,
// where Mitogen once crashed on EAGAIN), and each client's handshake is a
// ListenerHandshake driven by its own Stream with its own timeout: a client
// that connects and says nothing costs one fd until --handshake-timeout, and
// nobody waits on it.
//
// Admission, in order:
//   1. SO_PEERCRED: only allowed uids (default: this process's euid) join; a
//      refusal is logged with the peer's uid and pid. Same-uid clients act with
//      the router's authority (Mitogen's listener rule).
//   2. max_clients bounds every client, handshaking ones included. A client
//      over the limit still gets a readable refusal (Spindle "SPNO"; a Mitogen
//      client is closed) while a few refusal slots remain; past those it is
//      closed at once. Past three quarters of it, a uid holding its share
//      (max_clients / allowed uids) is refused the same way: no uid can lock
//      the others out (dbus-broker's per-user quotas make the same promise).
//   3. Out of file descriptors (EMFILE/ENFILE on accept): logged, and the
//      pending connection is refused using a reserved fd, so the loop neither
//      spins nor leaves clients hanging in the backlog. If even the reserve is
//      gone, accepting pauses briefly. Existing clients are unaffected.
//
// The socket comes from bind() (a stale file is replaced only when connecting
// to it is refused; a live one is an error) or from systemd socket activation
// (LISTEN_FDS), in which case systemd owns the path and nothing is unlinked.
//
// Thread safety: open(), start() and the destructor on any thread but the broker's;
// everything else runs on the broker thread.
// Ownership: owned by its creator; borrows the Router (and its Broker), which
// must outlive it. Registered as a ShutdownParticipant: shutdown stops
// accepting and removes the socket file.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <asio/posix/stream_descriptor.hpp>
#include <asio/steady_timer.hpp>

#include "router/router.h"
#include "router/unix_address.h"

namespace spindle {

struct ListenerOptions {
  UnixAddress address;                // ignored when systemd passed a socket
  bool accept_systemd_socket = true;  // use LISTEN_FDS when it is addressed to us
  std::size_t max_clients = 4096;     // 0 = unlimited
  std::vector<uid_t> allowed_uids;    // empty = this process's euid only
  int backlog = 4096;                 // capped by net.core.somaxconn
};

struct ListenerStats {
  std::uint64_t accepted = 0;
  std::uint64_t refused_uid = 0, refused_full = 0, refused_no_fds = 0;
};

class Listener : public ShutdownParticipant {
 public:
  // Binds (or adopts the systemd socket) and listens; clients queue in the
  // backlog until start(). The router must be the root (id 0): clients' ids
  // are allocated locally. Throws Error.
  static std::unique_ptr<Listener> open(Router& router, ListenerOptions opts);
  // Begins accepting (once everything clients may call is in place).
  void start();
  ~Listener() override;
  Listener(const Listener&) = delete;
  Listener& operator=(const Listener&) = delete;

  // What clients connect to ("@name" for abstract, the path otherwise).
  const std::string& address() const { return address_text_; }
  bool from_systemd() const { return from_systemd_; }
  ListenerStats stats();

  void on_shutdown_begin() override;
  void on_shutdown_deadline() override {}

 private:
  Listener(Router& router, ListenerOptions opts, bool from_systemd, std::string address);
  void arm_accept();
  void accept_ready();
  void admit(int fd);
  std::string refusal_for_room(uid_t uid, std::size_t connected) const;
  enum class FdShortage { kRefusedOne, kBacklogEmpty, kPaused };
  FdShortage out_of_fds(int err);
  void stop_accepting();
  ServerHandshake::Assignment assign(const PeerInfo& hello, uid_t uid, pid_t pid, bool over_limit);

  Router& router_;
  Broker& broker_;
  ListenerOptions opts_;
  asio::posix::stream_descriptor socket_;
  asio::steady_timer pause_;
  bool from_systemd_;
  std::string address_text_;
  std::optional<std::string> unlink_path_;  // a socket file we bound
  int reserve_fd_ = -1;                     // spent to refuse a client when out of fds
  int fd_ = -1;                             // the listening socket until start()
  bool accepting_ = false;
  // Posted continuations outlive nothing: they check this before touching us.
  std::shared_ptr<bool> alive_ = std::make_shared<bool>(true);
  std::uint64_t fd_refusals_logged_ = 0;
  std::chrono::steady_clock::time_point last_fd_log_{};
  ListenerStats stats_;
};

// Adopts a socket passed by systemd (LISTEN_PID/LISTEN_FDS), or returns -1 if
// none is addressed to this process. Clears the variables so children do not
// see them. Throws Error if the passed fd is not a listening UNIX stream socket.
int take_systemd_socket();

}  // namespace spindle
