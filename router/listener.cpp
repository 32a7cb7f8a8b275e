// The accept path is a loop on a non-blocking socket, re-armed with an Asio
// wait only after accept4() said EAGAIN: Asio registers descriptors
// edge-triggered, so stopping early would wait for an edge that never comes.
// A turn accepts at most kAcceptsPerTurn clients and then yields to the other
// streams through a post(), so a flood of connections cannot starve clients
// that are already talking.
//
// Running out of fds is an expected outcome, not a crash: accept4() returning
// EMFILE/ENFILE leaves the connection in the backlog, which would wake the
// loop again at once (Mitogen-era listeners spin here). Closing the reserve
// fd makes room to accept that one connection and close it, so the client is
// refused promptly; the reserve is then reopened. Log lines are rate-limited
// to one per second with a count, because a flood would otherwise flood the
// log too.
#include "router/listener.h"

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <future>

#include <asio/post.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "broker/errors.h"
#include "broker/fd_registry.h"
#include "broker/log.h"
#include "broker/summary_log.h"
#include "stream/listener_handshake.h"

namespace spindle {
namespace {

constexpr int kAcceptsPerTurn = 256;
// Clients over max_clients still get a readable refusal while this many
// connections beyond the limit are open; past that they are closed at once.
constexpr std::size_t kRefusalSlots = 16;
constexpr auto kPauseWhenStuck = std::chrono::milliseconds(100);
constexpr auto kFdLogInterval = std::chrono::seconds(1);

int open_reserve() { return ::open("/dev/null", O_RDONLY | O_CLOEXEC); }

// Binds a fresh socket at `addr`. A path that already exists must be a socket
// nobody listens on (connect refused): that stale file is replaced. Returns
// the listening fd and sets `bound_path` if a file was created.
int bind_socket(const UnixAddress& addr, int backlog, std::optional<std::string>& bound_path) {
  sockaddr_un sa{};
  socklen_t len = addr.to_sockaddr(sa);
  if (!addr.abstract) {
    struct stat st {};
    if (::lstat(addr.name.c_str(), &st) == 0) {
      if (!S_ISSOCK(st.st_mode))
        throw Error(fmt::format("{} exists and is not a socket; refusing to replace it", addr.name));
      int probe = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (probe < 0) throw Error(fmt::format("socket(AF_UNIX): {}", errno_text(errno)));
      int rc = ::connect(probe, reinterpret_cast<const sockaddr*>(&sa), len);
      int e = errno;
      ::close(probe);
      if (rc == 0) throw Error(fmt::format("another process is listening on {}", addr.name));
      if (e != ECONNREFUSED && e != ENOENT)
        throw Error(fmt::format("cannot tell whether {} is stale: {}", addr.name, errno_text(e)));
      if (e == ECONNREFUSED) {
        log().info("listener: replacing stale socket {} (nothing listens on it)", addr.name);
        if (::unlink(addr.name.c_str()) != 0 && errno != ENOENT)
          throw Error(fmt::format("cannot remove stale {}: {}", addr.name, errno_text(errno)));
      }
    } else if (errno != ENOENT) {
      throw Error(fmt::format("cannot inspect {}: {}", addr.name, errno_text(errno)));
    }
  }
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  fd_registry::note(fd);
  if (fd < 0) throw Error(fmt::format("socket(AF_UNIX): {}", errno_text(errno)));
  // Linux creates the socket file with the socket inode's mode (minus the
  // umask): setting 0600 first means the file never exists with wider access.
  if (!addr.abstract && ::fchmod(fd, 0600) != 0) {
    int e = errno;
    ::close(fd);
    throw Error(fmt::format("fchmod on the listening socket: {}", errno_text(e)));
  }
  if (::bind(fd, reinterpret_cast<const sockaddr*>(&sa), len) != 0) {
    int e = errno;
    ::close(fd);
    if (e == EADDRINUSE)
      throw Error(fmt::format("another process is listening on {}", addr.to_string()));
    throw Error(fmt::format("cannot bind {}: {}", addr.to_string(), errno_text(e)));
  }
  if (!addr.abstract) bound_path = addr.name;
  if (::listen(fd, backlog) != 0) {
    int e = errno;
    ::close(fd);
    if (bound_path) ::unlink(bound_path->c_str());
    throw Error(fmt::format("cannot listen on {}: {}", addr.to_string(), errno_text(e)));
  }
  return fd;
}

std::string describe_bound(int fd) {
  sockaddr_un sa{};
  socklen_t len = sizeof sa;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len) != 0) return "(unknown)";
  std::size_t n = len > offsetof(sockaddr_un, sun_path) ? len - offsetof(sockaddr_un, sun_path) : 0;
  if (n == 0) return "(unnamed)";
  if (sa.sun_path[0] == '\0') {  // abstract: shown as "@name"
    std::string name(1, '@');
    name.append(sa.sun_path + 1, n - 1);
    return name;
  }
  return std::string(sa.sun_path, strnlen(sa.sun_path, n));
}

}  // namespace

