// A batch is a thread-local mark naming the runtime's link (Router::
// gather_sends); the router reads it on each one-way send. Ending the
// outermost batch of a runtime wakes its broker once; an inner one of the
// same runtime leaves that to the outer. Ending closes the mark wherever it
// runs, so a batch ended on another thread never leaves its own thread
// gathering without a wake-up.
#include "spindle/send_batch.h"

#include <fmt/format.h>

#include "router/router.h"

namespace spindle {

SendBatch::SendBatch(const Context& through) : link_(through.link_) {
  if (!link_) throw ShutdownError("SendBatch: the Context refers to no runtime");
  SectionGate::Scope inside(link_->gate);
  if (!inside)
    throw ShutdownError(fmt::format("SendBatch: the runtime of context {} has been destroyed", through.id()));
  Router::GatherMarks marks = Router::gather_sends(link_.get());
  mine_ = std::move(marks.mine);
  previous_ = std::move(marks.previous);
}

SendBatch::~SendBatch() {
  if (Router::end_gather({std::move(mine_), std::move(previous_)})) return;  // the outer one hands over
  SectionGate::Scope inside(link_->gate);
  if (inside) link_->router.load(std::memory_order_relaxed)->hand_over_sends();
}

}  // namespace spindle
