// The zygote is a fork of the parent taken while the parent is small. It
// serves one request at a time on a SOCK_SEQPACKET socket pair: a request is
// one datagram (a fixed Request, the child's name, the argument bytes) with
// the child's end of a fresh link attached by SCM_RIGHTS; the reply is one
// Reply datagram. Datagrams keep request and reply boundaries without a
// framing layer of our own, and the parent and the zygote are the same
// binary, so the structs travel as they are.
//
// The child is made with clone3(CLONE_PARENT): its parent is the zygote's
// parent, so the parent's broker watches and reaps it as it does any child
// (router/child.cpp). A raw clone skips what glibc's fork() does in the
// child. The zygote has one thread, so no lock can be held and no atfork
// handler has work to do; what remains is the thread id that glibc caches in
// the thread's descriptor (pthread_getcpuclockid(), pthread_setschedparam()
// and the like on the main thread use it): the kernel writes it there,
// through CLONE_CHILD_SETTID, at the address
// glibc registered with set_tid_address(), which PR_GET_TID_ADDRESS reports.
// That is what glibc's own fork() does.
#include "router/zygote.h"

#include <dlfcn.h>
#include <linux/sched.h>  // struct clone_args, CLONE_*
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <system_error>
#include <vector>

#include <fmt/format.h>

#include "broker/errors.h"
#include "broker/fd_registry.h"
#include "broker/fork_park.h"
#include "router/child_internal.h"
#include "stream/fd_control.h"

