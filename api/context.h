// Context: the caller's handle on another context (a child, a sibling, a
// router client).
//
// Role: names a context by id and makes calls to it.
//  - Typed calls (method.h): call() blocks and returns the result,
//    call_async() returns a std::future, async_call() takes an Asio
//    completion token (<spindle/asio.h>, <spindle/boost_asio.h>).
//    call<R>("name", args...) calls by name, for functions another
//    language exposed.
//  - Raw messages: call(handle, bytes), call_async(handle, bytes) and
//    send(handle, bytes), for handlers registered by number.
// A remote exception arrives as CallError (type() names it), a dead reply as
// ChannelError, a deadline as TimeoutError; a callee that disconnects fails
// its pending calls at once. For a child process the Context also knows its
// pid and can wait for its exit status.
//
// start_call() is the one initiation every asynchronous form is built on:
// its completion, a move-only void(std::exception_ptr, Payload), runs exactly
// once, on the broker thread, with the result bytes or the error.
//
// Thread safety: any thread (the blocking calls not on the broker thread).
// Ownership: a cheap value. It refers to its runtime's router through a link
// the router clears when it is destroyed: a Context used after that throws
// ShutdownError, and never touches freed memory. Copies share the
// child-process state (pid, exit status).
#pragma once

#include <chrono>
#include <cstdint>
#include <exception>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include <sys/types.h>

#include <spindle/codec.h>
#include <spindle/errors.h>
#include <spindle/function.h>
#include <spindle/message.h>
#include <spindle/method.h>
#include <spindle/payload.h>

namespace spindle {

class Router;
class ChildProcess;
class SendBatch;
namespace detail {
struct RouterLink;
}

// The completion of Context::start_call: (nullptr, result bytes) or (error, {}).
using CallCompletion = UniqueFunction<void(std::exception_ptr, Payload)>;

class Context {
 public:
  static constexpr std::chrono::milliseconds kDefaultTimeout{30000};

  Context() = default;  // refers to nothing: every call throws ShutdownError
  Context(Router& router, std::uint32_t id, std::string name,
          std::shared_ptr<ChildProcess> process = nullptr);

  std::uint32_t id() const { return id_; }
  const std::string& name() const { return name_; }
  pid_t pid() const;  // 0 unless a child process of this one
  // The same context with another deadline for its calls (default 30 s).
  Context with_timeout(std::chrono::milliseconds timeout) const;
  std::chrono::milliseconds timeout() const { return timeout_; }

  // --- typed calls ---
  template <class R, class... A, class... Args>
  R call(const method<R(A...)>& m, Args&&... args) const {
    Payload result = call_named(m.name(), detail::encode_args<A...>(std::forward<Args>(args)...));
    if constexpr (!std::is_void_v<R>) {
      detail::DecodingScope scope(router());
      return detail::decode_value<R>(result);
    }
  }
  template <class R, class... A, class... Args>
  std::future<R> call_async(const method<R(A...)>& m, Args&&... args) const {
    return future_of<R>(m.name(), detail::encode_args<A...>(std::forward<Args>(args)...));
  }
  // By name, with the argument types as given: call<long>("square", 5L).
  template <class R, class... Args>
  R call(std::string_view name, Args&&... args) const {
    Payload result = call_named(name, detail::encode_args<std::decay_t<Args>...>(std::forward<Args>(args)...));
    if constexpr (!std::is_void_v<R>) {
      detail::DecodingScope scope(router());
      return detail::decode_value<R>(result);
    }
  }
  // With an Asio completion token; defined in <spindle/asio.h> and, for
  // Boost.Asio, in <spindle/boost_asio.h> (one of the two per translation
  // unit). The last argument is the token, the others the method's arguments.
  template <class R, class... A, class... Rest>
  auto async_call(const method<R(A...)>& m, Rest&&... rest) const;

  // The initiation seam: calls `name` with msgpack-encoded `args`.
  void start_call(std::string_view name, Payload args, CallCompletion done) const;
  // Blocking, by name, with encoded arguments: the result's bytes.
  Payload call_named(std::string_view name, Payload args) const;

  // --- raw messages ---
  Payload call(std::uint32_t handle, Payload data,
               std::chrono::milliseconds timeout = kDefaultTimeout) const;
  std::string call(std::uint32_t handle, std::string_view data,
                   std::chrono::milliseconds timeout = kDefaultTimeout) const;
  // The future throws CallError, ChannelError or TimeoutError from get().
  std::future<Message> call_async(std::uint32_t handle, Payload data,
                                  std::chrono::milliseconds timeout = kDefaultTimeout) const;
  void send(std::uint32_t handle, Payload data) const;
  // The same for bytes the caller keeps: they are copied into the send queue.
  void send(std::uint32_t handle, std::string_view bytes) const;
  // Asks the context to shut down gracefully (SHUTDOWN).
  void shutdown() const;
  // Child processes only: waits for exit and returns the wait status.
  std::optional<int> wait_exit(std::chrono::milliseconds timeout = kDefaultTimeout) const;

  // Internal: the router this context is reached through (ShutdownError once
  // it is gone). The reference is valid only while the runtime lives.
  Router& router() const;

 protected:
  const std::shared_ptr<ChildProcess>& process() const { return process_; }

 private:
  friend class SendBatch;  // takes the runtime's link
  template <class R>
  std::future<R> future_of(std::string_view name, Payload args) const {
    auto promise = std::make_shared<std::promise<R>>();
    std::future<R> f = promise->get_future();
    Router* r = &router();  // alive while the completion can run
    start_call(name, std::move(args), [promise, r](std::exception_ptr error, Payload result) {
      if (error) return promise->set_exception(error);
      try {
        detail::DecodingScope scope(*r);
        if constexpr (std::is_void_v<R>) promise->set_value();
        else promise->set_value(detail::decode_value<R>(result));
      } catch (...) {
        promise->set_exception(std::current_exception());
      }
    });
    return f;
  }

  std::shared_ptr<detail::RouterLink> link_;
  std::uint32_t id_ = 0;
  std::string name_;
  std::shared_ptr<ChildProcess> process_;
  std::chrono::milliseconds timeout_ = kDefaultTimeout;
};

}  // namespace spindle
