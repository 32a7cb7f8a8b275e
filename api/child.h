// Children: what a child context's main gets (ChildEnv), how a child is
// started (ChildOptions), and the parent's owner of it (Child).
//
// A child's main registers what it serves, then serves until its parent
// says SHUTDOWN:
//   int child_main(spindle::ChildEnv& env) {
//     env.expose(square, [](long n) { return n * n; });
//     return env.serve();
//   }
// Exposed functions never run on the broker thread: serve() runs them one
// at a time, in arrival order, on the thread that called it (main's), as
// Mitogen does; serve(spindle::Pool{.threads = 4}) runs them concurrently on
// 4 worker threads of their own while the calling thread waits. By default
// only the parent may call them (Allow::kParent).
//
// Child: a move-only owner of the process. Its destructor sends SHUTDOWN,
// waits the grace period for the child to exit, then SIGKILLs and reaps it.
// It is a Context, so it takes calls; copy it into a Context to share a
// handle that does not own the process.
//
// Thread safety: ChildEnv is used by the child's main thread. A Child is
// used like a Context; its destructor never blocks the broker thread (there
// it only sends SHUTDOWN, and the broker reaps the child).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <spindle/codec.h>
#include <spindle/context.h>
#include <spindle/method.h>
#include <spindle/options.h>

namespace spindle {

class Broker;
namespace detail {
struct Exposed;
}

// Where serve(Pool) runs exposed functions: on `threads` worker threads of
// their own, concurrently (a function then guards what it shares).
struct Pool {
  std::size_t threads = 4;  // 1..1024
};

// Who may call an exposed function.
enum class Allow {
  kParent,  // this context's parent (and this context itself)
  kAnyone,  // every context that can reach this one
  // The parent and every context above it, up to the root (a hop's own
  // parent is the context that started it, but the root above may ask it to
  // start the next hop). Not a sibling: another child of the parent, or
  // another client of the router above, is refused, although its calls too
  // come through the parent link.
  kUpstream,
};

class ChildEnv {
 public:
  ChildEnv(Router& router, Broker& broker);
  ~ChildEnv();
  ChildEnv(const ChildEnv&) = delete;
  ChildEnv& operator=(const ChildEnv&) = delete;

  std::uint32_t id() const;
  Context parent();

  // Exposes `fn` as `m`. A function that cannot be called as R(A...) does
  // not compile. Call before serve(). Throws Error for a name exposed twice.
  template <class R, class... A, class F>
  void expose(const method<R(A...)>& m, F fn, Allow allow = Allow::kParent) {
    static_assert(std::is_invocable_r_v<R, F&, A...>,
                  "spindle::ChildEnv::expose: the function cannot be called with the method's "
                  "argument types, or does not return its result type");
    auto f = std::make_shared<F>(std::move(fn));
    expose_encoded(m.name(), allow, [f, r = &router_](const Payload& bytes) -> Payload {
      auto args = [&] {
        detail::DecodingScope scope(*r);  // for Senders among the arguments
        return detail::decode_args<A...>(bytes);
      }();
      if constexpr (std::is_void_v<R>) {
        std::apply(*f, std::move(args));
        return detail::encode_void();
      } else {
        return detail::encode_value<R>(static_cast<R>(std::apply(*f, std::move(args))));
      }
    });
  }
  // The untyped form underneath: `fn` takes the msgpack array of arguments
  // and returns one msgpack value.
  void expose_encoded(std::string_view name, Allow allow, std::function<Payload(const Payload&)> fn);

  // Declares the handlers registered: messages that waited for them are
  // dispatched (or answered "invalid handle"). With functions exposed and
  // serve() not begun yet, it leaves that to serve(): calls to the exposed
  // functions wait for it rather than being refused. Idempotent.
  void ready();
  // ready(), then runs exposed functions on this thread until the parent
  // asks this context to shut down or the parent link is lost. Returns 0,
  // so that `return env.serve();` ends main cleanly.
  int serve();
  // The same, but the functions run concurrently on pool.threads workers
  // (calls still in flight at SHUTDOWN get up to 5 s to finish). Throws
  // Error for 0 threads or more than 1024.
  int serve(Pool pool);

