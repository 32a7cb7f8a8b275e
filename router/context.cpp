#include "router/context.h"

#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <fmt/format.h>

#include "broker/errors.h"
#include "broker/log.h"

namespace spindle {

ChildProcess::~ChildProcess() {
  if (pidfd_ >= 0) ::close(pidfd_);
}

std::optional<int> ChildProcess::reap() {
  std::lock_guard lk(mu_);
  if (status_) return status_;
  int st = 0;
  pid_t r;
  do {
    r = ::waitpid(pid_, &st, WNOHANG);
  } while (r < 0 && errno == EINTR);
  if (r == pid_) status_ = st;
  else if (r < 0) log().warn("waitpid({}): {}", pid_, errno_text(errno));
  return status_;
}

std::optional<int> ChildProcess::wait(std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    if (auto st = reap()) return st;
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return std::nullopt;
    // The pidfd becomes readable when the child exits.
    pollfd p{pidfd_, POLLIN, 0};
    int n = ::poll(&p, 1, static_cast<int>(left.count()));
    if (n < 0 && errno != EINTR) throw Error(std::string("poll(pidfd): ") + errno_text(errno));
  }
}

std::string describe_wait_status(int st) {
  if (WIFEXITED(st)) return fmt::format("exited with status {}", WEXITSTATUS(st));
  if (WIFSIGNALED(st)) return fmt::format("killed by signal {} ({})", WTERMSIG(st), ::sigdescr_np(WTERMSIG(st)));
  return fmt::format("wait status {:#x}", st);
}

std::future<Message> Context::call_async(std::uint32_t handle, Payload data,
                                         std::chrono::milliseconds timeout) const {
  return router_->request(Message::make(id_, handle, std::move(data)), timeout);
}

Payload Context::call(std::uint32_t handle, Payload data, std::chrono::milliseconds timeout) const {
  return router_->call(Message::make(id_, handle, std::move(data)), timeout).data;
}

std::string Context::call(std::uint32_t handle, std::string_view data,
                          std::chrono::milliseconds timeout) const {
  return call(handle, Payload::copy_of(data), timeout).to_string();
}

void Context::send(std::uint32_t handle, Payload data) const {
  router_->send(Message::make(id_, handle, std::move(data)));
}

void Context::send(std::uint32_t handle, std::string_view bytes) const {
  router_->send(Message::make(id_, handle, Payload::copy_of(bytes)));
}

void Context::shutdown() const {
  router_->send(Message::make(id_, kHandleShutdown, {}, kEncMitogen));
}

std::optional<int> Context::wait_exit(std::chrono::milliseconds timeout) const {
  if (!process_) throw Error(fmt::format("context {} is not a child process of this one", id_));
  return process_->wait(timeout);
}

}  // namespace spindle
