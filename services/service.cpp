// Deduplication keys a call by method and argument bytes. The first call of a
// key registers its reply state and computes; an identical call that arrives
// while that state is unanswered joins it (ReplyState::join) and returns at
// once, its worker free again. The state forgets the key as it answers, so a
// call arriving after the answer computes afresh: results are shared, never
// cached.
#include "services/service.h"

#include <fmt/format.h>

#include "broker/errors.h"
#include "broker/log.h"
#include "broker/summary_log.h"
#include "services/envelope.h"
#include "services/reasons.h"

namespace spindle::services {

Access Access::any() {
  return Access("any caller", [](const Caller&) { return true; });
}

Access Access::parents() {
  return Access("parents only", [](const Caller& c) {
    return c.auth_id == c.self_id || (c.parent_id && c.auth_id == *c.parent_id);
  });
}

Access Access::when(std::string description, Predicate pred) {
  if (!pred) throw Error("Access::when: empty predicate");
  return Access(std::move(description), std::move(pred));
}

const Reply& Request::reply() {
  if (!reply_.valid()) reply_ = Reply(std::make_shared<ReplyState>(router_, msg_));
  return reply_;
}

Reply Request::defer_reply() {
  deferred_ = true;
  return reply();
}

Service::Service(std::string name, RunMode mode) : name_(std::move(name)), mode_(mode) {
  if (name_.empty() || name_.size() > kMaxNameLength || name_.find('\0') != std::string::npos)
    throw Error(fmt::format("invalid service name '{}': 1 to {} bytes, no NUL", name_, kMaxNameLength));
}

void Service::expose(std::string method, Access access, Method fn, Encoding encoding, bool on_receiver) {
  if (method.empty() || method.size() > kMaxNameLength || method.find('\0') != std::string::npos)
    throw Error(fmt::format("service {}: invalid method name '{}'", name_, method));
  if (!fn) throw Error(fmt::format("service {}: method {} has no function", name_, method));
  if (!methods_.emplace(method, Exposed{std::move(access), std::move(fn), encoding, on_receiver}).second)
    throw Error(fmt::format("service {}: method {} is already exposed", name_, method));
}

const Service::Exposed* Service::find(std::string_view method) const {
  auto it = methods_.find(method);
  return it == methods_.end() ? nullptr : &it->second;
}

std::size_t Service::dedup_pending() const {
  std::lock_guard lk(dedup_mu_);
  return dedup_.size();
}

void Service::run(Request& req, const Exposed& m) {
  if (mode_ == RunMode::kDeduplicated) {
    std::string key = req.method();
    key.push_back('\0');
    key += req.args().to_string();
    std::lock_guard lk(dedup_mu_);
    auto it = dedup_.find(key);
    if (it != dedup_.end()) {
      if (auto st = it->second.lock(); st && st->join(req.message())) return;
    }
    auto st = req.reply().state();
    dedup_[key] = st;
    std::weak_ptr<ReplyState> me = st;
    st->on_answered([this, key, me] {
      std::lock_guard lk2(dedup_mu_);
      auto found = dedup_.find(key);
      // Only our own entry: once answered, a newer call may have replaced it.
      if (found != dedup_.end() && !found->second.owner_before(me) && !me.owner_before(found->second))
        dedup_.erase(found);
    });
  }
  const Reply& reply = req.reply();
  try {
    Payload result = m.fn(req);
    if (!req.deferred()) reply.send(std::move(result));
  } catch (...) {
    ThrownError t = current_thrown_error();
    // An exception's text often quotes the arguments it choked on: escaped,
    // and summed up, since a caller can send bad arguments as fast as it
    // writes (the caller itself gets each error in its reply).
    static SummaryLog threw;
    threw.note([&] { return fmt::format("service {}: {} threw {}: {:?}", name_, req.method(), t.type, t.message); });
    reply.fail(t.type, t.message);
  }
}

}  // namespace spindle::services