namespace spindle {
namespace {

constexpr std::size_t kMaxName = 4096;
constexpr int kReplyTimeoutMs = 10'000;

constexpr const char* kZygoteGone = "the zygote is gone";
constexpr const char* kNoTidAddress =
    "the zygote cannot start: this kernel does not report a thread's tid address "
    "(prctl PR_GET_TID_ADDRESS, which needs CONFIG_CHECKPOINT_RESTORE)";
constexpr const char* kRefusedNotCode =
    "the zygote refused: the child's function is not in code the zygote has loaded "
    "(was its library dlopen()ed after Zygote::start()?)";
constexpr const char* kRefusedBadRequest = "the zygote refused a malformed request";

// RouterOptions without its name (which travels as bytes of its own). A
// field added to RouterOptions must be added here and in both functions below.
struct WireOptions {
  std::uint64_t high_water_mark, fd_quota, memfd_threshold, peer_memory_limit, memory_limit,
      outbox_size, fd_limit;
  std::int64_t handshake_timeout_ms, stall_timeout_ms, wait_spin_us;
  double peer_log_rate, peer_log_burst;
  std::uint32_t max_message_size;
  std::uint8_t unidirectional, accept_client_logs, own_thread_polls;
};

WireOptions to_wire(const RouterOptions& o) {
  return {o.high_water_mark,       o.fd_quota,
          o.memfd_threshold,       o.peer_memory_limit,
          o.memory_limit,          o.outbox_size,
          o.fd_limit,
          o.handshake_timeout.count(), o.stall_timeout.count(), o.wait_spin.count(),
          o.peer_log_rate,         o.peer_log_burst,
          o.max_message_size,      o.unidirectional,
          o.accept_client_logs,    o.own_thread_polls};
}

RouterOptions from_wire(const WireOptions& w, std::string name) {
  RouterOptions o;
  o.name = std::move(name);
  o.max_message_size = w.max_message_size;
  o.high_water_mark = w.high_water_mark;
  o.handshake_timeout = std::chrono::milliseconds(w.handshake_timeout_ms);
  o.unidirectional = w.unidirectional != 0;
  o.fd_quota = w.fd_quota;
  o.fd_limit = w.fd_limit;
  o.memfd_threshold = w.memfd_threshold;
  o.peer_memory_limit = w.peer_memory_limit;
  o.memory_limit = w.memory_limit;
  o.stall_timeout = std::chrono::milliseconds(w.stall_timeout_ms);
  o.wait_spin = std::chrono::microseconds(w.wait_spin_us);
  o.own_thread_polls = w.own_thread_polls != 0;
  o.outbox_size = w.outbox_size;
  o.accept_client_logs = w.accept_client_logs != 0;
  o.peer_log_rate = w.peer_log_rate;
  o.peer_log_burst = w.peer_log_burst;
  return o;
}

struct Request {
  std::uint64_t main;  // the ZygoteMain, as an integer
  std::uint32_t id, name_size, arg_size;
  WireOptions options;
};

enum class Refusal : std::uint32_t { kNone, kBadRequest, kNotCode, kNoTidAddress };

// The zygote's answer to a request (pid or why not), and its hello at start
// (pid 0, refusal kNone when it is ready).
struct Reply {
  std::int32_t pid = 0;  // > 0: the child
  std::int32_t error = 0;  // errno of a failed clone3
  Refusal refusal = Refusal::kNone;
};

// ---------------------------------------------------------------- zygote side

void send_reply(int sock, const Reply& r) {
  // MSG_NOSIGNAL: a parent that went away is seen as EOF on the next read.
  while (::send(sock, &r, sizeof r, MSG_NOSIGNAL) < 0 && errno == EINTR) {
  }
}

pid_t clone_as_sibling(int* tid_address) {
  clone_args args;
  std::memset(&args, 0, sizeof args);
  args.flags = CLONE_PARENT | CLONE_CHILD_SETTID | CLONE_CHILD_CLEARTID;
  args.child_tid = reinterpret_cast<std::uintptr_t>(tid_address);
  // exit_signal stays 0: clone3 refuses one with CLONE_PARENT. The child
  // takes the zygote's, SIGCHLD (the zygote was made by fork()).
  return static_cast<pid_t>(::syscall(SYS_clone3, &args, sizeof args));
}

// Checks one request; kNone if the child may be forked.
Refusal check_request(const char* data, std::size_t size, Request& req) {
  if (size < sizeof req) return Refusal::kBadRequest;
  std::memcpy(&req, data, sizeof req);
  if (req.name_size > kMaxName || req.arg_size > Zygote::kMaxArg ||
      size != sizeof req + req.name_size + req.arg_size)
    return Refusal::kBadRequest;
  Dl_info info;
  if (req.main == 0 || ::dladdr(reinterpret_cast<void*>(static_cast<std::uintptr_t>(req.main)), &info) == 0)
    return Refusal::kNotCode;
  return Refusal::kNone;
}

// One request: checks it, forks the child (which runs it over `link`),
// answers. Takes `link`.
void serve_request(int sock, int* tid_address, const char* data, std::size_t size, int link) {
  Request req;
  if (const Refusal r = check_request(data, size, req); r != Refusal::kNone) {
    ::close(link);
    return send_reply(sock, {0, 0, r});
  }
  const pid_t pid = clone_as_sibling(tid_address);
  if (pid == 0) {
    const auto main = reinterpret_cast<ZygoteMain>(static_cast<std::uintptr_t>(req.main));
    const std::string_view arg(data + sizeof req + req.name_size, req.arg_size);
    detail::run_forked_child(link, req.id, from_wire(req.options, std::string(data + sizeof req, req.name_size)),
                             [main, arg](ChildEnv& env) { return main(env, arg); },
                             FdPolicy::close_all_except({}));
  }
  const int err = pid < 0 ? errno : 0;
  ::close(link);
  send_reply(sock, {pid > 0 ? pid : 0, err, Refusal::kNone});
}

[[noreturn]] void zygote_main(int sock) {
  detail::close_other_fds(sock);
  int* tid_address = nullptr;
  if (::prctl(PR_GET_TID_ADDRESS, &tid_address) != 0 || tid_address == nullptr) {
    send_reply(sock, {0, 0, Refusal::kNoTidAddress});
    ::_exit(1);
  }
  send_reply(sock, {});  // ready
  std::vector<char> buf(sizeof(Request) + kMaxName + Zygote::kMaxArg + 1);
  for (;;) {
    iovec iov{buf.data(), buf.size()};
    FdControl control;
    msghdr mh{};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    control.receive_into(mh);
    ssize_t n = ::recvmsg(sock, &mh, MSG_CMSG_CLOEXEC);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) ::_exit(0);  // the parent closed its end, or is gone
    // Exactly one fd is expected; any other is closed, and then refused.
    int link = -1, fds = 0;
    FdControl::for_each_received(mh, [&](int fd) {
      if (fds++ == 0)
        link = fd;
      else
        ::close(fd);
    });
    if (fds != 1 || (mh.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) != 0) {
      if (link >= 0) ::close(link);
      send_reply(sock, {0, 0, Refusal::kBadRequest});
      continue;
    }
    serve_request(sock, tid_address, buf.data(), static_cast<std::size_t>(n), link);
  }
}

// ---------------------------------------------------------------- parent side

// Waits up to kReplyTimeoutMs for the zygote's next datagram.
bool receive_reply(int sock, Reply& r, std::string& why) {
  pollfd p{sock, POLLIN, 0};
  int rc;
  while ((rc = ::poll(&p, 1, kReplyTimeoutMs)) < 0 && errno == EINTR) {
  }
  if (rc < 0) return why = fmt::format("poll: {}", errno_text(errno)), false;
  if (rc == 0) return why = fmt::format("no answer within {} ms", kReplyTimeoutMs), false;
  ssize_t n;
  while ((n = ::recv(sock, &r, sizeof r, 0)) < 0 && errno == EINTR) {
  }
  if (n < 0) return why = errno_text(errno), false;
  if (n != static_cast<ssize_t>(sizeof r)) return why = "it closed its socket", false;
  return true;
}

const char* refusal_text(Refusal r) {
  switch (r) {
    case Refusal::kNotCode: return kRefusedNotCode;
    case Refusal::kNoTidAddress: return kNoTidAddress;
    default: return kRefusedBadRequest;
  }
}

}  // namespace

