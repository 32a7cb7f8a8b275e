// Starting a remote child over ssh: see router/ssh.h. The session's stderr
// lines are logged as the context's, escaped ({:?}) so that one remote line
// stays one log record, and rate-limited (a remote side that floods its
// stderr costs one summary line a second, not the log).
#include "router/ssh.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <mutex>
#include <system_error>

#include <asio/posix/stream_descriptor.hpp>
#include <fmt/format.h>

#include "broker/errors.h"
#include "broker/log.h"
#include "broker/process.h"
#include "router/child_internal.h"
#include "router/ssh_bootstrap.h"
#include "spindle/codec.h"

extern char** environ;

namespace spindle {
namespace {

using Clock = std::chrono::steady_clock;
constexpr std::size_t kMaxLine = 1024;          // longer stderr lines are cut
constexpr std::size_t kMaxBootstrapJunk = 64 << 10;  // what a login shell may print first
constexpr double kStderrLinesPerSecond = 20, kStderrBurst = 100;

[[noreturn]] void throw_errno(const char* what) {
  throw std::system_error(errno, std::generic_category(), what);
}

// What the starting thread, the broker's stderr reader and the close
// explainer share about one session.
class SshSession {
 public:
  SshSession(std::string host, std::string name, std::shared_ptr<ChildProcess> proc)
      : host(std::move(host)), name(std::move(name)), proc(std::move(proc)) {}

  // Splits stderr bytes into lines; logs and remembers each.
  void feed(const char* p, std::size_t n) {
    std::lock_guard lk(mu_);
    for (std::size_t i = 0; i < n; ++i) {
      if (p[i] == '\n') {
        line_done();
      } else if (partial_.size() < kMaxLine) {
        partial_.push_back(p[i]);
      } else {
        ++cut_;
      }
    }
  }
  void flush() {
    std::lock_guard lk(mu_);
    if (!partial_.empty()) line_done();
  }
  std::string last_line() {
    std::lock_guard lk(mu_);
    return last_;
  }

  const std::string host, name;
  const std::shared_ptr<ChildProcess> proc;

 private:
  void line_done() {
    if (cut_) partial_ += fmt::format("... ({} more bytes)", cut_);
    while (!partial_.empty() && (partial_.back() == '\r' || partial_.back() == ' ')) partial_.pop_back();
    if (!partial_.empty()) {
      const auto now = Clock::now();
      if (budget_.take(now, kStderrLinesPerSecond, kStderrBurst)) {
        if (std::uint64_t n = budget_.take_suppressed(now))
          log().warn("stream={} ssh stderr: {} lines not logged (over {}/s)", name, n, kStderrLinesPerSecond);
        log().info("stream={} ssh stderr: {:?}", name, partial_);
      }
      last_ = std::move(partial_);
    }
    partial_.clear();
    cut_ = 0;
  }

  std::mutex mu_;
  std::string partial_, last_;
  std::size_t cut_ = 0;
  LogBudget budget_;
};

// The broker's reader of ssh's stderr, from adoption to the link's end.
class StderrReader : public std::enable_shared_from_this<StderrReader> {
 public:
  StderrReader(asio::io_context& io, int fd, std::shared_ptr<SshSession> session)
      : sd_(io, fd), session_(std::move(session)) {}
  void start() { read(); }
  // Takes whatever is already in the pipe, without waiting, and stops.
  void finish() {
    std::error_code ec;
    sd_.non_blocking(true, ec);
    while (!ec) {
      std::size_t n = sd_.read_some(asio::buffer(buf_), ec);
      if (n) session_->feed(buf_, n);
    }
    session_->flush();
    sd_.close(ec);
  }

 private:
  void read() {
    sd_.async_read_some(asio::buffer(buf_), [self = shared_from_this()](std::error_code ec, std::size_t n) {
      if (n) self->session_->feed(self->buf_, n);
      if (ec) {
        if (ec != asio::error::operation_aborted) self->session_->flush();
        return;
      }
      self->read();
    });
  }

