#include "router/handlers.h"

#include <algorithm>

#include "router/call_table.h"

namespace spindle {

HandlerTable::HandlerTable() { publish(); }
HandlerTable::~HandlerTable() = default;

std::uint32_t HandlerTable::add(HandlerFn fn, HandlerOptions opts, std::uint32_t handle) {
  if (handle == 0) {
    // Skip handles that are taken or special; wraps within the dynamic range,
    // which ends where the call handles begin.
    do {
      handle = next_dynamic_++;
      if (next_dynamic_ >= kCallHandleBit) next_dynamic_ = kFirstDynamicHandle;
    } while (map_.count(handle) || handle == kHandleIsDead);
  } else if (map_.count(handle) || is_call_handle(handle)) {
    return 0;
  }
  const bool any = opts.any_thread;
  map_.emplace(handle, std::make_shared<Handler>(Handler{std::move(fn), std::move(opts), handle}));
  if (any) publish();
  return handle;
}

const Handler* HandlerTable::find(std::uint32_t handle) {
  if (last_found_ && last_handle_ == handle) return last_found_;
  auto it = map_.find(handle);
  if (it == map_.end()) return nullptr;
  last_handle_ = handle;
  return last_found_ = it->second.get();
}

bool HandlerTable::remove(std::uint32_t handle) {
  auto it = map_.find(handle);
  if (it == map_.end()) return false;
  const bool any = it->second->opts.any_thread;
  if (last_handle_ == handle) last_found_ = nullptr;
  if (dispatching_ > 0) retired_.push_back(std::move(it->second));
  map_.erase(it);
  if (any) publish();
  return true;
}

void HandlerTable::publish() {
  auto snap = std::make_unique<Snapshot>();
  for (auto& [h, p] : map_)
    if (p->opts.any_thread) snap->push_back(p);
  std::sort(snap->begin(), snap->end(), [](const HandlerPtr& a, const HandlerPtr& b) {
    return a->handle < b->handle;
  });
  any_thread_.store(snap.get(), std::memory_order_release);
  snapshots_.push_back(std::move(snap));
}

HandlerPtr HandlerTable::find_any_thread(std::uint32_t handle) const {
  const Snapshot* s = any_thread_.load(std::memory_order_acquire);
  auto it = std::lower_bound(s->begin(), s->end(), handle,
                             [](const HandlerPtr& p, std::uint32_t h) { return p->handle < h; });
  if (it == s->end() || (*it)->handle != handle) return nullptr;
  return *it;
}

}  // namespace spindle
