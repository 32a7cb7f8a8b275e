// A batch is a thread-local mark naming the runtime's link (Router::
// gather_sends); the router reads it on each one-way send. Ending the
// outermost batch of a runtime wakes its broker once; an inner one of the
// same runtime leaves that to the outer.
#include "spindle/send_batch.h"

#include <mutex>
#include <shared_mutex>

#include <fmt/format.h>

#include "router/router.h"

namespace spindle {

SendBatch::SendBatch(const Context& through) : link_(through.link_) {
  if (!link_) throw ShutdownError("SendBatch: the Context refers to no runtime");
  std::shared_lock lk(link_->mu);
  if (!link_->router)
    throw ShutdownError(fmt::format("SendBatch: the runtime of context {} has been destroyed", through.id()));
  previous_ = Router::gather_sends(link_.get());
}

SendBatch::~SendBatch() {
  Router::gather_sends(static_cast<const detail::RouterLink*>(previous_));
  if (previous_ == link_.get()) return;  // the outer batch of this runtime hands over
  std::shared_lock lk(link_->mu);
  if (link_->router) link_->router->hand_over_sends();
}

}  // namespace spindle