  asio::posix::stream_descriptor sd_;
  std::shared_ptr<SshSession> session_;
  char buf_[4096];
};

// Our ends of ssh's stdio: one socket for its stdin and stdout (a socket
// lets senders on any thread write a frame directly, with MSG_NOSIGNAL,
// where a pipe would need the broker), and a pipe for its stderr.
struct SshPipes {
  int link = -1, err = -1;
  void close_all() {
    for (int* fd : {&link, &err})
      if (*fd >= 0) ::close(std::exchange(*fd, -1));
  }
};

// posix_spawnp(ssh) with that socket and pipe as its stdio, nothing else open.
pid_t spawn_ssh(const std::vector<std::string>& argv, SshPipes& ours) {
  int sv[2] = {-1, -1}, ep[2] = {-1, -1};
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0) throw_errno("socketpair");
  if (::pipe2(ep, O_CLOEXEC) < 0) {
    int err = errno;
    ::close(sv[0]);
    ::close(sv[1]);
    errno = err;
    throw_errno("pipe2");
  }
  posix_spawn_file_actions_t fa;
  int rc = posix_spawn_file_actions_init(&fa);
  if (rc == 0) {
    rc = posix_spawn_file_actions_adddup2(&fa, sv[1], 0);
    if (rc == 0) rc = posix_spawn_file_actions_adddup2(&fa, sv[1], 1);
    if (rc == 0) rc = posix_spawn_file_actions_adddup2(&fa, ep[1], 2);
    if (rc == 0) rc = posix_spawn_file_actions_addclosefrom_np(&fa, 3);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    pid_t pid = -1;
    if (rc == 0) rc = ::posix_spawnp(&pid, argv[0].c_str(), &fa, nullptr, args.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    ::close(sv[1]);
    ::close(ep[1]);
    if (rc == 0) {
      ours.link = sv[0];
      ours.err = ep[0];
      return pid;
    }
  } else {
    ::close(sv[1]);
    ::close(ep[1]);
  }
  ::close(sv[0]);
  ::close(ep[0]);
  throw Error(fmt::format("ssh: cannot run {}: {}", argv[0], std::strerror(rc)));
}

std::shared_ptr<ChildProcess> watch(pid_t pid) {
  int pidfd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
  if (pidfd < 0) {
    int err = errno;
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
    errno = err;
    throw_errno("pidfd_open");
  }
  return std::make_shared<ChildProcess>(pid, pidfd);
}

// "ssh exited with status 255: Permission denied (publickey)."
std::string ended(SshSession& s, std::optional<int> status) {
  std::string what = status ? "ssh " + describe_wait_status(*status) : "ssh is still running";
  std::string last = s.last_line();
  return last.empty() ? what : what + ": " + last;
}

// Runs the bootstrap on this thread until the agent has been started (its
// handshake comes next on `pipes.link`). Throws Error with the reason.
void bootstrap(SshPipes& pipes, const AgentImage& agent, SshSession& session, Clock::time_point deadline) {
  if (::fcntl(pipes.err, F_SETFL, O_NONBLOCK) < 0 || ::fcntl(pipes.link, F_SETFL, O_NONBLOCK) < 0)
    throw_errno("fcntl(O_NONBLOCK)");
  std::string line;
  std::size_t junk = 0, sent = 0;
  bool sending = false, err_open = true;
  auto fail = [&](const std::string& why) -> std::string {
    // ssh has ended or is about to: its status and last words say why.
    auto st = session.proc->wait(std::chrono::milliseconds(2000));
    char buf[4096];
    ssize_t n;
    while (err_open && (n = ::read(pipes.err, buf, sizeof buf)) > 0) session.feed(buf, static_cast<std::size_t>(n));
    session.flush();
    return fmt::format("ssh to {} failed ({}): {}", session.host, why, ended(session, st));
  };
  while (true) {
    auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) {
      session.flush();
      std::string last = session.last_line();
      throw Error(fmt::format("ssh to {}: no agent within the connect timeout{}", session.host,
                              last.empty() ? "" : " (ssh said: " + last + ")"));
    }
    pollfd fds[3] = {{sending ? -1 : pipes.link, POLLIN, 0},
                     {err_open ? pipes.err : -1, POLLIN, 0},
                     {sending ? pipes.link : -1, POLLOUT, 0}};
    int n = ::poll(fds, 3, static_cast<int>(left.count()));
    if (n < 0) {
      if (errno == EINTR) continue;
      throw_errno("poll");
    }
    if (fds[1].revents) {
      char buf[4096];
      ssize_t r = ::read(pipes.err, buf, sizeof buf);
      if (r > 0) session.feed(buf, static_cast<std::size_t>(r));
      else if (r == 0 || (errno != EAGAIN && errno != EINTR)) err_open = false;
    }
    if (fds[0].revents) {
      char c;
      ssize_t r = ::read(pipes.link, &c, 1);
      if (r < 0 && (errno == EINTR || errno == EAGAIN)) continue;
      if (r <= 0) throw Error(fail("the remote command ended before the agent started"));
      // Every byte counts, newlines too: a remote shell that prints endless
      // empty lines (a login script running `yes ''`) must fail here, not
      // spin until the connect timeout. The answer's own line is short, so
      // counting it as well never refuses a real bootstrap.
      if (++junk > kMaxBootstrapJunk)
        throw Error(fmt::format("ssh to {}: the remote shell printed over {} bytes instead of the bootstrap's "
                                "answer", session.host, kMaxBootstrapJunk));
      if (c != '\n') {
        if (line.size() < kMaxLine) line.push_back(c);
        continue;
      }
      if (line == kBootstrapRun) return;
      if (line == kBootstrapSend) {
        log().info("stream={} uploading the agent ({} bytes, sha256 {})", session.name, agent.bytes.size(),
                   agent.sha256.substr(0, 16));
        sending = true;
      } else {
        log().debug("stream={} remote output before the bootstrap answered: {:?}", session.name, line);
      }
      line.clear();
    }
    if (sending && fds[2].revents) {
      std::size_t chunk = std::min<std::size_t>(agent.bytes.size() - sent, 1 << 20);
      ssize_t w = ::send(pipes.link, agent.bytes.data() + sent, chunk, MSG_NOSIGNAL);
      if (w < 0 && (errno == EAGAIN || errno == EINTR)) continue;
      if (w < 0) throw Error(fail(fmt::format("the upload broke off after {} bytes: {}", sent, std::strerror(errno))));
      sent += static_cast<std::size_t>(w);
      if (sent == agent.bytes.size()) return;  // the script verifies it and execs it
    }
  }
}

// The reason a closed ssh link gives its pending calls (broker thread).
std::function<std::string(const std::string&)> explainer(std::shared_ptr<SshSession> session,
                                                         std::shared_ptr<StderrReader> reader) {
  return [session, reader](const std::string& why) {
    // ssh closes its stdout as it exits: its status is there at once or
    // within a few milliseconds. A bounded wait, once per session.
    std::optional<int> st;
    try {
      st = session->proc->wait(std::chrono::milliseconds(100));
    } catch (const std::exception& e) {
      log().warn("stream={} ssh pid={}: {}", session->name, session->proc->pid(), e.what());
    }
    if (!st) {
      // The link is gone; the session is of no further use.
      try {
        session->proc->signal(SIGTERM);
      } catch (const Error& e) {
        log().debug("stream={} cannot stop ssh: {}", session->name, e.what());
      }
    }
    reader->finish();
    return fmt::format("{}; {}", why, ended(*session, st));
  };
}

}  // namespace