int take_systemd_socket() {
  const char* pid = std::getenv("LISTEN_PID");
  const char* fds = std::getenv("LISTEN_FDS");
  if (!pid || !fds || std::strtol(pid, nullptr, 10) != ::getpid()) return -1;
  long n = std::strtol(fds, nullptr, 10);
  ::unsetenv("LISTEN_PID");
  ::unsetenv("LISTEN_FDS");
  ::unsetenv("LISTEN_FDNAMES");
  if (n < 1) return -1;
  constexpr int kFirst = 3;  // SD_LISTEN_FDS_START
  for (int extra = kFirst + 1; extra < kFirst + n; ++extra) {
    log().warn("listener: ignoring extra systemd socket fd {} (spindle-router uses one)", extra);
    ::close(extra);
  }
  int fd = kFirst, domain = 0, type = 0, listening = 0;
  socklen_t len = sizeof(int);
  if (::getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &domain, &len) != 0 ||
      ::getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) != 0 ||
      ::getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) != 0)
    throw Error(fmt::format("systemd passed fd {} but it is not a socket: {}", fd, errno_text(errno)));
  if (domain != AF_UNIX || type != SOCK_STREAM || !listening)
    throw Error(fmt::format("systemd passed fd {}, which is not a listening UNIX stream socket", fd));
  int fl = ::fcntl(fd, F_GETFL);
  if (fl < 0 || ::fcntl(fd, F_SETFL, fl | O_NONBLOCK) != 0 || ::fcntl(fd, F_SETFD, FD_CLOEXEC) != 0)
    throw Error(fmt::format("cannot configure systemd socket fd {}: {}", fd, errno_text(errno)));
  return fd;
}

std::unique_ptr<Listener> Listener::open(Router& router, ListenerOptions opts) {
  if (router.parent_id())
    throw Error("a Listener needs the root router: it allocates client ids locally");
  int fd = opts.accept_systemd_socket ? take_systemd_socket() : -1;
  bool systemd = fd >= 0;
  std::optional<std::string> bound;
  if (!systemd) fd = bind_socket(opts.address, opts.backlog, bound);
  std::string where = systemd ? describe_bound(fd) : opts.address.to_string();
  std::unique_ptr<Listener> l(new Listener(router, std::move(opts), systemd, where));
  l->unlink_path_ = bound;
  l->fd_ = fd;
  return l;
}

void Listener::start() {
  std::promise<void> started;
  auto f = started.get_future();
  if (!broker_.try_defer([this, &started] {
        broker_.add_participant(this);
        socket_.assign(std::exchange(fd_, -1));
        accepting_ = true;
        // Said before the first accept can complete (on this thread): a
        // client's "connected" line never comes before it in the log.
        log().info("listener: accepting clients on {}{}", address_text_,
                   from_systemd_ ? " (from systemd)" : "");
        arm_accept();
        started.set_value();
      }))
    throw ShutdownError("cannot start accepting: the broker is shutting down");
  f.wait();
}

Listener::Listener(Router& router, ListenerOptions opts, bool from_systemd, std::string address)
    : router_(router), broker_(router.broker()), opts_(std::move(opts)),
      socket_(router.broker().io()), pause_(router.broker().io()), from_systemd_(from_systemd),
      address_text_(std::move(address)), reserve_fd_(open_reserve()) {
  if (opts_.allowed_uids.empty()) opts_.allowed_uids.push_back(::geteuid());
  // Each uid once: the uids allowed divide max_clients between them.
  std::sort(opts_.allowed_uids.begin(), opts_.allowed_uids.end());
  opts_.allowed_uids.erase(std::unique(opts_.allowed_uids.begin(), opts_.allowed_uids.end()),
                           opts_.allowed_uids.end());
}

