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
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <spindle/child.h>
#include <spindle/context.h>
#include <spindle/options.h>

namespace spindle {

class Broker;

class Runtime {
 public:
  explicit Runtime(RouterOptions opts = {});
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  std::uint32_t id() const;
  // Forks a child that runs `main`. The parent's threads are not copied;
  // the child builds its own broker. Not on the broker thread.
  Child fork_child(ChildMain main, ChildOptions opts = {});
  // Starts `program` (posix_spawn), which calls spindle::run_spawned_child().
  Child spawn_child(const std::string& program, const std::vector<std::string>& args = {},
                    ChildOptions opts = {});
  // Another context, by id (a sibling, a router client): not owned.
  Context context(std::uint32_t id, std::string name = {}) const;

  // Internal: the machinery underneath, for the project's own tests.
  Router& router();
  Broker& broker();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// In a program started by spawn_child(): attaches to the parent and runs
// main. Returns the process exit code.
int run_spawned_child(ChildMain main, RouterOptions opts = {});

}  // namespace spindle