Context ssh_child(Router& parent, const std::string& host, const SshOptions& opts) {
  if (parent.broker().on_broker_thread()) throw Error("ssh() would block the broker thread");
  if (opts.via.id() != 0) {
    // The hop's ssh runs there; its context is routed through `via`.
    auto [id, name] = opts.via.with_timeout(opts.connect_timeout + std::chrono::seconds(5))
                          .call<std::tuple<long, std::string>>("spindle.ssh", host, encode_hop_options(opts));
    // The hop says which context it started; it may be compromised. The
    // hop's ADD_ROUTE for that context came on its link before this answer
    // did, so a context it really started is routed through it: any other
    // id (a local child, the hop's parent) would send this process's calls
    // for the remote host somewhere else.
    const auto child = static_cast<std::uint32_t>(id);
    if (id <= 0 || id > static_cast<long>(UINT32_MAX) || child == opts.via.id() ||
        !parent.routed_through(child, opts.via.id()))
      throw Error(fmt::format("ssh: the hop {} answered context {}, which is not routed through it",
                              opts.via.id(), id));
    return Context(parent, child, name);
  }
  const auto deadline = Clock::now() + opts.connect_timeout;
  auto agent = AgentImage::load(find_agent(opts));
  const std::string name = opts.name.empty() ? "ssh:" + host : opts.name;
  auto argv = ssh_argv(host, opts, bootstrap_command(*agent, opts.remote_dir, name));
  const std::uint32_t id = parent.allocate_id();

  SshPipes pipes;
  pid_t pid = spawn_ssh(argv, pipes);
  std::shared_ptr<ChildProcess> proc;
  try {
    proc = watch(pid);
  } catch (...) {
    pipes.close_all();
    throw;
  }
  auto session = std::make_shared<SshSession>(host, name, proc);
  try {
    bootstrap(pipes, *agent, *session, deadline);
    if (::fcntl(pipes.link, F_SETFL, 0) < 0) throw_errno("fcntl");  // the stream sets its own flags
  } catch (...) {
    pipes.close_all();
    proc->finish(std::chrono::milliseconds(0));
    throw;
  }
  int err_fd = std::exchange(pipes.err, -1);
  Context ctx = detail::adopt_child(
      parent, pipes.link, pipes.link, id, name, proc, [&parent, session, err_fd](Stream& s) {
        auto reader = std::make_shared<StderrReader>(parent.broker().io(), err_fd, session);
        reader->start();
        parent.set_close_explainer(s, explainer(session, reader));
      });
  // The stderr fd belongs to the reader now, unless adoption never ran (the
  // broker had shut down): then the explainer never exists and the fd leaks
  // only until this process exits. Rare enough; not worth a second path.
  auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now());
  try {
    ctx.with_timeout(std::max(left, std::chrono::milliseconds(1))).call_named("spindle.info", detail::encode_args());
  } catch (const std::exception& e) {
    proc->finish(std::chrono::milliseconds(0));
    throw Error(fmt::format("ssh to {}: the agent did not answer: {}", host, e.what()));
  }
  return ctx;
}

