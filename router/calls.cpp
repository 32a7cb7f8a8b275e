// Calls: a request registers a one-shot handler for its reply_to, whose
// respondent is the callee, and a deadline. Exactly one of the reply, a dead
// reply, a CallError, the deadline or the callee's disconnect completes it:
// whichever removes the handler from the table. Deadlines live in one ordered
// map served by one timer, armed for the earliest and re-armed only when an
// earlier one arrives, so a call costs no timer syscall of its own.
#include "router/router.h"

#include <fmt/format.h>

#include "broker/errors.h"
#include "broker/log.h"
#include "router/control.h"
#include "router/reasons.h"

namespace spindle {

// Registers a one-shot reply handler for `msg`, arms its deadline and sends
// it. `done` runs exactly once: with the reply, or with the exception a dead
// reply, CallError, timeout or disconnect turns into. Whoever removes the
// handler from the table completes the call, so these never race.
void Router::start_call(Message msg, std::chrono::milliseconds timeout, CallCompletion done) {
  const std::uint32_t dst = msg.header.dst_id;
  HandlerOptions ho;
  ho.persistent = false;
  ho.respondent = dst;
  auto shared_done = std::make_shared<CallCompletion>(std::move(done));
  std::uint32_t h = handlers_.add(
      [shared_done](Message&& reply) {
        if (reply.is_dead()) {
          (*shared_done)({}, std::make_exception_ptr(ChannelError(reply.text())));
        } else if (reply.is_call_error()) {
          CallErrorText e = parse_call_error(reply);
          (*shared_done)({}, std::make_exception_ptr(CallError(e.type, e.what)));
        } else {
          (*shared_done)(std::move(reply), nullptr);
        }
      },
      ho);
  msg.header.reply_to = h;
  CallDeadline d{Clock::now() + timeout, [this, h, shared_done, dst, timeout] {
                   if (handlers_.take(h))
                     (*shared_done)({}, std::make_exception_ptr(TimeoutError(fmt::format(
                                            "{}: no reply from context {} within {} ms",
                                            errtext::kCallTimedOut, dst, timeout.count()))));
                 }};
  try {
    send_impl(std::move(msg), timeout, std::move(d));
  } catch (...) {
    handlers_.take(h);
    throw;
  }
}

std::future<Message> Router::request(Message msg, std::chrono::milliseconds timeout) {
  auto promise = std::make_shared<std::promise<Message>>();
  auto fut = promise->get_future();
  start_call(std::move(msg), timeout, [promise](Message&& reply, std::exception_ptr err) {
    if (err) promise->set_exception(err);
    else promise->set_value(std::move(reply));
  });
  return fut;
}

// A blocking call waits on one atomic word (a futex) rather than a promise,
// which costs a second wake-up per reply.
Message Router::call(Message msg, std::chrono::milliseconds timeout) {
  if (broker_.on_broker_thread()) throw Error("call() would block the broker thread; use request()");
  struct Waiter {
    std::atomic<std::uint32_t> done{0};
    Message reply;
    std::exception_ptr error;
  };
  auto w = std::make_shared<Waiter>();
  start_call(std::move(msg), timeout, [w](Message&& reply, std::exception_ptr err) {
    w->reply = std::move(reply);
    w->error = err;
    w->done.store(1, std::memory_order_release);
    w->done.notify_one();
  });
  w->done.wait(0, std::memory_order_acquire);
  if (w->error) std::rethrow_exception(w->error);
  return std::move(w->reply);
}

void Router::arm_deadline(std::uint32_t handle, CallDeadline d) {
  auto it = deadlines_.emplace(d.when, std::make_pair(handle, std::move(d.expire)));
  deadline_of_[handle] = it;
  if (d.when < armed_for_) arm_deadline_timer(d.when);
}

void Router::arm_deadline_timer(Clock::time_point when) {
  armed_for_ = when;
  deadline_timer_.expires_at(when);  // cancels the wait armed for a later deadline
  deadline_timer_.async_wait([this](const std::error_code& ec) {
    if (ec == asio::error::operation_aborted) return;
    armed_for_ = Clock::time_point::max();
    expire_deadlines();
  });
}

void Router::cancel_deadline(std::uint32_t handle) {
  auto it = deadline_of_.find(handle);
  if (it == deadline_of_.end()) return;
  deadlines_.erase(it->second);
  deadline_of_.erase(it);
}

void Router::expire_deadlines() {
  const auto now = Clock::now();
  while (!deadlines_.empty() && deadlines_.begin()->first <= now) {
    auto node = deadlines_.extract(deadlines_.begin());
    deadline_of_.erase(node.mapped().first);
    node.mapped().second();
  }
  if (!deadlines_.empty()) arm_deadline_timer(deadlines_.begin()->first);
}

void Router::fail_handlers(std::vector<HandlerPtr> hs, const std::string& why) {
  for (HandlerPtr& h : hs) {
    cancel_deadline(h->handle);
    try {
      h->fn(dead_message(why));
    } catch (const std::exception& e) {
      log().error("handler threw while being failed ({}): {}", why, e.what());
    }
  }
}

}  // namespace spindle
