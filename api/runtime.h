// Runtime: Spindle in this process: one broker thread and the router that
// delivers this context's messages.
//
//   spindle::Runtime rt;                                // starts the broker thread
//   spindle::Child child = rt.fork_child(child_main);   // a forked child context
//   long r = child.call(square, 7);
//
// It replaces the Broker + Router pair of the internals (a pimpl: nothing of
// Asio, spdlog or Boost reaches the user's includes). Its destructor shuts
// the broker down gracefully (queued messages are flushed within the grace
// period) and joins it; Contexts that outlive it then throw ShutdownError.
//
// Thread safety: any thread. Destroyed on its own broker thread (inside a
// handler), it begins the shutdown and a thread of its own joins the broker
// and frees the rest: a thread cannot join itself.
// Ownership: owns the broker and the router; Children own their processes.
//
// Hosted mode (spindle::hosted_runtime(ioc), in <spindle/hosted.h>): the
// same runtime on the application's asio::io_context, with no thread of its
// own; see that header for its rules.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <spindle/child.h>
#include <spindle/context.h>
#include <spindle/function.h>
#include <spindle/options.h>
#include <spindle/ssh.h>

namespace spindle {

class Broker;

namespace detail {
// What <spindle/hosted.h> hands the library: the application's io_context,
// with the Asio version and object size it was compiled with, which the
// library checks against its own (both must be Debian's Asio).
struct HostedLoop {
  void* io_context;
  unsigned asio_version;
  std::size_t io_context_size;
};
}  // namespace detail

class Runtime {
 public:
  explicit Runtime(RouterOptions opts = {});
  // Hosted mode: use spindle::hosted_runtime(ioc) (<spindle/hosted.h>).
  Runtime(detail::HostedLoop loop, RouterOptions opts);
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;
  // Moving keeps every Context and Child valid (they refer to what the
  // runtime owns, not to the object). A moved-from Runtime may only be
  // destroyed.
  Runtime(Runtime&&) noexcept;
  Runtime& operator=(Runtime&&) = delete;

  std::uint32_t id() const;
  // Forks a child that runs `main`. The parent's threads are not copied;
  // the child builds its own broker. Not on the broker thread.
  Child fork_child(ChildMain main, ChildOptions opts = {});
  // Starts `program` (posix_spawn), which calls spindle::run_spawned_child().
  Child spawn_child(const std::string& program, const std::vector<std::string>& args = {},
                    ChildOptions opts = {});
  // A child context on another host, through OpenSSH (<spindle/ssh.h>).
  // Throws Error, with ssh's exit status and last stderr line, if it cannot
  // be started. Not on the broker thread.
  Child ssh(const std::string& host, SshOptions opts = {});
  // Another context, by id (a sibling, a router client): not owned.
  Context context(std::uint32_t id, std::string name = {}) const;

  // True for a runtime on the application's io_context.
  bool hosted() const;
  // Begins a graceful shutdown (queued messages flushed, children told,
  // within the grace period); `done` runs once it has finished, on the
  // broker thread (a hosted runtime's loop thread), or at once if it has.
  // Destroying the runtime afterwards frees it without waiting.
  void start_shutdown(UniqueFunction<void()> done);
  // start_shutdown() with an Asio completion token, void(std::exception_ptr);
  // defined in <spindle/asio.h> and <spindle/boost_asio.h>.
  template <class Token>
  auto async_shutdown(Token&& token);

  // Internal: the machinery underneath, for the project's own tests.
  Router& router();
  Broker& broker();

 private:
  struct Impl;
  void release_hosted() noexcept;
  std::unique_ptr<Impl> impl_;
};

// In a program started by spawn_child(): attaches to the parent and runs
// main. Returns the process exit code.
int run_spawned_child(ChildMain main, RouterOptions opts = {});

}  // namespace spindle