std::vector<std::string> encode_hop_options(const SshOptions& o) {
  std::vector<std::string> w{"user=" + o.user,
                             "port=" + std::to_string(o.port),
                             "identity_file=" + o.identity_file,
                             "connect_timeout_ms=" + std::to_string(o.connect_timeout.count()),
                             "control_path=" + o.control_path,
                             std::string("batch_mode=") + (o.batch_mode ? "1" : "0"),
                             "ssh_program=" + o.ssh_program,
                             "remote_dir=" + o.remote_dir,
                             "name=" + o.name,
                             "grace_ms=" + std::to_string(o.grace.count())};
  for (const auto& a : o.ssh_args) w.push_back("ssh_arg=" + a);
  return w;
}

SshOptions decode_hop_options(const std::vector<std::string>& words) {
  SshOptions o;
  for (const auto& w : words) {
    auto eq = w.find('=');
    if (eq == std::string::npos) throw Error(fmt::format("spindle.ssh: bad option {:?}", w));
    std::string k = w.substr(0, eq), v = w.substr(eq + 1);
    try {
      if (k == "user") o.user = v;
      else if (k == "port") o.port = std::stoi(v);
      else if (k == "identity_file") o.identity_file = v;
      else if (k == "connect_timeout_ms") o.connect_timeout = std::chrono::milliseconds(std::stoll(v));
      else if (k == "control_path") o.control_path = v;
      else if (k == "batch_mode") o.batch_mode = v == "1";
      else if (k == "ssh_program") o.ssh_program = v;
      else if (k == "remote_dir") o.remote_dir = v;
      else if (k == "name") o.name = v;
      else if (k == "grace_ms") o.grace = std::chrono::milliseconds(std::stoll(v));
      else if (k == "ssh_arg") o.ssh_args.push_back(v);
      else throw Error(fmt::format("spindle.ssh: unknown option {:?}", k));
    } catch (const std::logic_error&) {  // stoi/stoll
      throw Error(fmt::format("spindle.ssh: bad value for {}: {:?}", k, v));
    }
  }
  return o;
}

}  // namespace spindle
