// Calls: a request takes a CallTable slot whose handle is its reply_to, and
// is completed exactly once (call_table.h). A blocking call() writes its
// request at once when the stream is idle, then runs the broker's loop itself
// while no other thread does (broker.h, leader/follower), or else sleeps on
// its slot's word with its own deadline: the reply reaches it with no
// hand-off between threads, and no allocation. An asynchronous request's
// deadline is kept by the broker: one timer armed for the earliest pending
// deadline, re-armed only when an earlier one arrives or it fires.
#include <fmt/format.h>

#include "broker/errors.h"
#include "broker/log.h"
#include "router/control.h"
#include "router/reasons.h"
#include "router/router.h"

namespace spindle {
namespace {

// How many deadline requests from other threads may wait for the broker
// before one of them wakes it (Router::arm_deadline).
constexpr std::uint32_t kArmRequestsPerWake = 256;

}  // namespace

std::exception_ptr Router::timeout_error(std::uint32_t callee, std::chrono::milliseconds timeout) const {
  return std::make_exception_ptr(TimeoutError(fmt::format(
      "{}: no reply from context {} within {} ms", errtext::kCallTimedOut, callee, timeout.count())));
}

Message Router::call(Message msg, std::chrono::milliseconds timeout) {
  if (broker_.on_broker_thread()) throw Error("call() would block the broker thread; use request()");
  const std::uint32_t dst = msg.header.dst_id;
  const auto deadline = Clock::now() + timeout;
  std::uint32_t handle = calls_.open_blocking(dst);
  msg.header.reply_to = handle;
  try {
    Header h = msg.header;
    submit(h, {}, &msg, timeout, true);
  } catch (...) {
    calls_.abandon(handle);
    throw;
  }
  return calls_.wait(handle, deadline, [&] { return timeout_error(dst, timeout); });
}

void Router::request(Message msg, std::chrono::milliseconds timeout, CallTable::Completion done) {
  start_request(std::move(msg), timeout, std::move(done), false);
}

void Router::start_request(Message msg, std::chrono::milliseconds timeout, CallTable::Completion done,
                           bool anywhere) {
  const std::uint32_t dst = msg.header.dst_id;
  std::uint32_t handle = calls_.open_async(dst, std::move(done), anywhere);
  msg.header.reply_to = handle;
  try {
    Header h = msg.header;
    submit(h, {}, &msg, timeout, true, handle);
  } catch (...) {
    calls_.abandon(handle);
    throw;
  }
}

std::future<Message> Router::request(Message msg, std::chrono::milliseconds timeout) {
  std::promise<Message> promise;
  auto fut = promise.get_future();
  // Fulfilling a promise is thread-safe: the thread that brings the reply
  // (a worker answering a local call) completes it, with no broker hop.
  auto fulfil = [p = std::move(promise)](Message&& reply, std::exception_ptr err) mutable {
    if (err) p.set_exception(err);
    else p.set_value(std::move(reply));
  };
  start_request(std::move(msg), timeout, std::move(fulfil), /*anywhere=*/true);
  return fut;
}

// Any thread. The broker keeps async deadlines. From another thread the arm
// is requested (CallTable::request_arm) and taken up whenever the broker next
// arms its timer: at the latest when a timer already due by `when` fires, or
// when kArmRequestsPerWake requests have piled up.
// So the broker is woken only for a deadline earlier than its timer's (or
// with none armed): with one timeout for every call, once per timer, where
// it used to be woken for every asynchronous request written from a thread
// of the application. A call completed meanwhile is not armed (arm_deadline
// checks the slot's generation), and one still pending when the broker has
// stopped is failed by the shutdown.
//
// The request's push and the load of call_timer_due_ here, against the
// timer's store of "none" and its look at the requests (arm_call_timer),
// are sequentially consistent: of two racing, at least one sees the other,
// so a request is never left with no timer due before it.
void Router::arm_deadline(std::uint32_t slot, Clock::time_point when) {
  if (broker_.on_broker_thread()) {
    calls_.arm_deadline(slot, when);
    arm_call_timer();
    return;
  }
  // A call already answered (a local handler that replied at once) needs
  // no deadline; the broker reaps its slot (CallTable::finish).
  if (!calls_.is_pending(slot)) return;
  const std::uint32_t waiting = calls_.request_arm(slot, when);
  // Every kArmRequestsPerWake requests wake it too: the requests of calls
  // answered off the broker thread (a pool worker's reply to a local call)
  // would otherwise pile up until the timer fires.
  if (when.time_since_epoch().count() < call_timer_due_.load(std::memory_order_seq_cst) ||
      waiting % kArmRequestsPerWake == 0)
    broker_.try_defer([this] { arm_call_timer(); });
}

// Broker thread: takes up the requested arms, then arms the one timer for
// the earliest async deadline, or for the earliest requested one if that is
// earlier, though its call is over. The broker may well read a reply before
// it takes up its call's request (a loaded machine runs it late, and both
// are ready at once): with no timer left, the next call's deadline would
// then be "earlier than the timer's" and wake it again, and so each call in
// turn. A timer that stays armed for a call that is over costs one turn
// when it fires, and spares a wake-up per call until then.
void Router::arm_call_timer() {
  const auto requested = calls_.arm_requested();
  auto next = calls_.next_deadline();
  if (requested && (!next || *requested < *next)) next = requested;
  if (!next || next->time_since_epoch().count() >= call_timer_due_.load(std::memory_order_relaxed)) return;
  set_call_timer_at(*next);
  call_timer_.expires_at(*next);  // cancels a wait armed for a later deadline
  // link_: a hosted loop (the application's) may run this after the router
  // is gone, if the timer fired just before it was destroyed.
  call_timer_.async_wait([this, link = link_](const std::error_code& ec) {
    if (ec == asio::error::operation_aborted || !link->alive()) return;
    set_call_timer_at(Clock::time_point::max());
    calls_.arm_requested();  // after the store above: see arm_deadline
    calls_.expire(Clock::now(), [](std::uint32_t callee) {
      return std::make_exception_ptr(TimeoutError(fmt::format(
          "{}: no reply from context {} in time", errtext::kCallTimedOut, callee)));
    });
    arm_call_timer();
  });
}

void Router::set_call_timer_at(Clock::time_point at) {
  call_timer_due_.store(at.time_since_epoch().count(), std::memory_order_seq_cst);
}

}  // namespace spindle
