// Runtime is the owner of the Broker + Router pair that the internals use,
// behind a pimpl so that <spindle/runtime.h> names neither. The members are
// declared broker first, so the router (which shuts the broker down and
// joins it) is destroyed before the broker it borrows.
#include "spindle/runtime.h"

#include <memory>
#include <thread>

#include <asio/io_context.hpp>
#include <asio/version.hpp>
#include <fmt/format.h>

#include "broker/broker.h"
#include "broker/errors.h"
#include "broker/log.h"
#include "router/child.h"
#include "router/router.h"
#include "router/ssh.h"

namespace spindle {

struct Runtime::Impl {
  explicit Impl(RouterOptions opts)
      : broker(Broker::options_for(opts)), router(broker, std::move(opts)) {}
  Impl(asio::io_context& loop, RouterOptions opts)
      : broker(loop, Broker::Options{}), router(broker, std::move(opts)) {}
  Broker broker;
  Router router;
};

namespace {

asio::io_context& checked_loop(const detail::HostedLoop& loop) {
  if (!loop.io_context) throw Error("hosted_runtime: no io_context");
  if (loop.asio_version != ASIO_VERSION || loop.io_context_size != sizeof(asio::io_context))
    throw Error(fmt::format(
        "hosted_runtime: the program was compiled against Asio {} (a {}-byte io_context) and "
        "Spindle against Asio {} ({} bytes); a hosted runtime needs the same Asio on both sides",
        loop.asio_version, loop.io_context_size, ASIO_VERSION, sizeof(asio::io_context)));
  return *static_cast<asio::io_context*>(loop.io_context);
}

}  // namespace

Runtime::Runtime(RouterOptions opts) : impl_(std::make_unique<Impl>(std::move(opts))) {}

Runtime::Runtime(Runtime&&) noexcept = default;

Runtime::Runtime(detail::HostedLoop loop, RouterOptions opts)
    : impl_(std::make_unique<Impl>(checked_loop(loop), std::move(opts))) {}

// A hosted runtime that was not shut down is stopped here: on its loop
// thread at once (streams force-closed, pending calls failed), from another
// thread by waiting for the loop to finish it (the loop must be running).
// Handlers of ours still queued on the application's io_context find the
// broker and router gone through their life tokens and do nothing.
void Runtime::release_hosted() noexcept {
  Broker& b = impl_->broker;
  try {
    if (b.state() != Broker::State::kStopped) {
      if (b.on_broker_thread()) {
        b.stop_here();
      } else {
        b.shutdown();
        b.join();
      }
    }
  } catch (const std::exception& e) {
    log().error("runtime {}: hosted shutdown failed: {}", impl_->router.id(), e.what());
  }
  impl_.reset();
}

Runtime::~Runtime() {
  if (impl_ && impl_->broker.hosted()) {
    release_hosted();
    return;
  }
  if (impl_ && impl_->broker.on_broker_thread()) {
    // A thread cannot join itself, nor free what it runs on: begin the
    // shutdown and let another thread join the broker, then free it all.
    impl_->broker.shutdown();
    std::thread([impl = std::move(impl_)]() mutable {
      impl->broker.join();
      impl.reset();
    }).detach();
  }
}

std::uint32_t Runtime::id() const { return impl_->router.id(); }

Child Runtime::fork_child(ChildMain main, ChildOptions opts) {
  auto grace = opts.grace;
  return Child(::spindle::fork_child(impl_->router, std::move(main), std::move(opts)), grace);
}

Child Runtime::spawn_child(const std::string& program, const std::vector<std::string>& args,
                           ChildOptions opts) {
  auto grace = opts.grace;
  return Child(::spindle::spawn_child(impl_->router, program, args, std::move(opts)), grace);
}

Child Runtime::ssh(const std::string& host, SshOptions opts) {
  return Child(ssh_child(impl_->router, host, opts), opts.grace);
}

Context Runtime::context(std::uint32_t id, std::string name) const {
  return Context(impl_->router, id, name.empty() ? fmt::format("context-{}", id) : std::move(name));
}

bool Runtime::hosted() const { return impl_->broker.hosted(); }

void Runtime::start_shutdown(UniqueFunction<void()> done) {
  auto fn = std::make_shared<UniqueFunction<void()>>(std::move(done));
  impl_->broker.on_finished([fn] { (*fn)(); });
  impl_->broker.shutdown();
}

Router& Runtime::router() { return impl_->router; }
Broker& Runtime::broker() { return impl_->broker; }

}  // namespace spindle
