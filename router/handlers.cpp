#include "router/handlers.h"

namespace spindle {

std::uint32_t HandlerTable::add(HandlerFn fn, HandlerOptions opts, std::uint32_t handle) {
  auto h = std::make_shared<Handler>(Handler{std::move(fn), std::move(opts), 0});
  std::lock_guard lk(mu_);
  if (handle == 0) {
    // Skip handles that are taken or special; wraps within the dynamic range.
    do {
      handle = next_dynamic_++;
      if (next_dynamic_ == 0) next_dynamic_ = kFirstDynamicHandle;
    } while (map_.count(handle) || handle == kHandleIsDead);
  } else if (map_.count(handle)) {
    return 0;
  }
  h->handle = handle;
  map_.emplace(handle, std::move(h));
  return handle;
}

HandlerTable::Verdict HandlerTable::lookup_for_dispatch(const Message& m, HandlerPtr& out) {
  std::lock_guard lk(mu_);
  auto it = map_.find(m.header.handle);
  if (it == map_.end()) return Verdict::kNotFound;
  const HandlerOptions& o = it->second->opts;
  // A dead reply may come from any router on the way (no route, queue full,
  // peer gone), not just the respondent: let it through, as Mitogen does.
  if (o.respondent && *o.respondent != m.header.src_id && !m.is_dead())
    return Verdict::kWrongRespondent;
  if (o.policy && !o.policy(m)) return Verdict::kRefused;
  if (o.persistent) {
    out = it->second;
  } else {
    out = std::move(it->second);
    map_.erase(it);
  }
  return Verdict::kOk;
}

HandlerPtr HandlerTable::take(std::uint32_t handle) {
  std::lock_guard lk(mu_);
  auto it = map_.find(handle);
  if (it == map_.end()) return nullptr;
  HandlerPtr h = std::move(it->second);
  map_.erase(it);
  return h;
}

std::vector<HandlerPtr> HandlerTable::take_by_respondent(
    const std::function<bool(std::uint32_t)>& pred) {
  std::vector<HandlerPtr> out;
  std::lock_guard lk(mu_);
  for (auto it = map_.begin(); it != map_.end();) {
    if (it->second->opts.respondent && pred(*it->second->opts.respondent)) {
      out.push_back(std::move(it->second));
      it = map_.erase(it);
    } else {
      ++it;
    }
  }
  return out;
}

std::vector<HandlerPtr> HandlerTable::take_one_shot() {
  std::vector<HandlerPtr> out;
  std::lock_guard lk(mu_);
  for (auto it = map_.begin(); it != map_.end();) {
    if (!it->second->opts.persistent) {
      out.push_back(std::move(it->second));
      it = map_.erase(it);
    } else {
      ++it;
    }
  }
  return out;
}

std::size_t HandlerTable::size() const {
  std::lock_guard lk(mu_);
  return map_.size();
}

}  // namespace spindle