std::unique_ptr<Zygote> Zygote::start() {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) < 0)
    throw Error(fmt::format("Zygote::start: socketpair: {}", errno_text(errno)));
  fd_registry::note(sv[0]);
  std::fflush(nullptr);  // the zygote's children must not flush our buffers again
  // Every broker of this process parked, as fork_child() does: the zygote is
  // a copy of the whole process, and each child it clones a copy of that,
  // so a lock a broker held at this instant (GCC 12's ASan allocator's, for
  // one) would be held in every child. Once, in an ASan CI run (2026-11-29),
  // all 16 children of
  // Zygote.ChildrenOutliveTheZygoteAndForksFromManyThreadsAllAnswer hung
  // before their handshake, from a zygote started beside a running broker.
  pid_t pid;
  {
    fork_park::Parked parked = fork_park::park_all(nullptr);
    pid = ::fork();
    if (pid == 0) parked.abandon();
  }
  if (pid < 0) {
    const int err = errno;
    ::close(sv[0]);
    ::close(sv[1]);
    throw Error(fmt::format("Zygote::start: fork: {}", errno_text(err)));
  }
  if (pid == 0) zygote_main(sv[1]);
  ::close(sv[1]);
  std::unique_ptr<Zygote> z(new Zygote(pid, sv[0]));
  Reply hello;
  std::string why;
  if (!receive_reply(z->socket_, hello, why)) throw Error(fmt::format("Zygote::start: {}: {}", kZygoteGone, why));
  if (hello.refusal != Refusal::kNone) throw Error(refusal_text(hello.refusal));
  return z;
}

Zygote::~Zygote() {
  ::close(socket_);  // the zygote sees EOF and exits
  int status;
  while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
  }
}

Context Zygote::fork_child(Router& parent, ZygoteMain main, std::string_view arg, ChildOptions opts) {
  if (main == nullptr) throw Error("Zygote::fork_child: no function to run");
  if (arg.size() > kMaxArg)
    throw Error(fmt::format("Zygote::fork_child: an argument of {} bytes is over the limit of {}; "
                            "send larger data over the link once the child runs",
                            arg.size(), kMaxArg));
  if (opts.name.size() > kMaxName)
    throw Error(fmt::format("Zygote::fork_child: a name of {} bytes is over the limit of {}",
                            opts.name.size(), kMaxName));
  const std::uint32_t id = parent.allocate_id();
  const std::string name = detail::child_name(id, opts);
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0)
    throw std::system_error(errno, std::generic_category(), "socketpair");
  fd_registry::note(sv[0]);

  Request req{};
  req.main = reinterpret_cast<std::uintptr_t>(main);
  req.id = id;
  req.name_size = static_cast<std::uint32_t>(name.size());
  req.arg_size = static_cast<std::uint32_t>(arg.size());
  req.options = to_wire(opts.router);
  iovec iov[3] = {{&req, sizeof req},
                  {const_cast<char*>(name.data()), name.size()},
                  {const_cast<char*>(arg.data()), arg.size()}};
  msghdr mh{};
  mh.msg_iov = iov;
  mh.msg_iovlen = 3;
  FdControl control;
  control.attach(mh, std::span<const int>(&sv[1], 1));

  Reply reply;
  std::string why;
  {
    std::lock_guard lk(mu_);
    bool ok = !broken_;
    if (!ok) {
      why = "an earlier request went unanswered";
    } else {
      ssize_t n;
      while ((n = ::sendmsg(socket_, &mh, MSG_NOSIGNAL)) < 0 && errno == EINTR) {
      }
      if (n < 0) why = fmt::format("sendmsg: {}", errno_text(errno));
      ok = n >= 0 && receive_reply(socket_, reply, why);
      broken_ = !ok;
    }
    if (!ok) {
      ::close(sv[0]);
      ::close(sv[1]);
      throw Error(fmt::format("Zygote::fork_child: {} (pid {}): {}", kZygoteGone, pid_, why));
    }
  }
  ::close(sv[1]);
  if (reply.pid <= 0) {
    ::close(sv[0]);
    if (reply.refusal != Refusal::kNone) throw Error(refusal_text(reply.refusal));
    throw std::system_error(reply.error, std::generic_category(), "the zygote's clone3");
  }
  return detail::adopt_child(parent, sv[0], sv[0], id, name, reply.pid);
}

Child Zygote::fork_child(Runtime& rt, ZygoteMain main, std::string_view arg, ChildOptions opts) {
  auto grace = opts.grace;
  return Child(fork_child(rt.router(), main, arg, std::move(opts)), grace);
}

}  // namespace spindle
