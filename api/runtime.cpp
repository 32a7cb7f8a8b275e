// Runtime is the owner of the Broker + Router pair that the internals use,
// behind a pimpl so that <spindle/runtime.h> names neither. The members are
// declared broker first, so the router (which shuts the broker down and
// joins it) is destroyed before the broker it borrows.
#include "spindle/runtime.h"

#include <thread>

#include <fmt/format.h>

#include "broker/broker.h"
#include "broker/log.h"
#include "router/child.h"
#include "router/router.h"

namespace spindle {

struct Runtime::Impl {
  explicit Impl(RouterOptions opts) : router(broker, std::move(opts)) {}
  Broker broker;
  Router router;
};

Runtime::Runtime(RouterOptions opts) : impl_(std::make_unique<Impl>(std::move(opts))) {}

Runtime::~Runtime() {
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

Context Runtime::context(std::uint32_t id, std::string name) const {
  return Context(impl_->router, id, name.empty() ? fmt::format("context-{}", id) : std::move(name));
}

Router& Runtime::router() { return impl_->router; }
Broker& Runtime::broker() { return impl_->broker; }

}  // namespace spindle