Listener::~Listener() {
  std::promise<void> done;
  auto f = done.get_future();
  if (broker_.try_defer([this, &done] {
        stop_accepting();
        broker_.remove_participant(this);
        done.set_value();
      })) {
    f.wait();
  } else {
    broker_.join();  // the loop is finishing: wait until nothing can call us
    stop_accepting();
  }
  if (reserve_fd_ >= 0) ::close(reserve_fd_);
}

ListenerStats Listener::stats() {
  if (broker_.on_broker_thread()) return stats_;
  std::promise<ListenerStats> p;
  auto f = p.get_future();
  if (!broker_.try_defer([&] { p.set_value(stats_); })) return {};
  return f.get();
}

void Listener::arm_accept() {
  if (!accepting_) return;
  socket_.async_wait(asio::posix::descriptor_base::wait_read, [this](const std::error_code& ec) {
    if (ec == asio::error::operation_aborted || !accepting_) return;
    if (ec) {
      log().error("listener: waiting for clients failed: {}", ec.message());
      return stop_accepting();
    }
    accept_ready();
  });
}

void Listener::accept_ready() {
  if (!accepting_) return;
  for (int turn = 0; turn < kAcceptsPerTurn; ++turn) {
    int fd = ::accept4(socket_.native_handle(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    fd_registry::note(fd);
    if (fd >= 0) {
      admit(fd);
      continue;
    }
    int e = errno;
    if (e == EAGAIN || e == EWOULDBLOCK) return arm_accept();
    if (e == EINTR || e == ECONNABORTED || e == EPROTO) continue;
    if (e == EMFILE || e == ENFILE || e == ENOBUFS || e == ENOMEM) {
      switch (out_of_fds(e)) {
        case FdShortage::kRefusedOne: continue;
        case FdShortage::kBacklogEmpty: return arm_accept();
        case FdShortage::kPaused: return;  // the timer resumes accepting
      }
    }
    log().error("listener: accept failed: {}; pausing {} ms", errno_text(e), kPauseWhenStuck.count());
    pause_.expires_after(kPauseWhenStuck);
    pause_.async_wait([this](const std::error_code& ec) {
      if (!ec) accept_ready();
    });
    return;
  }
  // More may be waiting: continue after the other streams have had a turn.
  asio::post(broker_.io(), [this, alive = alive_] {
    if (*alive) accept_ready();
  });
}

Listener::FdShortage Listener::out_of_fds(int err) {
  auto now = std::chrono::steady_clock::now();
  if (now - last_fd_log_ >= kFdLogInterval) {
    rlimit rl{};
    ::getrlimit(RLIMIT_NOFILE, &rl);
    log().error("listener: accept: {}: refusing new clients until fds are free ({} clients "
                "connected, RLIMIT_NOFILE {}; {} refused since the last report)",
                errno_text(err), router_.client_count(), static_cast<unsigned long>(rl.rlim_cur),
                stats_.refused_no_fds - fd_refusals_logged_);
    fd_refusals_logged_ = stats_.refused_no_fds;
    last_fd_log_ = now;
  }
  if (reserve_fd_ >= 0) {
    ::close(reserve_fd_);
    int fd = ::accept4(socket_.native_handle(), nullptr, nullptr, SOCK_CLOEXEC);
    fd_registry::note(fd);
    if (fd >= 0) {
      ::close(fd);  // the client sees EOF now instead of waiting in the backlog
      ++stats_.refused_no_fds;
    }
    int accept_errno = errno;
    reserve_fd_ = open_reserve();
    if (fd >= 0) return FdShortage::kRefusedOne;
    // accept4() reports EMFILE before it looks at the backlog: an empty
    // backlog is only discovered here. Wait for the next client.
    if (accept_errno == EAGAIN || accept_errno == EWOULDBLOCK) return FdShortage::kBacklogEmpty;
  }
  // No reserve to spend: wait instead of spinning on a full table.
  pause_.expires_after(kPauseWhenStuck);
  pause_.async_wait([this](const std::error_code& ec) {
    if (!ec) accept_ready();
  });
  return FdShortage::kPaused;
}

void Listener::admit(int fd) {
  ucred cr{};
  socklen_t len = sizeof cr;
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &len) != 0) {
    log().error("listener: SO_PEERCRED failed: {}; closing the connection", errno_text(errno));
    ::close(fd);
    return;
  }
  ++stats_.accepted;
  if (std::find(opts_.allowed_uids.begin(), opts_.allowed_uids.end(), cr.uid) ==
      opts_.allowed_uids.end()) {
    ++stats_.refused_uid;
    // Any local user can connect to an abstract address as often as it
    // likes: summed up, as every line a peer causes at will.
    static SummaryLog refused_uid(spdlog::level::warn);
    refused_uid.note([&] {
      return fmt::format("listener: refused client pid={} uid={}: only uid {} may connect", cr.pid, cr.uid,
                         fmt::join(opts_.allowed_uids, ","));
    });
    ::close(fd);
    return;
  }
  const std::size_t n = router_.client_count();
  std::string full_reason = refusal_for_room(cr.uid, n);
  if (!full_reason.empty()) {
    ++stats_.refused_full;
    static SummaryLog refused_full(spdlog::level::warn);
    refused_full.note([&] {
      return fmt::format("listener: refused client pid={} uid={}: {}", cr.pid, cr.uid, full_reason);
    });
    if (n >= opts_.max_clients + kRefusalSlots) {
      ::close(fd);
      return;
    }
  }
  Router* router = &router_;
  auto hs = std::make_unique<ListenerHandshake>(
      router_.id(), static_cast<std::uint32_t>(::getpid()),
      // What the client's stream will read (an untrusted peer's limit).
      untrusted_receive_limit(router_.options().max_message_size,
                              router_.options().peer_memory_limit, router_.options().memory_limit),
      [router, full_reason](const PeerInfo&) -> ServerHandshake::Assignment {
        if (!full_reason.empty()) return full_reason;
        // Out of ids: the client is refused with the reason, not left
        // waiting for a welcome that never comes.
        try {
          return router->allocate_id();
        } catch (const Error& e) {
          return std::string(e.what());
        }
      });
  ClientLinkOptions o;
  o.trusted = cr.uid == ::geteuid();
  o.pid = static_cast<std::uint32_t>(cr.pid);
  o.uid = cr.uid;
  router_.add_client_stream(fd, fmt::format("client.pid{}", cr.pid), std::move(hs), o);
}

