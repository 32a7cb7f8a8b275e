// Context: the caller's handle on another context (usually a child).
//
// Role: names a context by id and makes calls to it through a Router:
// call() blocks, call_async() returns a future, send() expects no reply.
// A remote exception arrives as CallError, a dead reply as ChannelError, a
// deadline as TimeoutError; a respondent that disconnects fails its pending
// calls at once. For a child process the Context also knows its pid and can
// wait for its exit status.
//
// Thread safety: any thread. Copies share the same child-process state.
// Ownership: borrows the Router, which must outlive every Context.
#pragma once

#include <chrono>
#include <cstdint>
#include <future>
#include <memory>
#include <optional>
#include <string>

#include "broker/process.h"
#include "router/router.h"

namespace spindle {

class Context {
 public:
  static constexpr std::chrono::milliseconds kDefaultTimeout{30000};

  Context(Router& router, std::uint32_t id, std::string name,
          std::shared_ptr<ChildProcess> process = nullptr)
      : router_(&router), id_(id), name_(std::move(name)), process_(std::move(process)) {}

  std::uint32_t id() const { return id_; }
  const std::string& name() const { return name_; }
  pid_t pid() const { return process_ ? process_->pid() : 0; }
  Router& router() const { return *router_; }

  Payload call(std::uint32_t handle, Payload data,
               std::chrono::milliseconds timeout = kDefaultTimeout) const;
  std::string call(std::uint32_t handle, std::string_view data,
                   std::chrono::milliseconds timeout = kDefaultTimeout) const;
  // The future throws CallError, ChannelError or TimeoutError from get().
  std::future<Message> call_async(std::uint32_t handle, Payload data,
                                  std::chrono::milliseconds timeout = kDefaultTimeout) const;
  void send(std::uint32_t handle, Payload data) const;
  // The same for bytes the caller keeps: they are copied into the send queue
  // (no Payload of their own).
  void send(std::uint32_t handle, std::string_view bytes) const;
  // Asks the context to shut down gracefully (SHUTDOWN).
  void shutdown() const;
  // Child processes only: waits for exit and returns the wait status.
  std::optional<int> wait_exit(std::chrono::milliseconds timeout = kDefaultTimeout) const;

 private:
  Router* router_;
  std::uint32_t id_;
  std::string name_;
  std::shared_ptr<ChildProcess> process_;
};

}  // namespace spindle
