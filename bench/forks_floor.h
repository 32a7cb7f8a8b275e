// The physical floor of the forks-scaling scenario (tests/forks_scaling.h):
// the same workers with no Spindle in them.
//
// fork()+_exit() alone, the floor issue 12 names, leaves out every message:
// a scenario worker also connects and makes its hops through a router
// process. This floor keeps them and drops everything else. N workers are
// forked the same way (before the timer starts, from this process as it is)
// and released together; each connects to an echo server process (one
// thread, epoll, where spindle-router sits), makes `round_trips` round trips
// of 64 bytes with blocking read() and write(), and exits. One of them is
// the scenario's barrier: the server answers that "hello" only once all N
// workers have sent theirs, as the coordinator does, so all N are alive at
// once here too. The scenario's worker makes 2K + 8 hops (K pings there and
// back; its call to the coordinator and its call to a sibling, 4 hops each),
// so the floor's round trips are K + 4, the hello after the K-th. What
// Spindle adds on top is its own: a broker thread, the handshake, framing,
// accounting, the ping service's hand-off, and the pages they touch in a
// freshly forked process.
//
// Thread safety: call it from a thread of a process that has no other thread
// (it forks). Errors in this process throw (std::runtime_error, or Error for
// a bad path); the forked server and workers never throw, they exit with a
// status, and a worker that fails counts in `failures`.
#pragma once

#include <signal.h>
#include <fcntl.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench/relay.h"
#include "router/unix_address.h"

namespace spindle::bench {

inline constexpr const char* kErrFloorServer = "forks floor: the echo server did not start";
inline constexpr std::size_t kFloorMessage = 64;
inline constexpr char kFloorHello = 'H';  // msg[1] of the barrier's round trip

struct ExchangeFloor {
  double wall_ms = 0;  // release to the last worker reaped
  int failures = 0;
};

namespace forks_floor {

// Where the echo server listens; built once, before anything forks.
struct Address {
  sockaddr_un sun{};
  socklen_t len = 0;
};

// writev_all() throws; in a forked child that ends the process instead.
inline void echo(int fd, iovec iov) noexcept {
  try {
    writev_all(fd, &iov, 1);
  } catch (...) {
    ::_exit(3);
  }
}

// The echo server's whole life: accept, echo what arrives, until SIGTERM;
// hellos are held until `workers` of them came. It reports readiness with
// one byte on `ready`. Never returns. A worker writes one message and waits
// for it, so a read returns at most one.
// Runs in a forked child: an error ends the process, never unwinds into the
// parent's code.
[[noreturn]] inline void serve(const Address& a, int ready, int workers) noexcept {
  int lfd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  int ep = ::epoll_create1(EPOLL_CLOEXEC);
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = lfd;
  if (lfd < 0 || ::bind(lfd, reinterpret_cast<const sockaddr*>(&a.sun), a.len) != 0 || ::listen(lfd, 4096) != 0 ||
      ep < 0 || ::epoll_ctl(ep, EPOLL_CTL_ADD, lfd, &ev) != 0)
    ::_exit(2);
  if (::write(ready, "r", 1) != 1) ::_exit(2);
  char buf[65536];
  epoll_event evs[64];
  std::vector<int> hellos;
  for (;;) {
    int n = ::epoll_wait(ep, evs, 64, -1);
    if (n < 0 && errno != EINTR) ::_exit(3);
    for (int i = 0; i < n; ++i) {
      int fd = evs[i].data.fd;
      if (fd == lfd) {
        for (int c; (c = ::accept4(lfd, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK)) >= 0;) {
          epoll_event cev{};
          cev.events = EPOLLIN;
          cev.data.fd = c;
          if (::epoll_ctl(ep, EPOLL_CTL_ADD, c, &cev) != 0) ::_exit(3);
        }
        continue;
      }
      ssize_t r = ::read(fd, buf, sizeof buf);
      iovec iov{buf, static_cast<std::size_t>(r > 0 ? r : 0)};
      if (r > 1 && buf[1] == kFloorHello) {
        hellos.push_back(fd);
        if (static_cast<int>(hellos.size()) < workers) continue;
        for (int h : hellos) echo(h, iov);
        hellos.clear();
      } else if (r > 0) {
        echo(fd, iov);
      } else if (r == 0 || (errno != EAGAIN && errno != EINTR)) {
        ::close(fd);  // also leaves the epoll set
      }
    }
  }
}

// A worker's life after release: connect, round trips, exit.
[[noreturn]] inline void work(const Address& a, int release, int round_trips, int hello_at) noexcept {
  char go;
  if (::read(release, &go, 1) != 1) ::_exit(3);
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0 || ::connect(fd, reinterpret_cast<const sockaddr*>(&a.sun), a.len) != 0) ::_exit(4);
  char msg[kFloorMessage] = {};
  char back[kFloorMessage];
  for (int i = 0; i < round_trips; ++i) {
    msg[0] = static_cast<char>(i);
    msg[1] = i == hello_at ? kFloorHello : 0;
    if (::write(fd, msg, sizeof msg) != static_cast<ssize_t>(sizeof msg)) ::_exit(5);
    try {
      if (!read_exact(fd, back, sizeof back) || back[0] != msg[0]) ::_exit(6);
    } catch (...) {
      ::_exit(6);
    }
  }
  ::_exit(0);
}

}  // namespace forks_floor

// One burst of n raw workers against an echo server at `path` (a socket
// path that does not exist yet), in the same shape as scaling::run(): K
// ping round trips, the hello, three more.
inline ExchangeFloor exchange_floor(int n, int pings, const std::string& path) {
  using Clock = std::chrono::steady_clock;
  forks_floor::Address addr;
  addr.len = UnixAddress::parse(path).to_sockaddr(addr.sun);  // throws here, not in a child
  int ready[2], release[2];
  if (::pipe2(ready, O_CLOEXEC) != 0 || ::pipe2(release, O_CLOEXEC) != 0)
    relay_fail("forks floor: pipe2");
  pid_t server = ::fork();
  if (server < 0) relay_fail("forks floor: fork");
  if (server == 0) forks_floor::serve(addr, ready[1], n);
  ::close(ready[1]);
  char r;
  const bool up = ::read(ready[0], &r, 1) == 1;
  ::close(ready[0]);
  if (!up) {
    ::waitpid(server, nullptr, 0);
    throw std::runtime_error(kErrFloorServer);
  }
  std::vector<pid_t> pids;
  for (int i = 0; i < n; ++i) {
    pid_t p = ::fork();
    if (p < 0) break;  // counted below as failures
    if (p == 0) {
      ::close(release[1]);
      forks_floor::work(addr, release[0], pings + 4, pings);
    }
    pids.push_back(p);
  }
  ::close(release[0]);
  ExchangeFloor out;
  out.failures = n - static_cast<int>(pids.size());
  const std::string go(pids.size(), 'g');
  auto t0 = Clock::now();
  if (::write(release[1], go.data(), go.size()) != static_cast<ssize_t>(go.size()))
    relay_fail("forks floor: release");
  for (pid_t p : pids) {  // by pid: this process has other children (a zygote, the server)
    int st = 0;
    if (::waitpid(p, &st, 0) < 0 || !(WIFEXITED(st) && WEXITSTATUS(st) == 0)) ++out.failures;
  }
  out.wall_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  ::close(release[1]);
  ::kill(server, SIGTERM);
  ::waitpid(server, nullptr, 0);
  ::unlink(path.c_str());
  return out;
}

}  // namespace spindle::bench