  // Internal: expose_encoded() for a function that never blocks and takes
  // microseconds (the agent's spindle.echo): it runs on the thread that
  // receives the call, not on serve()'s, so it never waits behind a slow
  // call and costs no hand-off. Only with serve(Pool).
  void expose_on_receiver(std::string_view name, Allow allow, std::function<Payload(const Payload&)> fn);
  // Internal: the machinery underneath, for the project's own tests.
  Router& router() { return router_; }
  Broker& broker() { return broker_; }

 private:
  int serve_on(std::size_t threads);  // 0: on this thread
  void add_exposed(std::string_view name, Allow allow, std::function<Payload(const Payload&)> fn,
                   bool on_receiver);

  Router& router_;
  Broker& broker_;
  std::shared_ptr<detail::Exposed> exposed_;
};

using ChildMain = std::function<int(ChildEnv&)>;

enum class ChildTransport { kSocketPair, kStdio };

// Which of the parent's fds a child started by fork_child() keeps (stdin,
// stdout and stderr always stay). spawn_child() execs a program instead: it
// passes stdio, the link and ChildOptions::pass_fds, as Python's subprocess
// does.
class FdPolicy {
 public:
  enum class Kind { kCloseSpindle, kCloseAllExcept, kInheritAll };
  // The default: the child closes the fds Spindle opened in the parent (its
  // links to other contexts, its listener, its broker's, memfds and fds of
  // messages in flight) and keeps every other at its number: what the
  // parent's own code opened is still there for the child's code.
  static FdPolicy close_spindle_fds() { return FdPolicy(Kind::kCloseSpindle, {}); }
  // The child keeps only `keep` (and stdio): the closest to a fresh exec.
  static FdPolicy close_all_except(std::vector<int> keep);
  // The child keeps every fd, Spindle's too.
  static FdPolicy inherit_all() { return FdPolicy(Kind::kInheritAll, {}); }

  FdPolicy() = default;
  Kind kind() const { return kind_; }
  const std::vector<int>& kept() const { return keep_; }  // ascending

 private:
  FdPolicy(Kind k, std::vector<int> keep) : kind_(k), keep_(std::move(keep)) {}
  Kind kind_ = Kind::kCloseSpindle;
  std::vector<int> keep_;
};

struct ChildOptions {
  std::string name;                                        // default "child-<id>"
  ChildTransport transport = ChildTransport::kSocketPair;  // spawn_child only
  RouterOptions router;                                    // the child's router settings
  // How long ~Child waits for the child to exit after SHUTDOWN before SIGKILL.
  std::chrono::milliseconds grace{5000};
  FdPolicy fds;                  // fork_child only
  std::vector<int> pass_fds;     // spawn_child only: kept at their numbers (>= 3)
};

class Child : public Context {
 public:
  Child() = default;
  Child(Context context, std::chrono::milliseconds grace)
      : Context(std::move(context)), grace_(grace) {}
  Child(Child&& o) noexcept
      : Context(std::move(static_cast<Context&>(o))), grace_(o.grace_), status_(o.status_),
        stopped_(o.stopped_) {}
  Child& operator=(Child&& o) noexcept;
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;
  ~Child();

  // SHUTDOWN, up to the grace period for the child to exit, then SIGKILL;
  // the child is reaped. Returns its wait status (-1 if this Child owns no
  // process). Idempotent: later calls return the same status.
  int stop() noexcept;
  // A handle on the same context that does not own the process.
  Context context() const { return *this; }

 private:
  std::chrono::milliseconds grace_{5000};
  int status_ = -1;
  bool stopped_ = false;
};

}  // namespace spindle
