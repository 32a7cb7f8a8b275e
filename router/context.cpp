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