// Room for one more client of `uid` while `n` are connected: "" if there is,
// otherwise the refusal. One uid may not fill the router for the others:
// past three quarters of max_clients, a uid that holds its share already
// (max_clients divided among the uids allowed) is refused, so the last
// quarter stays for the uids under theirs. A hostile user cannot lock the
// others out by connecting in a loop, and a busy one still has the room
// nobody else uses. With one uid allowed its share is the whole.
std::string Listener::refusal_for_room(uid_t uid, std::size_t n) const {
  const std::size_t max = opts_.max_clients;
  if (max == 0) return {};
  if (n >= max) return fmt::format("router full: {} clients connected (max-clients {})", n, max);
  const std::size_t share = max / opts_.allowed_uids.size();
  const std::size_t mine = router_.clients_of_uid(uid);
  if (n >= max - max / 4 && mine >= share)
    return fmt::format("router full for uid {}: it has {} of {} clients connected, and its share of "
                       "max-clients {} among {} uids is {}",
                       uid, mine, n, max, opts_.allowed_uids.size(), share);
  return {};
}

// Idempotent; also cleans up after a listener that was opened but never started.
void Listener::stop_accepting() {
  accepting_ = false;
  *alive_ = false;
  pause_.cancel();
  std::error_code ec;
  socket_.close(ec);
  if (fd_ >= 0) {  // opened, never started
    ::close(fd_);
    fd_ = -1;
  }
  if (unlink_path_) {
    if (::unlink(unlink_path_->c_str()) != 0 && errno != ENOENT)
      log().warn("listener: cannot remove {}: {}", *unlink_path_, errno_text(errno));
    unlink_path_.reset();
  }
}

void Listener::on_shutdown_begin() {
  stop_accepting();
  log().info("listener: stopped accepting clients on {}", address_text_);
  broker_.participant_drained(this);
}

}  // namespace spindle
