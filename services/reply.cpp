// The answer is built once per request header and sent with
// Router::post_reply(), which never waits: the caller asked for it, so it is
// charged to the caller's queue however full, and a caller that stops reading
// is paused and then disconnected by its own account's limits, never by
// blocking a worker. Dead replies use route(), which never waits either.
#include "services/reply.h"

#include <future>

#include <fmt/format.h>

#include "broker/log.h"
#include "broker/summary_log.h"
#include "services/reasons.h"

namespace spindle::services {

void send_dead_reply(Router& router, const Message& request, std::string_view reason) {
  if (!Message::wants_dead_reply(request)) {
    // The reason may carry the caller's bytes (a name it asked for): escaped,
    // and summed up, since a caller can send such calls as fast as it writes.
    static SummaryLog unanswered;
    unanswered.note([&] {
      return fmt::format("service call from context {} not answered (no reply_to): {:?}", request.header.src_id,
                         reason);
    });
    return;
  }
  try {
    router.route(Message::dead_reply(request, reason));
  } catch (const std::exception& e) {
    // A peer that takes no frame this large (its max_message_size) meets
    // this on every call it makes: summed up, not a line per call.
    static SummaryLog unsent(spdlog::level::warn);
    unsent.note([&] {
      return fmt::format("cannot send dead reply to context {} ({:?}): {}", request.header.src_id, reason,
                         e.what());
    });
  }
}

void del_handler_on_broker(Router& router, std::uint32_t handle) {
  std::promise<void> gone;
  auto f = gone.get_future();
  if (!router.broker().on_broker_thread() && router.broker().try_defer([&router, handle, &gone] {
        router.del_handler(handle);
        gone.set_value();
      }))
    f.wait();
  else
    router.del_handler(handle);
}

ReplyState::ReplyState(Router& router, const Message& request) : router_(router) {
  requests_.push_back({request.header, request.sender_charge});
}

ReplyState::~ReplyState() {
  if (!answered_) answer(Kind::kDead, {}, {}, reason::kNoReply);
}

bool ReplyState::join(const Message& request) {
  std::lock_guard lk(mu_);
  // Joined callers wait outside any lane, so their number is bounded here: a
  // caller over it starts a computation of its own (on a worker, so bounded
  // by the lane and the pool instead).
  if (answered_ || requests_.size() >= kMaxJoined) return false;
  requests_.push_back({request.header, request.sender_charge});
  return true;
}

void ReplyState::on_answered(std::function<void()> fn) {
  std::lock_guard lk(mu_);
  on_answered_ = std::move(fn);
}

bool ReplyState::answered() const {
  std::lock_guard lk(mu_);
  return answered_;
}

std::size_t ReplyState::joined() const {
  std::lock_guard lk(mu_);
  return requests_.size();
}

bool ReplyState::answer(Kind kind, Payload data, std::string_view type, std::string_view text) {
  std::vector<Waiting> to;  // their charges go once the answers are queued (and charged)
  std::function<void()> done;
  {
    std::lock_guard lk(mu_);
    if (answered_) return false;
    answered_ = true;
    to.swap(requests_);
    done.swap(on_answered_);
  }
  if (done) done();
  for (const Waiting& w : to) {
    const Header& h = w.header;
    Message req;
    req.header = h;
    if (!Message::wants_dead_reply(req)) continue;
    try {
      switch (kind) {
        case Kind::kResult: router_.post_reply(Message::reply_to(req, data)); break;
        case Kind::kCallError: router_.post_reply(Message::call_error(req, type, text)); break;
        case Kind::kDead: send_dead_reply(router_, req, text); break;
      }
    } catch (const std::exception& e) {
      static SummaryLog unanswered(spdlog::level::warn);
      unanswered.note([&] { return fmt::format("cannot answer service call from context {}: {}", h.src_id, e.what()); });
    }
  }
  return true;
}

bool Reply::send(Payload result) const {
  return st_ && st_->answer(ReplyState::Kind::kResult, std::move(result));
}

bool Reply::fail(std::string_view type, std::string_view message) const {
  return st_ && st_->answer(ReplyState::Kind::kCallError, {}, type, message);
}

bool Reply::sent() const { return st_ && st_->answered(); }

}  // namespace spindle::services
