// A Receiver's queue is filled by its handler, which only queues (it may
// run on any thread: a local sender's own, or the broker). The handler owns
// a closer: when the router drops the handler (del_handler, or the router's
// end), the closer runs and wakes every receive() still waiting, which then
// throws ShutdownError instead of waiting forever.
#include "spindle/channel.h"

#include <condition_variable>
#include <deque>
#include <mutex>

#include "broker/errors.h"
#include "router/router.h"

namespace spindle::detail {
namespace {
thread_local Router* tl_decoding = nullptr;
}  // namespace

DecodingScope::DecodingScope(Router& r) : outer_(tl_decoding) { tl_decoding = &r; }
DecodingScope::~DecodingScope() { tl_decoding = outer_; }
Router* DecodingScope::current() { return tl_decoding; }

struct ReceiverCore::State {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Payload> queue;
  bool closed = false;
  void close() {
    {
      std::lock_guard lk(mu);
      closed = true;
    }
    cv.notify_all();
  }
};

ReceiverCore::ReceiverCore(Router& router) : st_(std::make_shared<State>()) {
  std::shared_ptr<void> closer(nullptr, [st = st_](void*) { st->close(); });
  HandlerOptions opts;
  opts.any_thread = true;
  handle_ = router.add_handler(
      [st = st_, closer](Message&& m) {
        if (m.is_dead()) return;
        {
          std::lock_guard lk(st->mu);
          if (st->closed) return;
          st->queue.push_back(std::move(m.data));
        }
        st->cv.notify_one();
      },
      opts);
  self_ = Context(router, router.id(), "self");
}

ReceiverCore::~ReceiverCore() {
  st_->close();
  try {
    self_.router().del_handler(handle_);
  } catch (const ShutdownError&) {
    // the runtime has gone, and its handlers with it
  }
}

namespace {
// The next payload; the caller holds the lock and has waited for one or
// for the end.
Payload pop(std::deque<Payload>& queue) {
  if (queue.empty()) throw ShutdownError("receiver closed: its runtime has shut down");
  Payload p = std::move(queue.front());
  queue.pop_front();
  return p;
}
}  // namespace

Payload ReceiverCore::receive() {
  std::unique_lock lk(st_->mu);
  st_->cv.wait(lk, [&] { return !st_->queue.empty() || st_->closed; });
  return pop(st_->queue);
}

std::optional<Payload> ReceiverCore::receive_for(std::chrono::milliseconds timeout) {
  std::unique_lock lk(st_->mu);
  if (!st_->cv.wait_for(lk, timeout, [&] { return !st_->queue.empty() || st_->closed; }))
    return std::nullopt;
  return pop(st_->queue);
}

}  // namespace spindle::detail
